"""The turns of one request with the hoisted-value blocks taken out and the rules run, for ``RuleSet.apply``:
every turn (``turns_full``), or only the turns after what the history memo holds of earlier requests of the
conversation (``turns_incremental``: the first turn by its messages as sent, the later turns of the longest
earlier request by the first turn as processed and their messages as sent; ``rules.history_memo``).

Invariants: both give the same ``Turns`` for the same request (tests/rules/test_incremental.py); the caller's
messages are never changed (the work list holds copies, or the memo's processed messages, which are never
changed either); ``turns_incremental`` gives None, and the caller goes the full way, when taking the blocks out
changed the turns (a hand-edited request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rules.bounded_lru import BoundedLRU
from rules.history_memo import FirstTurn, LaterTurns, first_key, later_key, raw_items
from rules.messages import copy_json, leading_system_count
from rules.placement import LOCATIONS, extract_turn_blocks, turn_spans
from rules.transcript import conversation_scope
from rules.turn_rules import TurnRules

LATER_LOOKUPS = 16
"""How many of the longest earlier requests ``turns_incremental`` looks up in the memo (a key holds the later
turns' messages, so one lookup costs their length): a conversation's previous request is one or a few turns
shorter, and a request whose earlier form is further back goes the full way (the same ``Turns``), so a request
of n turns costs O(n) lookups' worth, not O(n^2) (50,000 alternating messages took 48 s before)."""


@dataclass
class Turns:
    """The turns of one request, blocks taken out and rules run (``turns_full`` / ``turns_incremental``).

    Attributes:
        work: the messages, blocks out and rules run; spans: their turns.
        carried, own: per turn, values of the blocks taken out / hoisted by the rules, by location.
        applied: rule id -> applications over the turns, in first-application order.
        system_values: (placement, value, per request) hoisted from the leading system messages (per request:
            ``Rule.value_per_request``).
        merged: the turns changed when the blocks came out, and every carried value went to the last turn.
        first: the first turn's memo entry (incremental only); later: the later turns' entry it went on from.
        later_applied: applications in the turns after the first (incremental only).
        memory_scope: ``conversation_scope`` of the scope and the system values, when it was computed here (the
            later turns' memo key); ``RuleSet.apply`` keys the transcript memory with it.
    """

    work: list[dict[str, Any]]
    spans: list[tuple[int, int]]
    carried: list[dict[str, list[str]]]
    own: list[dict[str, list[str]]]
    applied: dict[str, int]
    system_values: list[tuple[str, str, bool]]
    merged: bool = False
    first: FirstTurn | None = None
    later: LaterTurns | None = None
    later_applied: dict[str, int] | None = None
    memory_scope: str | None = None


def turns_full(
    rules: TurnRules, messages: list[dict[str, Any]], raw_spans: list[tuple[int, int]], scope: str
) -> Turns:
    """Take the blocks out of every turn of a copy of ``messages`` and run the rules on every turn."""
    work = copy_json(messages)
    carried: list[dict[str, list[str]]] = [{} for _ in raw_spans]
    spans = raw_spans
    merged = False
    if rules.hoists:
        for j in range(len(raw_spans) - 1, -1, -1):
            carried[j], _ = extract_turn_blocks(work, *raw_spans[j])
        spans = turn_spans(work)
        if len(spans) != len(carried):  # only a hand-edited request gets here: keep every value
            # the first turn's stay in it (its system_end block has no place in a later turn: merged into the
            # last turn it was dropped, found by a property test on a request of system messages and tool
            # results); the later turns' go to the last turn
            later_values = {loc: [v for c in carried[1:] for v in c.get(loc, [])] for loc in LOCATIONS}
            first_values = carried[0]
            carried = [{} for _ in spans]
            if spans:
                carried[0] = {loc: list(v) for loc, v in first_values.items() if v}
                last = carried[-1]
                for loc, values in later_values.items():
                    if values:
                        last[loc] = last.get(loc, []) + values
            merged = True
    systems = leading_system_count(work)
    applied: dict[str, int] = {}
    system_values: list[tuple[str, str, bool]] = []
    firsts: dict[Any, int | None] = {}
    own = [
        rules.run(work, start, end, j, systems, applied, system_values, scope, firsts, carried)
        for j, (start, end) in enumerate(spans)
    ]
    return Turns(work, spans, carried, own, applied, system_values, merged)


def turns_incremental(
    rules: TurnRules,
    memo: BoundedLRU[tuple[Any, ...], Any],
    memo_tag: int,
    messages: list[dict[str, Any]],
    raw_spans: list[tuple[int, int]],
    items: list[Any],
    scope: str,
    tools_json: str,
) -> Turns | None:
    """What ``_turns_full`` gives, from the memo: the first turn by its messages as sent, the later turns of
    the longest earlier request of the conversation by the first turn as processed and their messages as
    sent; only the turns after those are canonicalized. None (go the full way) when taking the blocks out
    changed the turns (a hand-edited request)."""
    e0 = raw_spans[0][1]
    key0 = first_key(memo_tag, scope, tuple(items[:e0]))
    first = memo.get(key0)
    if first is None:
        w0 = copy_json(messages[:e0])
        carried0: dict[str, list[str]] = {}
        if rules.hoists:
            carried0, _ = extract_turn_blocks(w0, 0, e0)
        applied0: dict[str, int] = {}
        values0: list[tuple[str, str, bool]] = []
        systems0 = leading_system_count(w0)
        carried_first = [carried0]
        own0 = rules.run(w0, 0, len(w0), 0, systems0, applied0, values0, scope, {}, carried_first)
        carried0 = carried_first[0]
        items0 = raw_items(w0)
        if items0 is None:
            return None
        first = FirstTurn(tuple(w0), carried0, own0, tuple(applied0.items()), tuple(values0), tuple(items0))
        if len(raw_spans) > 1:
            # kept once the conversation has a second turn: a one-turn request (a chatbot's single question)
            # stores nothing here, and its next turn recomputes the first from the pass memo, once
            memo.put(key0, first)
    later: LaterTurns | None = None
    k = 1
    n_turns = len(raw_spans)
    later_scope: str | None = None
    if n_turns > 2:
        # the first turn as processed is the same for two users whose system prompts differ only in hoisted
        # values: the scope names the values that tell them apart, as the transcript memory's keys do
        later_scope = conversation_scope(scope, first.system_values)
        for j in range(n_turns - 1, max(1, n_turns - 1 - LATER_LOOKUPS), -1):  # the longest earlier first
            later = memo.get(
                later_key(memo_tag, later_scope, tools_json, first.items, tuple(items[e0 : raw_spans[j][0]]))
            )
            if later is not None:
                k = j
                break
    raw_from = raw_spans[k][0] if k < n_turns else len(messages)
    work = list(first.processed)
    if later is not None:
        work.extend(later.processed)
    work.extend(copy_json(messages[raw_from:]))
    shift = len(work) - len(messages)
    carried: list[dict[str, list[str]]] = [first.carried]
    if later is not None:
        carried.extend(later.carried)
    new_carried: list[dict[str, list[str]]] = [{} for _ in raw_spans[k:]]
    if rules.hoists:
        for j in range(n_turns - 1, k - 1, -1):
            start, end = raw_spans[j]
            new_carried[j - k], _ = extract_turn_blocks(work, start + shift, end + shift)
    carried.extend(new_carried)
    spans = turn_spans(work)
    if len(spans) != n_turns or spans[0] != (0, len(first.processed)):
        return None
    if later is not None and tuple(spans[1:k]) != later.spans:
        return None
    own = [first.own]
    if later is not None:
        own.extend(later.own)
    later_applied: dict[str, int] = dict(later.applied) if later is not None else {}
    system_values = list(first.system_values)
    systems = leading_system_count(work)
    firsts: dict[Any, int | None] = {}
    for j in range(k, n_turns):
        start, end = spans[j]
        own.append(
            rules.run(work, start, end, j, systems, later_applied, system_values, scope, firsts, carried)
        )
    applied: dict[str, int] = dict(first.applied)
    for rule_id, count in later_applied.items():
        applied[rule_id] = applied.get(rule_id, 0) + count
    return Turns(
        work, spans, carried, own, applied, system_values, False, first, later, later_applied, later_scope
    )
