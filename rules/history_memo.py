"""The history memo of ``RuleSet.apply`` (``RuleSet.history_memo``): what the turns of earlier requests of a
conversation gave, so a request resent turn after turn is canonicalized only from its new turns.

Owns the memo's entries (``FirstTurn``, ``LaterTurns``), their keys (``raw_items``: messages as sent, compared
in full, so a hit is never a collision) and their cost (``json_chars``), and the memo's bounds.

Invariants: an entry is never mutated once stored and never handed out (callers copy what they extend); a
memo may be shared by a base rule set and its learned sets, each keying under its own tag (``RULESET_TAGS``);
the memo is bounded by entries and by characters held (``new_history_memo``).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from rules.bounded_lru import BoundedLRU
from rules.transcript import PrefixHasher

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

HISTORY_MEMO_ENTRIES = 4_096
"""Most conversation prefixes a ``RuleSet`` keeps (``RuleSet.history_memo``; learned rule sets share their base
rule set's memo, so this bounds them all together)."""

RULESET_TAGS = itertools.count()
"""A tag per ``RuleSet``, the second item of its ``history_memo`` keys (a memo may be shared)."""

HISTORY_MEMO_CHARS = 16_000_000
"""Most characters those prefixes hold, summed per prefix (a conversation's prefixes share their messages, so
the memory held is at most this)."""


class FirstTurn:
    """What the first turn of a request gave (blocks taken out, rules run), kept under the turn as sent
    (``RuleSet.history_memo``, key ``first_key(...)``). Never mutated, never handed out.

    Attributes:
        processed: its messages, blocks out and rules run.
        carried, own: values of the blocks taken out / values the rules hoisted, by location.
        applied: rule id -> applications, in first-application order.
        system_values: (placement, value, per request) hoisted from the leading system messages (per request:
            ``Rule.value_per_request``).
        items: ``raw_items(processed)``: the first turn in the keys of the later turns' memo.
        chars: about how many characters it holds (the memo's cost).
    """

    __slots__ = ("processed", "carried", "own", "applied", "system_values", "items", "_chars")

    def __init__(
        self,
        processed: tuple[dict[str, Any], ...],
        carried: dict[str, list[str]],
        own: dict[str, list[str]],
        applied: tuple[tuple[str, int], ...],
        system_values: tuple[tuple[str, str, bool], ...],
        items: tuple[Any, ...],
    ) -> None:
        self.processed = processed
        self.carried = carried
        self.own = own
        self.applied = applied
        self.system_values = system_values
        self.items = items
        self._chars: int | None = None

    @property
    def chars(self) -> int:
        """About how many characters it holds (the memo's cost), counted when first asked for: a one-turn
        request's first turn is never stored, and never counted."""
        chars = self._chars
        if chars is None:
            chars = self._chars = sum(json_chars(m) for m in self.processed)
        return chars


class LaterTurns:
    """What the turns after the first of one request gave, kept to go on from when a later request of the
    conversation begins with that request (``RuleSet.history_memo``, key ``later_key(...)``: a first turn
    whose hoisted values changed, e.g. a system prompt with the current time, still finds them). Never mutated
    once stored, never handed out.

    Attributes:
        processed: the later turns' messages, blocks out and rules run.
        spans: their turns (indices in the whole request, the first turn's processed messages before them).
        carried, own: per turn, values of the blocks taken out / values the rules hoisted, by location.
        applied: rule id -> applications in these turns, in first-application order.
        hasher: the transcript key hasher fed with the whole request's processed messages (or None).
        keys: the transcript keys of the processed request up to each later turn, then of all of it.
        key: its key in the memo.
        chars: about how many characters it holds (the memo's cost).
    """

    __slots__ = ("processed", "spans", "carried", "own", "applied", "hasher", "keys", "key", "chars")

    def __init__(
        self,
        processed: tuple[dict[str, Any], ...],
        spans: tuple[tuple[int, int], ...],
        carried: tuple[dict[str, list[str]], ...],
        own: tuple[dict[str, list[str]], ...],
        applied: tuple[tuple[str, int], ...],
        hasher: PrefixHasher | None,
        keys: tuple[bytes, ...],
        key: tuple[Any, ...],
        chars: int,
    ) -> None:
        self.processed = processed
        self.spans = spans
        self.carried = carried
        self.own = own
        self.applied = applied
        self.hasher = hasher
        self.keys = keys
        self.key = key
        self.chars = chars

    @property
    def scope(self) -> str:
        """The scope of its key (the string object of the request that stored it)."""
        return self.key[2]

    @property
    def tools_json(self) -> str:
        """The canonical tools of its key."""
        return self.key[3]

    @property
    def sent(self) -> tuple[Any, ...]:
        """``raw_items`` of its later turns as sent (the last item of its key)."""
        return self.key[5]


def first_key(tag: int, scope: str, sent: tuple[Any, ...]) -> tuple[Any, ...]:
    """The memo key of a ``FirstTurn``: ``("first", rule set tag, scope, raw_items of the first turn as sent)``."""
    return ("first", tag, scope, sent)


def later_key(
    tag: int, scope: str, tools_json: str, first: tuple[Any, ...], sent: tuple[Any, ...]
) -> tuple[Any, ...]:
    """The memo key of a ``LaterTurns``: ``("later", rule set tag, scope, canonical tools, the first turn as
    processed (``FirstTurn.items``), raw_items of the later turns as sent)``; ``LaterTurns.scope``,
    ``tools_json`` and ``sent`` read it back."""
    return ("later", tag, scope, tools_json, first, sent)


def raw_items(messages: list[dict[str, Any]]) -> list[Any] | None:
    """Each message as sent, as a hashable value equal only for equal messages (key order included): a message
    whose values are all strings (``{"role": str, "content": str}``, a tool result's ``{"role", "tool_call_id",
    "content"}``; keys are strings after ``check_shape``) as the tuple of its items, any other as its JSON text
    (which tells ``1``, ``1.0`` and ``true`` apart, as tuples of items would not). None when a message is not
    JSON data. ``RuleSet.history_memo`` is keyed by tuples of these: a lookup compares the keys in full, so a
    hit is never a collision. An agent's tool results, the bulk of its transcript, are not JSON-encoded on
    every request."""
    out: list[Any] = []
    try:
        for m in messages:
            items = tuple(m.items())
            for _, value in items:
                if type(value) is not str:
                    out.append(_COMPACT.encode(m))
                    break
            else:
                out.append(items)
    except (TypeError, ValueError):
        return None
    return out


def json_chars(value: Any) -> int:
    """About how many characters ``value`` holds (strings' lengths, 8 per other value): the cost of a
    message in ``history_memo``."""
    t = type(value)
    if t is str:
        return len(value)
    if t is dict:
        return sum(len(k) + json_chars(v) for k, v in value.items()) + 8
    if t is list:
        return sum(json_chars(v) for v in value) + 8
    return 8


def new_history_memo() -> BoundedLRU:
    """An empty history memo bounded by ``HISTORY_MEMO_ENTRIES`` entries and ``HISTORY_MEMO_CHARS`` characters
    (each entry's ``chars``)."""
    return BoundedLRU(HISTORY_MEMO_ENTRIES, (HISTORY_MEMO_CHARS,), lambda _, state: (state.chars,))
