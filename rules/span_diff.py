"""The span diff: the short spans in which two otherwise identical texts differ, with their anchors.

Owns ``diff_spans`` and ``Span`` (a differing span, where it lies in both texts, and the identical text just
before and after it cut to anchors), and the common prefix/suffix lengths it and the learner's nearest-text
search share.

Invariants:

- bounded work per pair: one common prefix and suffix (binary search over slice compares), then one
  token-level diff (``difflib``) of only the region between them, skipped when that region is longer than
  ``max_middle_chars``.
- unrelated texts give no spans (None): a pair gives spans only when its identical text is at least
  ``min_template_chars`` and at least ``1 - max_diff_share`` of the text, in at most ``max_spans`` spans of
  at most ``max_span_chars`` characters each, none holding a line break, each with anchors of at least
  ``min_anchor_chars`` (unless the anchor reaches the text's edge).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from rules.learn_config import LearnConfig

_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")

_TRAILING_PUNCT = ".,;:!?)]}\"'"

_LEADING_PUNCT = "\"'([{"


@dataclass(frozen=True)
class Span:
    """One differing span of a text pair: ``old[old_start:old_end]`` became ``new[new_start:new_end]``;
    ``left``/``right`` are the identical texts just before and after it (already cut to anchors);
    ``at_start``/``at_end``: the anchor reaches the start/end of the text."""

    old_start: int
    old_end: int
    new_start: int
    new_end: int
    left: str
    right: str
    at_start: bool
    at_end: bool


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (strings or token id lists; binary search over
    slice compares: C-speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_suffix_len(a: Sequence[Any], b: Sequence[Any], limit: int) -> int:
    """Length of the longest common suffix, at most ``limit`` (binary search over slice compares)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"


def diff_spans(old: str, new: str, config: LearnConfig) -> list[Span] | None:
    """The short differing spans between two texts, or None when they do not differ only in short spans
    (see this module's invariants). Equal texts give ``[]``.

    Spans are whole whitespace-delimited words (a changed day inside ``2025-03-04`` gives the whole date);
    sentence punctuation both values end with is left in the right anchor; differences closer than
    ``merge_gap_chars`` are one span.
    """
    if old == new:
        return []
    p = common_prefix_len(old, new)
    s = common_suffix_len(old, new, min(len(old), len(new)) - p)
    while p > 0 and _is_word(old[p - 1]):
        p -= 1
    while s > 0 and _is_word(old[len(old) - s]):
        s -= 1
    old_mid, new_mid = old[p : len(old) - s], new[p : len(new) - s]
    if len(old_mid) > config.max_middle_chars or len(new_mid) > config.max_middle_chars:
        return None
    a = _TOKEN.findall(old_mid)
    b = _TOKEN.findall(new_mid)
    a_off = _offsets(a, p)
    b_off = _offsets(b, p)
    raw: list[list[int]] = []
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        raw.append([a_off[i1], a_off[i2], b_off[j1], b_off[j2]])
    spans = _widen_and_merge(old, new, raw, config.merge_gap_chars)
    if not spans or len(spans) > config.max_spans:
        return None
    changed = 0
    for os_, oe, ns, ne in spans:
        for text, start, end in ((old, os_, oe), (new, ns, ne)):
            if not 1 <= end - start <= config.max_span_chars or "\n" in text[start:end]:
                return None
        changed += max(oe - os_, ne - ns)
    equal = len(new) - sum(ne - ns for _, _, ns, ne in spans)
    if equal < config.min_template_chars or changed > config.max_diff_share * max(len(old), len(new)):
        return None
    out: list[Span] = []
    for k, (os_, oe, ns, ne) in enumerate(spans):
        left_from = spans[k - 1][3] if k else 0
        right_to = spans[k + 1][2] if k + 1 < len(spans) else len(new)
        left, at_start = _left_anchor(new[left_from:ns], left_from == 0, config)
        right, at_end = _right_anchor(new[ne:right_to], right_to == len(new), config)
        if left is None or right is None:
            return None
        out.append(Span(os_, oe, ns, ne, left, right, at_start, at_end))
    return out


def _offsets(tokens: list[str], base: int) -> list[int]:
    out = [base]
    for t in tokens:
        out.append(out[-1] + len(t))
    return out


def _widen_and_merge(old: str, new: str, raw: list[list[int]], gap: int) -> list[tuple[int, int, int, int]]:
    """Widen each difference to whitespace-delimited words (the context around is identical in both texts,
    so both sides widen alike), give back common trailing punctuation, merge differences closer than
    ``gap``."""
    widened: list[list[int]] = []
    for os_, oe, ns, ne in raw:
        while os_ > 0 and ns > 0 and not old[os_ - 1].isspace() and old[os_ - 1] == new[ns - 1]:
            os_, ns = os_ - 1, ns - 1
        while oe < len(old) and ne < len(new) and not old[oe].isspace() and old[oe] == new[ne]:
            oe, ne = oe + 1, ne + 1
        while oe - os_ > 1 and ne - ns > 1 and old[oe - 1] == new[ne - 1] and old[oe - 1] in _TRAILING_PUNCT:
            oe, ne = oe - 1, ne - 1
        # an opening quote or bracket both values start with stays in the left anchor, so a quoted value is
        # learned without its quotes and its string is never cut in half ("ts": "2026-..." keeps "ts": "")
        while oe - os_ > 1 and ne - ns > 1 and old[os_] == new[ns] and old[os_] in _LEADING_PUNCT:
            os_, ns = os_ + 1, ns + 1
        if widened and ns - widened[-1][3] < gap:
            widened[-1][1], widened[-1][3] = max(widened[-1][1], oe), max(widened[-1][3], ne)
        else:
            widened.append([os_, oe, ns, ne])
    return [(a, b, c, d) for a, b, c, d in widened]


def _left_anchor(context: str, at_start: bool, config: LearnConfig) -> tuple[str | None, bool]:
    """The left anchor: the shortest end of ``context`` of at least ``min_anchor_chars`` that starts a word
    (after whitespace), at most ``anchor_chars``, taken back to the line break before it when that is within
    ``anchor_chars``; the whole context when it reaches the text's start within that; None when too short. Short anchors are less likely to hold another, not yet known, value."""
    if at_start and len(context) <= config.anchor_chars:
        short = len(context) < config.min_anchor_chars
        n = _word_cut(context[::-1], config)
        return (context, True) if short or n is None else (context[len(context) - n :], False)
    if len(context) < config.min_anchor_chars:
        return None, False
    n = _word_cut(context[::-1], config)
    anchor = context[len(context) - (n or config.anchor_chars) :]
    line_start = context.rfind("\n", len(context) - config.anchor_chars)
    if "\n" not in anchor and line_start >= 0:
        # the value's line starts within reach: the anchor keeps that line break, so a labelled field's
        # anchor holds its whole label ("\nApp version: ") and the slot matches at a line's start only
        anchor = context[line_start:]
    return anchor, False


def _right_anchor(context: str, at_end: bool, config: LearnConfig) -> tuple[str | None, bool]:
    """The right anchor: like ``_left_anchor``, the shortest start of ``context`` ending at a word's end."""
    if at_end and len(context) <= config.anchor_chars:
        short = len(context) < config.min_anchor_chars
        n = _word_cut(context, config)
        return (context, True) if short or n is None else (context[:n], False)
    if len(context) < config.min_anchor_chars:
        return None, False
    n = _word_cut(context, config)
    return context[: n or config.anchor_chars], False


def _word_cut(context: str, config: LearnConfig) -> int | None:
    """The least n in [min_anchor_chars, anchor_chars] with ``context[n]`` whitespace (a word ends there),
    or None."""
    for n in range(config.min_anchor_chars, min(config.anchor_chars, len(context) - 1) + 1):
        if context[n].isspace():
            return n
    return None
