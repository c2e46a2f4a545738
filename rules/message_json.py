"""The JSON texts of single chat messages, memoized by the message's items: the canonical text (sorted keys,
``rules.actions.canonical_json``) that the transcript keys and the prefix material hash, and the compact text
(key order kept, ``TranscriptEntry.encode``'s) that the transcript entries hold.

A request's system message is encoded three times per request (transcript key, transcript entry, prefix
material), and after the rules ran its text is the pass memo's string object, the same one in every request of
that system prompt (its hash is computed once); so each text is found by one look-up instead of an encoding.

Invariants:

- the texts are exactly ``canonical_json(message)`` / the compact encoder's text: a message is looked up only
  when it is a ``dict`` of exactly two items whose keys and values are all exactly ``str`` (a request's
  ``{"role": ..., "content": "..."}``), keyed by the tuple of its items, equal only for messages with the
  same keys in the same order and the same strings, whose texts are therefore equal; any other message is
  encoded each time;
- a message shorter than ``MEMO_MIN_CHARS`` characters of content is encoded each time (a new user question
  costs about as much to encode as to look up, and would only churn the memo);
- each memo is bounded: at most ``MEMO_ENTRIES`` entries and ``MEMO_CHARS`` characters of text, cleared
  when full (a process holds few distinct long messages that recur: its system prompts).
"""

from __future__ import annotations

import json
from typing import Any

from rules.actions import canonical_json

MEMO_MIN_CHARS = 256
"""Shortest ``content`` whose texts are memoized (characters)."""

MEMO_ENTRIES = 1_024
"""Most messages each memo holds (cleared when full)."""

MEMO_CHARS = 4_000_000
"""Most characters of text each memo holds (cleared when full)."""

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""``json.dumps(..., separators=(",", ":"), ensure_ascii=False)`` (key order kept) without an encoder per
call."""


class _TextMemo:
    """One bounded memo: a message's items -> its text under ``encode``."""

    __slots__ = ("_encode", "_texts", "_chars")

    def __init__(self, encode: Any) -> None:
        self._encode = encode
        self._texts: dict[tuple[tuple[str, str], ...], str] = {}
        self._chars = 0

    def text(self, message: Any) -> str:
        """``encode(message)``, memoized for two-item all-``str`` messages with a long enough content."""
        if type(message) is not dict or len(message) != 2:
            return self._encode(message)
        items = tuple(message.items())
        (k0, v0), (k1, v1) = items
        if (
            type(k0) is not str
            or type(v0) is not str
            or type(k1) is not str
            or type(v1) is not str
            or len(v0) + len(v1) < MEMO_MIN_CHARS
        ):
            return self._encode(message)
        found = self._texts.get(items)
        if found is None:
            found = self._encode(message)
            if len(self._texts) >= MEMO_ENTRIES or self._chars + len(found) > MEMO_CHARS:
                self._texts.clear()
                self._chars = 0
            self._texts[items] = found
            self._chars += len(found)
        return found

    def clear(self) -> None:
        """Drop every entry."""
        self._texts.clear()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._texts)


_CANONICAL = _TextMemo(canonical_json)
_COMPACT_MEMO = _TextMemo(_COMPACT.encode)


def canonical_message_json(message: Any) -> str:
    """``canonical_json(message)`` (sorted keys, no spaces, UTF-8 kept), memoized as the module says.

    Raises:
        ValueError: a circular value (as ``canonical_json``).
    """
    return _CANONICAL.text(message)


def compact_message_json(message: Any) -> str:
    """``json.dumps(message, separators=(",", ":"), ensure_ascii=False)`` (key order kept), memoized as the
    module says.

    Raises:
        TypeError: a value that is not JSON data; ValueError: a circular value (as ``json.dumps``).
    """
    return _COMPACT_MEMO.text(message)


def clear_memos() -> None:
    """Empty both memos (tests)."""
    _CANONICAL.clear()
    _COMPACT_MEMO.clear()


def memo_sizes() -> tuple[int, int]:
    """(entries of the canonical memo, entries of the compact memo) (tests)."""
    return len(_CANONICAL), len(_COMPACT_MEMO)
