"""Learned volatile slots: spans of system/developer text that change between otherwise identical prompts.

Rules never know every product's prompt, so the gateway learns the rest from traffic. For each model+tenant
a ``SlotLearner`` keeps a small sample of recent system/developer texts (never user, assistant or tool
text). When a new text differs from its nearest sampled text only in short spans with identical text around
them, each span is recorded as a *candidate*: its anchors (the identical text just before and after it) and
a one-way hash of each value seen there. A candidate whose anchors have been seen with ``min_distinct``
distinct values becomes a *learned slot*. A slot becomes a ``hoist`` rule: escaped left anchor, a bounded
value class built from the characters the values used, escaped right anchor, in RE2 syntax (linear time),
loadable by ``rules.load_ruleset`` from the YAML that ``export_yaml`` writes.

Modes: ``off`` (nothing is sampled), ``suggest`` (the default: slots are learned, listed and exported, never
applied), ``apply`` (``rules_for`` also returns them as rules for the canonicalizer).

Invariants:

- values are never stored: a candidate keeps value hashes (8-byte BLAKE2b), lengths and character classes.
  ``slots`` (the stats listing) holds no prompt text at all: anchors appear as hashes and lengths. The
  exported rule file holds the anchors (template text, which a person reviews), never a value.
- bounded memory whatever the traffic: at most ``max_keys`` model+tenant keys (LRU), ``sample_size`` texts
  of at most ``max_text_chars`` each per key, ``max_sample_chars`` sampled characters in all, and
  ``max_candidates`` candidates of at most ``max_value_hashes`` hashes per key (see ``footprint``).
- bounded work per text: one linear scan per sampled text to find the nearest, then one token-level diff
  (``difflib``) of only the region between their common prefix and suffix, skipped when that region is
  longer than ``max_middle_chars``.
- unrelated prompts teach nothing: a pair is used only when its identical text is at least
  ``min_template_chars`` and at least ``1 - max_diff_share`` of the text, in at most ``max_spans`` spans of
  at most ``max_span_chars`` characters each, none holding a line break.

Not thread-safe by itself; each public method takes the learner's lock.
"""

from __future__ import annotations

import copy
import hashlib
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

import yaml

from rules.messages import get_text, text_parts
from rules.model import DEFAULT_PLACEMENT, MessageSelector, Rule
from rules.patterns import compile_pattern
from rules.placement import extract_turn_blocks

LEARNED_MODES: tuple[str, ...] = ("off", "suggest", "apply")
"""``off``: learn nothing; ``suggest`` (default): learn, list and export; ``apply``: also hoist."""

LEARNED_ROLES: frozenset[str] = frozenset({"system", "developer"})
"""The only roles whose text is ever sampled."""

LEARNED_FILE = "<learned>"
"""``Rule.file`` of rules built by ``SlotLearner.rules_for``."""

_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")
_TRAILING_PUNCT = ".,;:!?)]}\"'"
_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_MAX_PUNCT = 24
_MAX_COMPILED = 1024


@dataclass(frozen=True)
class LearnConfig:
    """Bounds and thresholds of a ``SlotLearner`` (all lengths in Python characters).

    Attributes:
        mode: one of ``LEARNED_MODES``.
        min_distinct: distinct values a candidate needs to become a slot.
        sample_size: texts sampled per model+tenant.
        max_keys: model+tenant keys kept (least recently used dropped first).
        max_text_chars: longer texts are not sampled.
        max_sample_chars: sampled characters over all keys.
        max_middle_chars: a pair whose differing middle region is longer is not diffed.
        max_span_chars: longest value a span may hold (also the upper bound of a slot's value class).
        max_spans: most differing spans a pair may have.
        max_diff_share: most of a text that may differ.
        merge_gap_chars: differences closer than this are one span.
        min_template_chars: least identical text a pair must share.
        min_anchor_chars: least identical text on each side of a span (unless the span touches the text's edge).
        anchor_chars: most characters an anchor keeps.
        max_candidates: candidates (slots included) per key.
        max_value_hashes: distinct value hashes kept per candidate (the distinct count saturates there).
    """

    mode: str = "suggest"
    min_distinct: int = 3
    sample_size: int = 8
    max_keys: int = 256
    max_text_chars: int = 32768
    max_sample_chars: int = 4_000_000
    max_middle_chars: int = 2048
    max_span_chars: int = 64
    max_spans: int = 4
    max_diff_share: float = 0.2
    merge_gap_chars: int = 12
    min_template_chars: int = 64
    min_anchor_chars: int = 12
    anchor_chars: int = 40
    max_candidates: int = 128
    max_value_hashes: int = 32

    def __post_init__(self) -> None:
        if self.mode not in LEARNED_MODES:
            raise ValueError(f"unknown learned-slot mode {self.mode!r} (one of: {', '.join(LEARNED_MODES)})")
        for name in (
            "min_distinct",
            "sample_size",
            "max_keys",
            "max_text_chars",
            "max_sample_chars",
            "max_middle_chars",
            "max_span_chars",
            "max_spans",
            "min_template_chars",
            "min_anchor_chars",
            "anchor_chars",
            "max_candidates",
            "max_value_hashes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.min_distinct < 2:
            raise ValueError("min_distinct must be at least 2")
        if self.max_value_hashes < self.min_distinct:
            raise ValueError("max_value_hashes must be at least min_distinct")
        if self.anchor_chars < self.min_anchor_chars:
            raise ValueError("anchor_chars must be at least min_anchor_chars")
        if not 0 < self.max_diff_share < 1:
            raise ValueError("max_diff_share must be between 0 and 1")


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


@dataclass
class _Candidate:
    left: str
    right: str
    at_start: bool
    at_end: bool
    value_hashes: set[bytes] = field(default_factory=set)
    min_len: int = 1 << 30
    max_len: int = 0
    classes: set[str] = field(default_factory=set)
    punct: set[str] = field(default_factory=set)
    observations: int = 0
    first_seen: float = 0.0
    last_seen: float = 0.0
    slot_since: float | None = None

    def add_value(self, value: str, digest: bytes, cap: int) -> bool:
        """Record one value's shape; False when its characters are too varied to be a value class."""
        classes, punct = value_classes(value)
        if len(self.punct | punct) > _MAX_PUNCT:
            return False
        self.classes |= classes
        self.punct |= punct
        self.min_len = min(self.min_len, len(value))
        self.max_len = max(self.max_len, len(value))
        if len(self.value_hashes) < cap:
            self.value_hashes.add(digest)
        return True


@dataclass
class _Key:
    sample: deque[str]
    candidates: OrderedDict[tuple[str, str, bool, bool], _Candidate] = field(default_factory=OrderedDict)
    sample_chars: int = 0


def value_classes(value: str) -> tuple[set[str], set[str]]:
    """(character classes, punctuation characters) of a value: classes among ``digit``, ``lower``, ``upper``,
    ``space``, ``letter`` (non-ASCII letters), ``number`` (non-ASCII digits); every other character is
    returned as itself in the second set."""
    classes: set[str] = set()
    punct: set[str] = set()
    for c in value:
        if "0" <= c <= "9":
            classes.add("digit")
        elif "a" <= c <= "z":
            classes.add("lower")
        elif "A" <= c <= "Z":
            classes.add("upper")
        elif c in " \t":
            classes.add("space")
        elif c in _ASCII_PUNCT:
            punct.add(c)
        elif c.isalpha():
            classes.add("letter")
        elif c.isdigit():
            classes.add("number")
        else:
            punct.add(c)
    return classes, punct


def escape_re2(text: str) -> str:
    """``text`` as an RE2 literal: ASCII punctuation backslash-escaped (``%`` too, so no ``%{NAME}`` fragment
    reference can appear), ``\\n``/``\\t``/``\\r`` written as escapes, other control characters as
    ``\\x{HH}``; letters, digits, spaces and non-ASCII characters kept as they are."""
    out: list[str] = []
    for c in text:
        if c == "\n":
            out.append(r"\n")
        elif c == "\t":
            out.append(r"\t")
        elif c == "\r":
            out.append(r"\r")
        elif c in _ASCII_PUNCT:
            out.append("\\" + c)
        elif ord(c) < 32 or ord(c) == 127:
            out.append(f"\\x{{{ord(c):02X}}}")
        else:
            out.append(c)
    return "".join(out)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over slice compares: C-speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix_len(a: str, b: str, limit: int) -> int:
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
    (see the module invariants). Equal texts give ``[]``.

    Spans are whole whitespace-delimited words (a changed day inside ``2025-03-04`` gives the whole date);
    sentence punctuation both values end with is left in the right anchor; differences closer than
    ``merge_gap_chars`` are one span.
    """
    if old == new:
        return []
    p = _common_prefix_len(old, new)
    s = _common_suffix_len(old, new, min(len(old), len(new)) - p)
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
        if widened and ns - widened[-1][3] < gap:
            widened[-1][1], widened[-1][3] = max(widened[-1][1], oe), max(widened[-1][3], ne)
        else:
            widened.append([os_, oe, ns, ne])
    return [(a, b, c, d) for a, b, c, d in widened]


def _left_anchor(context: str, at_start: bool, config: LearnConfig) -> tuple[str | None, bool]:
    """The left anchor: the shortest end of ``context`` of at least ``min_anchor_chars`` that starts a word
    (after whitespace), at most ``anchor_chars``; the whole context when it reaches the text's start within
    that; None when too short. Short anchors are less likely to hold another, not yet known, value."""
    if at_start and len(context) <= config.anchor_chars:
        short = len(context) < config.min_anchor_chars
        n = _word_cut(context[::-1], config)
        return (context, True) if short or n is None else (context[len(context) - n :], False)
    if len(context) < config.min_anchor_chars:
        return None, False
    n = _word_cut(context[::-1], config)
    return context[len(context) - (n or config.anchor_chars) :], False


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


def _hash(*parts: str | bytes) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        data = p.encode("utf-8") if isinstance(p, str) else p
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def _value_class(candidate: _Candidate, max_span: int) -> str:
    """The RE2 value class of a candidate: the classes its values used, lengths from half the shortest to
    twice the longest (within 1..``max_span``), matched lazily so the nearest right anchor ends it."""
    members = []
    order = (
        ("digit", "0-9"),
        ("lower", "a-z"),
        ("upper", "A-Z"),
        ("space", " "),
        ("letter", r"\p{L}"),
        ("number", r"\p{N}"),
    )
    for name, piece in order:
        if name in candidate.classes:
            members.append(piece)
    for c in sorted(candidate.punct):
        members.append(escape_re2(c) if c in _ASCII_PUNCT or ord(c) < 32 else c)
    lo = max(1, candidate.min_len // 2)
    hi = max(lo, min(max_span, candidate.max_len * 2))
    return f"[{''.join(members)}]{{{lo},{hi}}}?"


class SlotLearner:
    """Learns volatile slots per model+tenant from system/developer texts (see the module docstring).

    Args:
        config: bounds and thresholds; ``LearnConfig()`` by default.
        clock: seconds since the epoch (``time.time`` by default; tests pass their own).
    """

    def __init__(self, config: LearnConfig | None = None, clock: Any = time.time) -> None:
        self.config = config or LearnConfig()
        self._clock = clock
        self._keys: OrderedDict[tuple[str, str], _Key] = OrderedDict()
        self._sample_chars = 0
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:
        """The configured mode (one of ``LEARNED_MODES``)."""
        return self.config.mode

    # ----- learning ---------------------------------------------------------------------------------------
    def observe(self, model: str, tenant: str, messages: list[dict[str, Any]]) -> int:
        """Sample the system/developer texts of one request and learn from them. Pass the canonical messages
        (``Canonical.messages``, after the rules): what a rule already hoists is then never learned again, and a
        hoisted-value block at the end of a system message (``system_end`` placement) is taken out first.

        Returns:
            the number of spans recorded (0 in mode ``off``). Messages of other roles are never read.
        """
        if self.config.mode == "off":
            return 0
        chosen = [
            copy.deepcopy(m) for m in messages if isinstance(m, dict) and m.get("role") in LEARNED_ROLES
        ]
        extract_turn_blocks(chosen, 0, len(chosen))  # values the rules already hoisted are not template text
        texts = [get_text(m, part) for m in chosen for part in text_parts(m)]
        recorded = 0
        for text in texts:
            recorded += self.observe_text(model, tenant, text)
        return recorded

    def observe_text(self, model: str, tenant: str, text: str) -> int:
        """Learn from one system/developer text (the caller guarantees the role). Returns spans recorded."""
        cfg = self.config
        if cfg.mode == "off" or not isinstance(text, str):
            return 0
        if not cfg.min_template_chars <= len(text) <= cfg.max_text_chars:
            return 0
        with self._lock:
            key = self._key(model, tenant)
            if text in key.sample:
                key.sample.remove(text)
                key.sample.append(text)
                return 0
            recorded = 0
            nearest = self._nearest(key, text)
            if nearest is not None:
                spans = diff_spans(nearest, text, cfg)
                for span in spans or ():
                    recorded += self._record(key, span, nearest, text)
            self._sample(key, text)
            return recorded

    def _key(self, model: str, tenant: str) -> _Key:
        k = (model, tenant)
        key = self._keys.get(k)
        if key is None:
            key = _Key(sample=deque())
            self._keys[k] = key
            while len(self._keys) > self.config.max_keys:
                _, dropped = self._keys.popitem(last=False)
                self._sample_chars -= dropped.sample_chars
        else:
            self._keys.move_to_end(k)
        return key

    def _nearest(self, key: _Key, text: str) -> str | None:
        """The sampled text sharing the most identical prefix + suffix with ``text``, if enough."""
        best, best_score = None, self.config.min_template_chars - 1
        for old in key.sample:
            p = _common_prefix_len(old, text)
            score = p + _common_suffix_len(old, text, min(len(old), len(text)) - p)
            if score > best_score:
                best, best_score = old, score
        return best

    def _sample(self, key: _Key, text: str) -> None:
        key.sample.append(text)
        key.sample_chars += len(text)
        self._sample_chars += len(text)
        if len(key.sample) > self.config.sample_size:
            dropped = key.sample.popleft()
            key.sample_chars -= len(dropped)
            self._sample_chars -= len(dropped)
        while self._sample_chars > self.config.max_sample_chars:
            victim = next((k for k in self._keys.values() if k.sample and k is not key), None)
            victim = victim or key
            dropped = victim.sample.popleft()
            victim.sample_chars -= len(dropped)
            self._sample_chars -= len(dropped)

    def _record(self, key: _Key, span: Span, old: str, new: str) -> int:
        cfg = self.config
        ident = (span.left, span.right, span.at_start, span.at_end)
        now = self._clock()
        candidate = key.candidates.get(ident)
        if candidate is None:
            candidate = _Candidate(span.left, span.right, span.at_start, span.at_end, first_seen=now)
            key.candidates[ident] = candidate
            self._bound_candidates(key)
        else:
            key.candidates.move_to_end(ident)
        for value in (old[span.old_start : span.old_end], new[span.new_start : span.new_end]):
            if not candidate.add_value(value, _hash(value), cfg.max_value_hashes):
                key.candidates.pop(ident, None)
                return 0
        candidate.observations += 1
        candidate.last_seen = now
        if candidate.slot_since is None and len(candidate.value_hashes) >= cfg.min_distinct:
            candidate.slot_since = now
        return 1

    def _bound_candidates(self, key: _Key) -> None:
        while len(key.candidates) > self.config.max_candidates:
            victim = next((i for i, c in key.candidates.items() if c.slot_since is None), None)
            if victim is None:
                key.candidates.popitem(last=False)
            else:
                del key.candidates[victim]

    # ----- reading ----------------------------------------------------------------------------------------
    def _slots(
        self, model: str | None, tenant: str | None, include_candidates: bool = False
    ) -> list[tuple[str, str, _Candidate]]:
        out = []
        for (m, t), key in self._keys.items():
            if (model is not None and m != model) or (tenant is not None and t != tenant):
                continue
            for c in key.candidates.values():
                if c.slot_since is not None or include_candidates:
                    out.append((m, t, c))
        return out

    @staticmethod
    def slot_id(left: str, right: str, at_start: bool = False, at_end: bool = False) -> str:
        """The rule id of a slot: ``learned.`` + 12 hex digits of a hash of its anchors (the same slot learned
        under two tenants has one id)."""
        return "learned." + _hash(left, right, str(at_start), str(at_end)).hex()[:12]

    def pattern_source(self, candidate: _Candidate) -> str:
        """The RE2 source of a slot's hoist rule: ``\\A``? escaped left anchor, ``(?P<value>CLASS{lo,hi}?)``,
        escaped right anchor, ``\\z``?."""
        left = (r"\A" if candidate.at_start else "") + escape_re2(candidate.left)
        right = escape_re2(candidate.right) + (r"\z" if candidate.at_end else "")
        return f"{left}(?P<value>{_value_class(candidate, self.config.max_span_chars)}){right}"

    def slots(
        self, model: str | None = None, tenant: str | None = None, include_candidates: bool = False
    ) -> list[dict[str, Any]]:
        """The stats listing: shape and counts of each learned slot (and candidate, when asked), never a value
        and never prompt text.

        Returns:
            dicts with ``id``, ``model``, ``tenant``, ``state`` (``slot``/``candidate``), ``left_anchor``
            and ``right_anchor`` (each ``{"sha": 12 hex digits, "chars": length, "edge": bool}``),
            ``value_chars`` ([shortest, longest]), ``value_classes`` (class names, plus ``punct`` when the
            values held other characters), ``distinct_values`` (saturates at ``max_value_hashes``),
            ``observations``, ``first_seen``, ``last_seen``, ``slot_since`` (epoch seconds or None); sorted
            by model, tenant, id.
        """
        with self._lock:
            rows = []
            for m, t, c in self._slots(model, tenant, include_candidates):
                classes = sorted(c.classes) + (["punct"] if c.punct else [])
                rows.append(
                    {
                        "id": self.slot_id(c.left, c.right, c.at_start, c.at_end),
                        "model": m,
                        "tenant": t,
                        "state": "slot" if c.slot_since is not None else "candidate",
                        "left_anchor": {
                            "sha": _hash(c.left).hex()[:12],
                            "chars": len(c.left),
                            "edge": c.at_start,
                        },
                        "right_anchor": {
                            "sha": _hash(c.right).hex()[:12],
                            "chars": len(c.right),
                            "edge": c.at_end,
                        },
                        "value_chars": [c.min_len, c.max_len],
                        "value_classes": classes,
                        "distinct_values": len(c.value_hashes),
                        "observations": c.observations,
                        "first_seen": c.first_seen,
                        "last_seen": c.last_seen,
                        "slot_since": c.slot_since,
                    }
                )
        return sorted(rows, key=lambda r: (r["model"], r["tenant"], r["id"]))

    def rules_for(self, model: str, tenant: str) -> tuple[Rule, ...]:
        """Hoist rules of the slots learned for ``model`` + ``tenant`` in mode ``apply`` (``()`` otherwise),
        ordered by id, ready to append to a ``RuleSet``'s rules (``RuleSet(base.rules + rules, ...)``).
        Each matches system/developer messages, skips fenced code, hoists group ``value`` to the default
        placement."""
        if self.config.mode != "apply":
            return ()
        with self._lock:
            found = {
                self.slot_id(c.left, c.right, c.at_start, c.at_end): c
                for _, _, c in self._slots(model, tenant)
            }
            return tuple(self._rule(slot_id, found[slot_id]) for slot_id in sorted(found))

    def _rule(self, slot_id: str, candidate: _Candidate) -> Rule:
        source = self.pattern_source(candidate)
        return Rule(
            id=slot_id,
            action="hoist",
            selector=MessageSelector(roles=LEARNED_ROLES),
            pattern=compile_pattern(source, {}),
            pattern_source=source,
            group="value",
            placement=DEFAULT_PLACEMENT,
            skip_code=True,
            description=_describe(candidate),
            file=LEARNED_FILE,
            line=0,
        )

    def _compile(self, source: str) -> Any:
        """The compiled RE2 pattern of a slot (cached: a slot's pattern changes only when its shape does)."""
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = compile_pattern(source, {})
            while len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(source)
        return compiled

    def match_slots(self, model: str, tenant: str, text: str) -> list[tuple[int, int, str]]:
        """Where the learned slots of ``model`` + ``tenant`` (any mode but ``off``) match in a system/developer
        ``text``: ``(start, end, slot id)`` character ranges of the values, sorted. For the miss explanation
        (a divergence inside such a range is ``volatile`` with that slot as candidate)."""
        if self.config.mode == "off":
            return []
        with self._lock:
            found = [
                (self.slot_id(c.left, c.right, c.at_start, c.at_end), c)
                for _, _, c in self._slots(model, tenant)
            ]
            out = []
            for slot_id, c in found:
                pattern = self._compile(self.pattern_source(c))
                for m in pattern.finditer(text):
                    start, end = m.span(pattern.groupindex["value"])
                    out.append((start, end, slot_id))
        return sorted(out)

    def export_yaml(self, model: str | None = None, tenant: str | None = None) -> str:
        """A rule file (YAML, the ``rules.loader`` format) with one ``hoist`` rule per learned slot of the given
        model/tenant (every one when None), for a person to review and commit. Holds the anchors (template
        text), never a value. A slot learned under several keys is written once."""
        with self._lock:
            found = {
                self.slot_id(c.left, c.right, c.at_start, c.at_end): c
                for _, _, c in self._slots(model, tenant)
            }
            rules = [
                {
                    "id": slot_id,
                    "description": _describe(found[slot_id]),
                    "match": {
                        "role": sorted(LEARNED_ROLES),
                        "skip_code": True,
                        "pattern": self.pattern_source(found[slot_id]),
                    },
                    "action": "hoist",
                    "group": "value",
                }
                for slot_id in sorted(found)
            ]
        doc = {
            "description": "Volatile slots learned from traffic by prefixgate; review before committing.",
            "rules": rules,
        }
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1 << 16)

    def footprint(self) -> dict[str, int]:
        """What the learner holds now: ``keys``, ``sampled_texts``, ``sampled_chars``, ``candidates``,
        ``slots``, ``value_hashes`` (every count bounded by ``config``)."""
        with self._lock:
            cands = [c for k in self._keys.values() for c in k.candidates.values()]
            return {
                "keys": len(self._keys),
                "sampled_texts": sum(len(k.sample) for k in self._keys.values()),
                "sampled_chars": self._sample_chars,
                "candidates": len(cands),
                "slots": sum(1 for c in cands if c.slot_since is not None),
                "value_hashes": sum(len(c.value_hashes) for c in cands),
            }


def _describe(candidate: _Candidate) -> str:
    return (
        f"learned slot: {len(candidate.value_hashes)} distinct values of {candidate.min_len}-"
        f"{candidate.max_len} characters, seen {candidate.observations} times"
    )
