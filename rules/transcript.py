"""Canonical transcript memory: the canonical messages a conversation was sent as, by prefix.

Each canonicalized request is remembered under a key naming its *stable form*: the model + tenant scope,
the canonical tools and the messages after the rules ran, hoisted values taken out (so two requests that
differ only in a volatile value share a key). The value is the canonical messages exactly as they were
sent (hoisted-value blocks with their values of that time included) and the hoisted values that were
current then. A later request of the same conversation looks up the stable forms of its earlier requests
(the prefixes that end before each assistant reply, newest first), reuses the stored canonical messages
of the longest one verbatim and canonicalizes only what follows (``RuleSet.apply(..., memory=...)``).

Invariants:

- keys are blake2b-256 digests (never ``hash()``), so they agree across processes and gateways;
- a stored entry is reused only when taking its blocks out gives back exactly the current request's
  stable form of that prefix (a corrupt, foreign or colliding entry is a miss, counted as ``rejected``);
- a key's scope names the values of the system prompt that tell whose conversation it is
  (``conversation_scope``): another user's history, with their hoisted name or memories in its old blocks, is
  never found for a request with the same stable form;
- the in-process store is bounded by entries, bytes and age (TTL, injectable clock) and evicts the least
  recently used entry first; a store never raises to the caller for a missing or expired key;
- what a stored value decodes to is kept by ``TranscriptMemory`` in a bounded memo keyed by the value's bytes
  (``Recalled``: the entry, its blocks taken out, turn by turn), so a conversation resent turn after turn
  decodes, strips, re-encodes and compresses only its new turn: the next entry is the reused one's message
  frames as bytes plus a frame of the new messages (``remember_after``; the format: ``rules.transcript_entry``),
  which decodes to what ``TranscriptEntry.encode`` of the whole entry decodes to.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rules.actions import canonical_json
from rules.bounded_lru import BoundedLRU
from rules.message_json import canonical_message_json, compact_message_json
from rules.messages import copy_json
from rules.model import PRIVATE
from rules.placement import LOCATIONS, extract_turn_blocks, turn_spans
from rules.transcript_entry import TranscriptEntry, decode_entry, frame, framed, messages_json

KEY_BYTES = 32
"""Length of a transcript key (blake2b digest size)."""


@runtime_checkable
class TranscriptStore(Protocol):
    """Where transcript entries live: opaque ``bytes`` keys (``KEY_BYTES`` long) to opaque ``bytes``.

    Implementations must never raise for a missing, expired or unreadable key (that is a miss) and must
    bound themselves; ``put`` may drop an entry (too big, store unavailable) without raising.
    """

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored value for each key, or None, in the order of ``keys``."""
        ...

    def put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any value there)."""
        ...


@dataclass
class StoreStats:
    """Counters of an in-process store (``entries`` and ``bytes`` are current, the rest cumulative)."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evicted: int = 0
    expired: int = 0
    too_big: int = 0


class InProcessTranscriptStore:
    """A bounded LRU map in this process (thread-safe).

    Args:
        max_entries: most entries kept (>= 1).
        max_bytes: most value bytes kept in total (>= 1); a single value larger than this is not stored.
        ttl_s: seconds an entry lives after it was last put (> 0).
        clock: monotonic seconds (``time.monotonic`` by default; tests inject their own).

    Raises:
        ValueError: a bound that is not positive.
    """

    def __init__(
        self,
        max_entries: int = 10_000,
        max_bytes: int = 256 << 20,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1 or max_bytes < 1 or not ttl_s > 0:
            raise ValueError("transcript store bounds must be positive (max_entries, max_bytes, ttl_s)")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._data: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self._data)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """See ``TranscriptStore.get_many``; a hit becomes the most recently used entry."""
        now = self._clock()
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                item = self._data.get(key)
                if item is not None and item[1] <= now:
                    self._remove(key)
                    self.stats.expired += 1
                    item = None
                if item is None:
                    self.stats.misses += 1
                    out.append(None)
                    continue
                self._data.move_to_end(key)
                self.stats.hits += 1
                out.append(item[0])
        return out

    def put(self, key: bytes, value: bytes) -> None:
        """See ``TranscriptStore.put``; evicts least recently used entries until the bounds hold."""
        if len(value) > self.max_bytes:
            self.stats.too_big += 1
            return
        with self._lock:
            if key in self._data:
                self._remove(key)
            self._data[key] = (value, self._clock() + self.ttl_s)
            self.stats.bytes += len(value)
            self.stats.entries = len(self._data)
            self.stats.puts += 1
            while len(self._data) > self.max_entries or self.stats.bytes > self.max_bytes:
                oldest = next(iter(self._data))
                self._remove(oldest)
                self.stats.evicted += 1

    def _remove(self, key: bytes) -> None:
        value, _ = self._data.pop(key)
        self.stats.bytes -= len(value)
        self.stats.entries = len(self._data)


@dataclass
class MemoryStats:
    """Counters of a ``TranscriptMemory`` (cumulative).

    Attributes:
        lookups: requests that looked for an earlier prefix (they had at least one assistant reply).
        hits: lookups that reused a stored prefix.
        reused_messages: canonical messages taken from the memory, summed over hits.
        rejected: stored entries found but not reused (undecodable, or not the request's stable form).
        stored: entries written.
    """

    lookups: int = 0
    hits: int = 0
    reused_messages: int = 0
    rejected: int = 0
    stored: int = 0


def one_form(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with a content of exactly one plain text part (``[{"type": "text", "text": t}]``, no other
    key) written as the string ``t``: the two forms render alike, so a client that switches between them from
    one turn to the next keeps its transcript (the key and the reuse check compare this form). Any other
    message is returned as it is."""
    content = message.get("content")
    if isinstance(content, list) and len(content) == 1:
        part = content[0]
        if isinstance(part, dict) and part.keys() == {"type", "text"} and part["type"] == "text":
            if isinstance(part["text"], str):
                return {**message, "content": part["text"]}
    return message


def same_forms(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    """``a == b`` once each message is in ``one_form``."""
    return len(a) == len(b) and all(x == y or one_form(x) == one_form(y) for x, y in zip(a, b, strict=True))


_MONTHS = r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\.?"
_TIME_LIKE = re.compile(
    r"\b\d{4}-\d{1,2}-\d{1,2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?)?(?:Z|[+-]\d{2}:?\d{2})?"
    r"|\b\d{1,2}[:.h]\d{2}(?::\d{2})?(?:[ \t]?[ap]\.?m\.?)?\b"
    r"|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?[ \t]+{_MONTHS}(?:[ \t]+\d{{4}})?\b"
    rf"|\b{_MONTHS}[ \t]+\d{{1,2}}(?:st|nd|rd|th)?(?:,?[ \t]+\d{{4}})?\b"
    r"|\b\d{10,13}\b",
    re.IGNORECASE,
)
"""Dates, clock times and epoch numbers inside a value (``conversation_scope`` masks them)."""

_TOKEN = re.compile(r"[^\s,;()\[\]{}<>\"'`]+")
"""A word of a value, as ``_masked_token`` judges it."""

_NUMBER = re.compile(r"[$€£]?\d+(?:[.,]\d+)?%?\.?")
_DAY_WORD = re.compile(
    r"(?:(?:mon|tues|wednes|thurs|fri|satur|sun)day|morning|afternoon|evening|night|noon|midnight|tonight|today"
    r"|tomorrow|yesterday|january|february|march|april|may|june|july|august|september|october|november|december"
    r"|jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec|am|pm|a\.m\.?|p\.m\.?|오전|오후|午前|午後|上午|下午)\.?",
    re.IGNORECASE,
)


def _masked_token(match: re.Match[str]) -> str:
    """``#`` for a word of a per-request value that changes from one request to the next: a number (a count, a
    part of a date), a word holding letters and digits (an id, ``2025년``), a weekday, month or part of the day;
    the word itself otherwise (an IP address, a place, a name: they tell whose conversation it is)."""
    word = match.group(0)
    digits = any(c.isdigit() for c in word)
    if _NUMBER.fullmatch(word) or (digits and any(c.isalpha() for c in word)) or _DAY_WORD.fullmatch(word):
        return "#"
    return word


_MASK_RUN = re.compile(r"#(?:[\s,./:-]*#)+")
"""Masks next to each other, as one ("Tuesday 18:45" and "18:45" alike)."""


USER_MARK = "\0user:"
"""What a memory scope holds before the end-user id the client named (the gateway's ``Canonicalizer.scope``): such a
scope already tells whose conversation it is, so private per-request values may change freely in it."""


def conversation_scope(scope: str, system_values: Sequence[tuple[str, str, bool | str]]) -> str:
    """``scope`` narrowed to the conversations whose system prompt holds the same values that tell whose
    conversation it is (``system_values`` not per request: a user's name, e-mail, memories, location, user
    id; ``Rule.per_request``). Two users whose prompts differ only in such values have one stable form, so
    without this one's stored history, old blocks and all, would be reused for the other (and show them
    the first one's name). Per-request values (a time, a request id) change between the turns of one
    conversation and are left out. ``scope`` itself when there are no such values.

    A per-request value names the conversation by what is left once what changes per request is masked (dates
    and times, numbers, words holding letters and digits such as ids, weekdays, months, parts of the day:
    ``_masked_token``): ``Current time: 2025-03-03T10:00:00Z`` leaves ``Current time: #``, the same for every
    request and every user, while ``Last login: 2025-03-02 22:14 from 203.0.113.7 (Paris, iPhone)`` or
    ``Current time: 10:00 for the patient Alice Martin`` keep the user's own words (an IP address included). A re-check after a fresh-user trial saw such lines, hoisted whole by the
    date rules, carry one customer's login place and a patient's name into another customer's first block.

    Private per-request values (flag ``PRIVATE``: a git status, the user's own data that may still change
    within a conversation) are left out only when ``scope`` names the end user (``USER_MARK``). Without it they
    name the conversation whole: a fresh-user trial saw two customers of one app with the same opening exchange
    and no ``user`` field share a stable form, and the second was served the first one's stored history, a git
    status naming the first one's files in its first block.

    A value that holds a time or a date besides the user's identity (``User: alice, plan: pro, local time
    14:03``) names the conversation by the rest: its dates, clock times and epoch numbers are masked first
    (``_TIME_LIKE``), so the next turn's new time finds the same conversation.

    The digest is blake2b-128 over the distinct (masked) values, sorted and length-framed."""
    user_named = USER_MARK in scope
    values = sorted(
        {
            _masked(value, per_request is True)
            for _, value, per_request in system_values
            if not (per_request == PRIVATE and user_named)
        }
    )
    if not values:
        return scope
    h = hashlib.blake2b(digest_size=16, person=b"pg-conversation")
    for value in values:
        data = value.encode("utf-8")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return scope + "\0conversation:" + h.hexdigest()


def _masked(value: str, per_request: bool) -> str:
    """``value`` as it names a conversation: its dates and times masked, and for a per-request value everything
    ``_masked_token`` masks."""
    value = _TIME_LIKE.sub("#", value)
    if not per_request:
        return value
    return _MASK_RUN.sub("#", _TOKEN.sub(_masked_token, value))


class PrefixHasher:
    """Keys of a request's stable form and of its prefixes, in one pass (blake2b-256, length-framed).

    Args:
        scope: the model and tenant (any string; the gateway passes ``model + "\\0" + tenant``).
        tools: the canonical tools (or None).
    """

    def __init__(self, scope: str, tools: list[dict[str, Any]] | None, tools_json: str | None = None) -> None:
        self._h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"pg-transcript-1")
        self._feed(scope)
        self._feed(canonical_json(tools) if tools_json is None else tools_json)
        self._count = 0

    @property
    def count(self) -> int:
        """How many messages have been fed."""
        return self._count

    def copy(self) -> PrefixHasher:
        """An independent hasher in the same state (the rules' prefix memo keeps one per conversation prefix
        and goes on from a copy)."""
        other = PrefixHasher.__new__(PrefixHasher)
        other._h = self._h.copy()
        other._count = self._count
        return other

    def _feed(self, text: str) -> None:
        data = text.encode("utf-8")
        self._h.update(len(data).to_bytes(8, "big"))
        self._h.update(data)

    def keys(self, messages: list[dict[str, Any]], ends: Sequence[int]) -> list[bytes]:
        """The key of ``messages[:end]`` for each ``end`` (ascending, each >= ``count`` and <= len(messages));
        ``messages[:count]`` must be the messages already fed."""
        out: list[bytes] = []
        for end in ends:
            while self._count < end:
                self._feed(canonical_message_json(one_form(messages[self._count])))
                self._count += 1
            out.append(self._h.copy().digest())
        return out


class TranscriptMemory:
    """The canonical transcript memory over a ``TranscriptStore`` (in-process by default).

    ``RuleSet.apply(messages, tools, memory=m, scope=...)`` uses it; nothing else needs to call it.

    Args:
        store: where entries live (default: a fresh ``InProcessTranscriptStore()``).
        recall_chars: most characters (JSON text of the entries' messages) the memo of decoded entries holds.
        recall_entries: most entries that memo holds.
    """

    def __init__(
        self,
        store: TranscriptStore | None = None,
        recall_chars: int = 16_000_000,
        recall_entries: int = 4_096,
    ) -> None:
        self.store: TranscriptStore = store if store is not None else InProcessTranscriptStore()
        self.stats = MemoryStats()
        self._lock = threading.Lock()
        self.recalled: BoundedLRU[bytes, Recalled] = BoundedLRU(
            recall_entries, (recall_chars,), lambda data, rec: (rec.chars + len(data),)
        )
        """Stored value bytes -> what they decode to (values are immutable: a value seen again, from this
        process or from Redis, is not decoded again)."""

    def recall(self, keys: Sequence[bytes]) -> Iterator[tuple[int, Recalled]]:
        """``candidates`` through the memo of decoded values: (index into ``keys``, ``Recalled``) for each key
        found, in the order of ``keys``, fetched lazily the same way. An undecodable value is skipped and
        counted as ``rejected``."""
        for index, data in self._stored(keys):
            rec = self.recalled.get(data)
            if rec is None:
                found = decode_entry(data)
                if found is None:
                    self.count(rejected=1)
                    continue
                entry = found.entry
                rec = Recalled(
                    tuple(entry.messages),
                    tuple(entry.present),
                    found.chars,
                    data=data,
                    frames=found.message_frames,
                )
                self.recalled.put(data, rec)
            yield index, rec

    def remember_after(
        self,
        key: bytes,
        messages: list[dict[str, Any]],
        present: list[str],
        base: Recalled | None,
    ) -> None:
        """Store ``TranscriptEntry(messages, present)`` under ``key``, where ``messages`` begins with ``base``'s
        messages (a copy of them, when ``base`` is given): only the messages after those are serialized,
        stripped, copied and compressed (``messages`` is not kept: the caller owns it); the entry's bytes hold
        ``base``'s message frames as they are (``rules.transcript_entry``).
        """
        done = len(base.messages) if base is not None else 0
        new_text = ",".join(_message_json(m) for m in messages[done:])
        base_text = base.text if base is not None else ""
        piece = "," + new_text if base_text and new_text else new_text
        text = base_text + piece
        frames = (base.message_frames() if base is not None and base_text else b"") + (
            frame(piece) if piece else b""
        )
        data, at = framed(present, frames)
        self.store.put(key, data)
        self.count(stored=1)
        self.recalled.put(data, Recalled(None, tuple(present), len(text), text, base, new_text, data, at))

    def candidates(self, keys: Sequence[bytes]) -> Iterator[tuple[int, TranscriptEntry]]:
        """(index into ``keys``, decoded entry) for each key found, in the order of ``keys``, fetched lazily:
        the first key alone (the common hit, one small read), then the rest in one ``get_many``. An
        undecodable value is skipped and counted as ``rejected``."""
        for index, data in self._stored(keys):
            entry = TranscriptEntry.decode(data)
            if entry is None:
                self.count(rejected=1)
                continue
            yield index, entry

    def _stored(self, keys: Sequence[bytes]) -> Iterator[tuple[int, bytes]]:
        """(index into ``keys``, stored bytes) for each key found, in order, fetched lazily: the first key alone
        (the common hit, one small read), then the rest in one ``get_many``."""
        for offset, batch in ((0, list(keys[:1])), (1, list(keys[1:]))):
            if not batch:
                continue
            for i, data in enumerate(self.store.get_many(batch)):
                if data is not None:
                    yield offset + i, data

    def remember(self, key: bytes, entry: TranscriptEntry) -> None:
        """Store ``entry`` under ``key``."""
        self.store.put(key, entry.encode())
        self.count(stored=1)

    def count(self, **deltas: int) -> None:
        """Add to the named ``MemoryStats`` counters."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""``json.dumps(..., separators=(",", ":"), ensure_ascii=False)`` without building an encoder per call."""


def _message_json(message: dict[str, Any]) -> str:
    """A message as ``TranscriptEntry.encode`` writes it inside its list (compact, key order kept; a long
    system prompt's text comes from ``rules.message_json``'s memo)."""
    return compact_message_json(message)


class Recalled:
    """A decoded entry with what reusing it needs, each part computed once per stored value, when first asked
    for (an entry no later request reuses, e.g. a one-question chat, costs no stripping).

    Nothing here is handed to callers (they copy ``messages``); nothing here is mutated once computed.

    Args:
        messages: the entry's canonical messages, or None: ``base``'s followed by those of ``new_text``, parsed
            when first asked for (an entry no request reuses is never parsed).
        present: the entry's system values.
        chars: characters of its JSON text (the memo's cost).
        text: the JSON of ``messages`` without the list's brackets, if known.
        base: a ``Recalled`` whose messages ``messages`` begins with (its turns are taken from it).
        new_text: the JSON of the messages after ``base``'s, without the list's brackets.
        data: the stored bytes it was read from or written as (the memo's key object, not a copy), if known.
        frames: ``(start, end)`` of the message frames in ``data`` (a version-2 entry), or None.
    """

    __slots__ = (
        "_messages",
        "present",
        "chars",
        "_text",
        "_base",
        "_new_text",
        "_derived",
        "_data",
        "_frames",
    )

    def __init__(
        self,
        messages: tuple[dict[str, Any], ...] | None,
        present: tuple[str, ...],
        chars: int,
        text: str | None = None,
        base: Recalled | None = None,
        new_text: str = "",
        data: bytes | None = None,
        frames: tuple[int, int] | None = None,
    ) -> None:
        self._messages = messages
        self._data = data
        self._frames = frames
        self.present = present
        self.chars = chars
        self._text = text
        self._base = base
        self._new_text = new_text
        self._derived: tuple[Any, ...] | None = None

    @property
    def messages(self) -> tuple[dict[str, Any], ...]:
        """The entry's canonical messages (never to be handed out or changed: callers copy them)."""
        messages = self._messages
        if messages is None:  # two threads may both parse: each gets the same value, one is kept
            base = self._base  # read once: ``_derive`` lets it go once the messages are parsed
            messages = (base.messages if base is not None else ()) + tuple(
                json.loads("[" + self._new_text + "]")
            )
            self._messages = messages
        return messages

    @property
    def text(self) -> str:
        """The JSON of ``messages`` without the list's brackets (``encode``'s text of the list)."""
        if self._text is None:
            self._text = messages_json(list(self.messages))
        return self._text

    def message_frames(self) -> bytes:
        """Its messages as ``rules.transcript_entry`` frames: the stored ones copied as bytes, or (a version-1
        entry) one new frame of ``text``."""
        data, frames = self._data, self._frames
        if data is not None and frames is not None:
            return data[frames[0] : frames[1]]
        return frame(self.text) if self.text else b""

    @property
    def spans(self) -> list[tuple[int, int]]:
        """``turn_spans(messages)``."""
        return self._derive()[0]

    @property
    def turn_stripped(self) -> list[list[dict[str, Any]]]:
        """Per turn, its messages with the hoisted-value blocks taken out (``extract_turn_blocks``)."""
        return self._derive()[1]

    @property
    def turn_blocks(self) -> list[list[list[str]]]:
        """Per turn, the values of each block taken out, in ``LOCATIONS`` order."""
        return self._derive()[2]

    @property
    def stripped(self) -> list[dict[str, Any]]:
        """``messages`` with every turn's blocks taken out (the turns' concatenated)."""
        return self._derive()[3]

    @property
    def blocks(self) -> list[list[str]]:
        """Every block's values, in prompt order."""
        return self._derive()[4]

    def _derive(self) -> tuple[Any, ...]:
        """Strip the blocks turn by turn, last turn first (each turn's extraction reads only that turn and, for
        the first, the leading system messages), as ``RuleSet.apply`` did on a copy of the whole entry. When the
        turns over the base's messages are the base's, those turns are taken from the base."""
        if self._derived is not None:
            return self._derived
        messages = list(self.messages)  # parsed before the base is let go
        spans = turn_spans(messages)
        base = self._base
        kept = 0
        if base is not None and base.spans and spans[: len(base.spans)] == base.spans:
            kept = len(base.spans)
        work = messages
        new_stripped: list[list[dict[str, Any]]] = []
        new_blocks: list[list[list[str]]] = []
        for start, end in reversed(spans[kept:]):
            work[start:end] = copy_json(work[start:end])
            found, new_end = extract_turn_blocks(work, start, end)
            new_stripped.append(work[start:new_end])
            new_blocks.append([found[loc] for loc in LOCATIONS if found.get(loc)])
        turn_stripped = (base.turn_stripped[:kept] if base is not None else []) + new_stripped[::-1]
        turn_blocks = (base.turn_blocks[:kept] if base is not None else []) + new_blocks[::-1]
        self._derived = (
            spans,
            turn_stripped,
            turn_blocks,
            [m for turn in turn_stripped for m in turn],
            [values for turn in turn_blocks for values in turn],
        )
        self._base = None
        return self._derived
