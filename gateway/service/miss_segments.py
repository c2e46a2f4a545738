"""Segment geometry of the miss explanation: which segment holds a token, and whether two prompts re-converge.

``gateway.service.miss_explain`` decides a miss's cause from where a prompt diverges from the nearest earlier
prompt and from the segments (``tools``, ``system``, ``documents``, ``history``, ``tail``: ``PromptSegment``
token ranges) on either side of that divergence. This module owns those pure functions over token ids and
segments: checking that a request's segments tile its prompt (``validated_segments``), the segment holding an
offset (``segment_at``) and where it ends (``segment_end``), the segments a divergence names
(``divergence_segments``), and whether the two prompts continue identically shortly after it, inside the
segments that hold it, or for a system prompt edit in a conversation, in the conversation after it
(``rejoins``: an edit of an earlier prompt rather than a new prompt).

Invariants: segments are contiguous ranges in order from token 0 (``validated_segments`` refuses others with a
``MissExplainError`` naming the segment); an offset past every segment, or in a prompt without segments, is in
``tail``; an empty segment never holds a token; nothing here keeps state or holds prompt text. Pure Python.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from gateway.service.miss_explanation import SEGMENT_NAMES, MissExplainError, PromptSegment

_REJOIN_WINDOW = 8
_REJOIN_RUN = 32
_END_EDIT = 16
"""The most tokens after the divergence to the end of either system prompt for an edit of its end to re-converge
in the conversation after it (``rejoins``): a whole new system prompt is a new prompt."""


def validated_segments(segments: Iterable[PromptSegment], n: int) -> tuple[PromptSegment, ...]:
    """``segments`` as a tuple, checked to be ``PromptSegment`` s with known names that tile ``[0, n)`` in order
    (an empty iterable is accepted: the prompt has no segments).

    Raises:
        MissExplainError: a segment of another type or name, one that does not start where the previous one
            ended, or segments that do not end at ``n``.
    """
    out = tuple(segments)
    pos = 0
    for i, s in enumerate(out):
        if not isinstance(s, PromptSegment) or s.name not in SEGMENT_NAMES:
            raise MissExplainError(f"segments[{i}] must be a PromptSegment named one of {SEGMENT_NAMES}")
        if s.start != pos or s.end < s.start:
            raise MissExplainError(f"segments[{i}] must start where the previous one ended ({pos})")
        pos = s.end
    if out and pos != n:
        raise MissExplainError(f"segments must cover the prompt's {n} tokens (they end at {pos})")
    return out


def segment_at(segments: Sequence[PromptSegment], offset: int) -> str:
    """The name of the segment holding token ``offset`` (``tail`` past the end or with no segments); an
    empty segment never holds a token."""
    for s in segments:
        if s.start <= offset < s.end:
            return s.name
    return "tail"


def segment_end(segments: Sequence[PromptSegment], offset: int) -> int:
    """Where the segment holding token ``offset`` ends (``offset`` itself past every segment)."""
    for s in segments:
        if s.start <= offset < s.end:
            return s.end
    return offset


def divergence_segments(
    new_segments: Sequence[PromptSegment], old_segments: Sequence[PromptSegment], d: int, same_tools: bool
) -> set[str]:
    """The names of the segments holding token ``d`` in either prompt (the divergence's candidates for a cause).

    With ``same_tools`` (both prompts carry the same tools digest) ``tools`` is left out: the divergence only
    lies where a with/without-tools diff labels tools (a separator before an added system text, a closing
    token), so what changed is the other prompt's segment there, or, when both say tools, the segment the new
    prompt's tools lead into.
    """
    names = {segment_at(new_segments, d), segment_at(old_segments, d)}
    if same_tools and "tools" in names:
        names.discard("tools")
        if not names:
            names.add(segment_at(new_segments, segment_end(new_segments, d)))
    return names


def rejoins(
    new: array,
    old: array,
    d: int,
    new_segments: Sequence[PromptSegment],
    old_segments: Sequence[PromptSegment],
    max_edit_tokens: int,
) -> bool:
    """True when, within ``max_edit_tokens`` after ``d``, both prompts continue identically, inside a segment
    named as one holding ``d``, for ``_REJOIN_RUN`` tokens or to the end of that segment (at least
    ``_REJOIN_WINDOW``): the divergence is an edit of that segment (or a segment inserted or removed before
    it) with the same text after it. A whole new system prompt followed by the same question does not
    re-converge inside the system prompt; nor do two prompts that merely share words. A system prompt edited in
    its last ``_END_EDIT`` tokens (in both prompts), in a conversation (the new prompt has history),
    re-converges in the conversation after it: the new prompt's history, the earlier prompt's history or its
    newest turn (which this prompt resends as history).

    Args:
        new, old: the two prompts' token ids (``array("I")``), equal before ``d``.
        d: the token offset where they diverge.
        new_segments, old_segments: their segments (``validated_segments``).
        max_edit_tokens: the longest changed span, in tokens, on either side.
    """
    names = {segment_at(new_segments, d), segment_at(old_segments, d)}
    new_names, old_names = names, names
    if (
        names == {"system"}
        and segment_end(new_segments, d) - d <= _END_EDIT
        and segment_end(old_segments, d) - d <= _END_EDIT
        and any(s.name == "history" and s.end > s.start for s in new_segments)
    ):
        # an edit of the system prompt's last tokens in a conversation: the conversation after it re-converges,
        # in the new prompt's history and in the earlier prompt's history or newest turn (history here)
        new_names, old_names = names | {"history"}, names | {"history", "tail"}
    windows: dict[tuple[int, ...], list[int]] = {}
    for j in range(max_edit_tokens + 1):
        if d + j + _REJOIN_WINDOW <= len(old) and _inside(old_segments, old_names, d + j):
            windows.setdefault(tuple(old[d + j : d + j + _REJOIN_WINDOW]), []).append(j)
    for i in range(max_edit_tokens + 1):
        if d + i + _REJOIN_WINDOW > len(new):
            break
        if not _inside(new_segments, new_names, d + i):
            continue
        for j in windows.get(tuple(new[d + i : d + i + _REJOIN_WINDOW]), ()):
            if (i, j) == (0, 0):
                continue
            left = min(segment_end(new_segments, d + i) - d - i, segment_end(old_segments, d + j) - d - j)
            need = max(_REJOIN_WINDOW, min(_REJOIN_RUN, left))
            if new[d + i : d + i + need] == old[d + j : d + j + need]:
                return True
    return False


def _inside(segments: Sequence[PromptSegment], names: set[str], start: int) -> bool:
    """Whether the ``_REJOIN_WINDOW`` tokens from ``start`` lie in segments named in ``names`` (a window that
    reaches the next turn's identical template tokens is not a re-convergence of the edited text)."""
    return segment_at(segments, start) in names and segment_at(segments, start + _REJOIN_WINDOW - 1) in names
