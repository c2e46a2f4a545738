"""Segments of a canonical prompt: which part is stable (cacheable as a prefix) and which is volatile.

Levels (``SegmentLevel``), in prompt order, most stable first:

1. ``TOOLS_SYSTEM`` (``tools+system``): the tools and the leading run of ``system``/``developer`` messages.
2. ``DOCUMENTS`` (``documents``): the *document region* of a user message: from the start of the message
   to the end of its last ``</document>``, ``</documents>`` or ``</doc>`` closing tag (an opening tag must
   come first; case-insensitive). For list content the region is every part up to and including the last
   text part holding such a closing tag. Documents are recognized in the first message after the system block
   (when it is a user message) and in the last user message: so a RAG request
   ``[system][user: <document>...</document> question]`` has the document as level 2 and only the
   question as volatile tail, and every question about the same document shares the prefix key. To make
   documents the client sends elsewhere level 2, a ``reorder`` rule moves them to the front of the
   message inside ``<document>`` tags.
3. ``HISTORY`` (``history``): every message before the last user turn (after the first two levels). A request
   that ends in tool results (an agent loop's turn) has those results as its last user turn, as the Messages
   API has them in a user message: its history runs to the reply that made the calls.
4. ``VOLATILE`` (``volatile``): the last user turn (after its document region) and everything after it,
   plus the hoisted values; it begins at the first hoisted block if that comes earlier (``system_end`` or
   ``before_last_user`` placement), because nothing after a changing byte can be a cached prefix.

Segments are contiguous and cover the whole prompt in order; levels 1-3 come before level 4, but a
level-2 segment may follow level 3 (documents in the last user turn). A position in the prompt is
(message, part, char): a string ``content`` is part 0; char counts Python characters of that part's text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import re2

from rules.actions import canonical_json
from rules.message_json import canonical_message_json
from rules.messages import get_text, leading_system_count, newest_input_index, part_count, text_parts

_DOC_OPEN = re2.compile(r"(?i)<(?:documents?|doc)(?:\s[^>]*)?>")
_DOC_CLOSE = re2.compile(r"(?i)</(?:documents?|doc)>")


def may_open_document(text: str) -> bool:
    """False only when ``text`` holds no opening document tag (``_DOC_OPEN``): every match begins with ``<d``
    or ``<D`` (RE2's case folding pairs ``d`` with ``D`` alone). Two substring scans in C instead of an RE2
    search, whose Python wrapper encodes the text and maps offsets on every call: most texts hold no
    document, and this runs several times per request (docs/overhead.md, session 8)."""
    return "<d" in text or "<D" in text


class SegmentLevel(enum.IntEnum):
    """How stable a segment is, in prompt order (see the module docstring). An ``IntEnum``: levels compare and
    serialize as the plain numbers 1-4."""

    TOOLS_SYSTEM = 1
    DOCUMENTS = 2
    HISTORY = 3
    VOLATILE = 4


LEVEL_NAMES = {
    SegmentLevel.TOOLS_SYSTEM: "tools+system",
    SegmentLevel.DOCUMENTS: "documents",
    SegmentLevel.HISTORY: "history",
    SegmentLevel.VOLATILE: "volatile",
}


@dataclass(frozen=True, order=True)
class Position:
    """A place in the canonical prompt: before character ``char`` of content part ``part`` of message
    ``message``. (len(messages), 0, 0) is the end of the prompt."""

    message: int
    part: int = 0
    char: int = 0


@dataclass(frozen=True)
class Segment:
    """A contiguous range of the canonical prompt.

    Attributes:
        level: its ``SegmentLevel``.
        name: ``LEVEL_NAMES[level]``.
        start_message, end_message: the messages the segment touches (``end_message`` exclusive), indices
            into ``Canonical.messages``. A level-1 segment holding only tools has start == end == 0.
        start_part, start_char: where in ``messages[start_message]`` it begins (0, 0: at the start).
        end_part, end_char: where in ``messages[end_message - 1]`` it ends (exclusive), or None when it
            runs to the end of that message.
    """

    level: SegmentLevel
    name: str
    start_message: int
    end_message: int
    start_part: int = 0
    start_char: int = 0
    end_part: int | None = None
    end_char: int | None = None

    @classmethod
    def between(cls, level: SegmentLevel, start: Position, end: Position) -> Segment:
        """The segment [start, end) (both normalized positions)."""
        if end.part == 0 and end.char == 0:
            return cls(level, LEVEL_NAMES[level], start.message, end.message, start.part, start.char)
        return cls(
            level,
            LEVEL_NAMES[level],
            start.message,
            end.message + 1,
            start.part,
            start.char,
            end.part,
            end.char,
        )

    @property
    def end(self) -> Position:
        """The normalized end position."""
        if self.end_part is None:
            return Position(self.end_message)
        return Position(self.end_message - 1, self.end_part, self.end_char or 0)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of the fields."""
        return {
            "level": int(self.level),
            "name": self.name,
            "start_message": self.start_message,
            "end_message": self.end_message,
            "start_part": self.start_part,
            "start_char": self.start_char,
            "end_part": self.end_part,
            "end_char": self.end_char,
        }


def normalize_position(messages: list[dict[str, Any]], pos: Position) -> Position:
    """``pos`` in its one canonical form: a position at the end of a part or message is written as the
    start of the next one (so equal places compare equal)."""
    if pos.message >= len(messages):
        return Position(len(messages))
    if pos.part == 0 and pos.char == 0:
        return pos
    message = messages[pos.message]
    part, char = pos.part, pos.char
    if char > 0:
        if part in text_parts(message) and char < len(get_text(message, part)):
            return pos
        part, char = part + 1, 0
    if part >= part_count(message):
        return Position(pos.message + 1) if pos.message + 1 < len(messages) else Position(len(messages))
    return Position(pos.message, part, 0)


def document_end_in_text(text: str) -> int:
    """End offset of the document region of ``text`` (0 when it has none): the end of the last closing
    document tag that follows an opening one."""
    opening = _DOC_OPEN.search(text) if may_open_document(text) else None
    if opening is None:
        return 0
    end = 0
    for closing in _DOC_CLOSE.finditer(text, opening.end()):
        end = closing.end()
    return end


def document_end(message: dict[str, Any]) -> Position | None:
    """Where the document region of ``message`` ends, as (0, part, char) relative to the message
    (``Position.message`` is 0), or None when it has none. For list content the region ends after the
    last text part that closes a document (an opening tag appearing in that or an earlier text part)."""
    content = message.get("content")
    if isinstance(content, str):
        end = document_end_in_text(content)
        return Position(0, 0, end) if end else None
    if not isinstance(content, list):
        return None
    opened = False
    last = None
    for part in text_parts(message):
        text = get_text(message, part)
        if not opened:
            opening = _DOC_OPEN.search(text) if may_open_document(text) else None
            if opening is None:
                continue
            opened = True
            if _DOC_CLOSE.search(text, opening.end()) is not None:
                last = part
        elif _DOC_CLOSE.search(text) is not None:
            last = part
    return Position(0, last + 1, 0) if last is not None else None


def compute_segments(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, block_starts: list[Position]
) -> list[Segment]:
    """The segments of a canonical prompt (see the module docstring).

    Args:
        messages: the canonical messages.
        tools: the canonical tools (level 1 holds them; only their presence matters here).
        block_starts: where each inserted hoisted-value block begins (its separator included).
    """
    n = len(messages)
    system_end = leading_system_count(messages)
    last_user = newest_input_index(messages)  # an agent loop's trailing tool results count as its user turn

    def doc_region(index: int) -> Position | None:
        if index >= n or messages[index].get("role") != "user":
            return None
        end = document_end(messages[index])
        if end is None:
            return None
        return normalize_position(messages, Position(index, end.part, end.char))

    tail = Position(n) if last_user is None else Position(last_user)
    last_docs = doc_region(last_user) if last_user is not None else None
    if last_docs is not None:
        tail = last_docs
    volatile = min([tail, *(normalize_position(messages, b) for b in block_starts)])

    cuts: list[tuple[SegmentLevel, Position, Position]] = []
    start = Position(0)
    if system_end > 0 or tools:
        cuts.append((SegmentLevel.TOOLS_SYSTEM, start, Position(system_end)))
        start = Position(system_end)
    first_docs = doc_region(system_end)
    if first_docs is not None:
        cuts.append((SegmentLevel.DOCUMENTS, start, first_docs))
        start = first_docs
    if last_user is not None and start < Position(last_user):
        cuts.append((SegmentLevel.HISTORY, start, Position(last_user)))
        start = Position(last_user)
    elif last_user is None and start < Position(n):
        cuts.append((SegmentLevel.HISTORY, start, Position(n)))
        start = Position(n)
    if last_docs is not None and start < last_docs:
        cuts.append((SegmentLevel.DOCUMENTS, start, last_docs))

    segments: list[Segment] = []
    for level, seg_start, seg_end in cuts:
        seg_end = min(seg_end, volatile)
        if seg_start > seg_end or (seg_start == seg_end and level != SegmentLevel.TOOLS_SYSTEM):
            continue
        if seg_start == seg_end and segments:
            continue
        segments.append(Segment.between(level, seg_start, seg_end))
    if volatile < Position(n):
        segments.append(Segment.between(SegmentLevel.VOLATILE, volatile, Position(n)))
    return segments


def message_prefix(messages: list[dict[str, Any]], end: Position) -> list[dict[str, Any]]:
    """The messages before ``end``; a message cut in the middle keeps its other keys and the part of its
    content before the cut."""
    out = [dict(m) for m in messages[: end.message]]
    if end.message < len(messages) and (end.part or end.char):
        message = dict(messages[end.message])
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = content[: end.char]
        else:
            parts = [dict(p) for p in content[: end.part]]
            if end.char:
                parts.append({**content[end.part], "text": content[end.part]["text"][: end.char]})
            message["content"] = parts
        out.append(message)
    return out


def stable_material(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    segments: list[Segment],
    level: SegmentLevel = SegmentLevel.HISTORY,
) -> bytes:
    """Canonical JSON bytes (UTF-8, sorted keys, no spaces) of the stable prefix up to ``level``:
    ``{"messages": [...], "tools": ...}`` holding the tools and the messages of the leading run of
    segments whose level is at most ``level`` (never the volatile tail), a message cut mid-way holding
    only the part before the cut."""
    end = Position(0)
    for segment in segments:
        if segment.level > level or segment.level == SegmentLevel.VOLATILE:
            break
        end = segment.end
    # canonical_json of {"messages": [...], "tools": ...} (sorted keys: "messages" first), each whole message's
    # text from the memo of ``rules.message_json`` (a system prompt is not encoded again), a cut one encoded here
    texts = [canonical_message_json(m) for m in messages[: end.message]]
    if end.message < len(messages) and (end.part or end.char):
        texts.append(canonical_json(message_prefix(messages, end)[-1]))
    text = '{"messages":[' + ",".join(texts) + '],"tools":' + canonical_json(tools) + "}"
    return text.encode("utf-8")
