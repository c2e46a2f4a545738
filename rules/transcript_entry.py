"""The stored form of a transcript entry: what was sent for one request, as bytes a store keeps.

Version 2 (written): ``ENTRY_MAGIC`` then frames, each a 4-byte big-endian length and that many bytes of one
zlib stream (RFC 1950, level 1); the frames' texts, decompressed and joined, are the entry's compact JSON
``{"v":2,"present":[...],"messages":[...]}`` (objects keep their key order, so the messages come back exactly as
they were sent). The first frame holds the text up to the messages' ``[``, the last one ``]}``, the frames
between hold the messages' JSON (a later piece begins with its ``,``). So the entry of a conversation's next
request is written from the previous entry's message frames, copied as bytes, plus one frame of its new
messages: zlib runs over what is new only (``framed``), where one stream over the whole transcript cost ~1.5 ms
per request at 167 kB of agent tool results. Version 1 (read only; written before session 10): one zlib stream
of ``{"v":1,"messages":[...],"present":[...]}``.

Invariants: any framing of the same messages and present values decodes to the same entry; ``decode`` never
raises (bytes that are not an entry of either version are None).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

ENTRY_MAGIC = b"PGT\x02"
"""First bytes of a version-2 entry (a version-1 entry is a bare zlib stream: its first byte is 0x78)."""

ENTRY_VERSION = 2

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_LEN = 4  # bytes of a frame's length


def frame(text: str) -> bytes:
    """One frame: the length of ``zlib.compress(text, 1)`` (4 bytes, big-endian), then those bytes."""
    z = zlib.compress(text.encode("utf-8"), 1)
    return len(z).to_bytes(_LEN, "big") + z


_TAIL = frame("]}")


def messages_json(messages: list[dict[str, Any]]) -> str:
    """The compact JSON of a message list without its brackets (what the message frames hold, joined)."""
    return _COMPACT.encode(messages)[1:-1]


def framed(present: list[str] | tuple[str, ...], message_frames: bytes) -> tuple[bytes, tuple[int, int]]:
    """(a version-2 entry from its present values and its message frames, where those frames lie in it as
    ``(start, end)`` offsets). ``message_frames``: ``frame`` of the messages' JSON pieces, concatenated; ``b""``
    for no messages."""
    head = '{"v":' + str(ENTRY_VERSION) + ',"present":' + _COMPACT.encode(list(present)) + ',"messages":['
    data = ENTRY_MAGIC + frame(head) + message_frames + _TAIL
    end = len(data) - len(_TAIL)
    return data, (end - len(message_frames), end)


@dataclass(frozen=True)
class DecodedEntry:
    """What ``decode_entry`` read: the entry, characters of its JSON text, and where its message frames lie
    in the bytes (``(start, end)`` offsets; None for a version-1 entry, which has none)."""

    entry: TranscriptEntry
    chars: int
    message_frames: tuple[int, int] | None


@dataclass(frozen=True)
class TranscriptEntry:
    """What was sent for one request: its canonical messages and the system's hoisted values then."""

    messages: list[dict[str, Any]]
    present: list[str] = field(default_factory=list)

    def encode(self) -> bytes:
        """The version-2 bytes with the messages in one frame (see the module docstring)."""
        text = messages_json(self.messages)
        return framed(self.present, frame(text) if text else b"")[0]

    @classmethod
    def decode(cls, data: bytes) -> TranscriptEntry | None:
        """The entry in ``data`` (either version), or None when it is not one (never raises)."""
        found = decode_entry(data)
        return found.entry if found is not None else None


def _unframe(data: bytes) -> tuple[str, tuple[int, int]] | None:
    """(the joined text of a version-2 entry's frames, its message frames' offsets), or None when the framing
    is broken (a length past the end, a frame that is not one whole zlib stream, fewer than two frames)."""
    view = memoryview(data)
    pos, ends, texts = len(ENTRY_MAGIC), [], []
    while pos < len(data):
        if pos + _LEN > len(data):
            return None
        end = pos + _LEN + int.from_bytes(data[pos : pos + _LEN], "big")
        if end > len(data):
            return None
        d = zlib.decompressobj()
        texts.append(d.decompress(view[pos + _LEN : end]))
        if not d.eof or d.unused_data:
            return None
        ends.append(end)
        pos = end
    if len(ends) < 2:
        return None
    return b"".join(texts).decode("utf-8"), (ends[0], ends[-2])


def decode_entry(data: bytes) -> DecodedEntry | None:
    """The entry in ``data`` with its size and message frames (see ``DecodedEntry``), or None when ``data`` is
    not an entry of version 1 or 2 (never raises)."""
    frames: tuple[int, int] | None = None
    try:
        if data[: len(ENTRY_MAGIC)] == ENTRY_MAGIC:
            found = _unframe(data)
            if found is None:
                return None
            text, frames = found
            version = ENTRY_VERSION
        else:
            text, version = zlib.decompress(data).decode("utf-8"), 1
        body = json.loads(text)
    except (zlib.error, UnicodeDecodeError, ValueError, TypeError):
        return None
    if not isinstance(body, dict) or body.get("v") != version:
        return None
    messages, present = body.get("messages"), body.get("present")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    if not isinstance(present, list) or not all(isinstance(v, str) for v in present):
        return None
    return DecodedEntry(TranscriptEntry(messages, present), len(text), frames)
