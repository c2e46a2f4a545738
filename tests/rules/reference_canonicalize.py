"""The algorithm of ``RuleSet.apply`` as it was before the incremental rewrite (session 7, commit a6f2cfc),
kept only as the reference of the differential test (``test_incremental.py``): the incremental
``RuleSet.apply`` must give byte-identical results on every input. It uses the rule set's own pass memo
(``RuleSet._run_pass`` and friends, pure functions of the rule and the text), nothing else of the new code.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from rules.canonicalize import Canonical, HistoryInfo, RuleSet
from rules.messages import check_shape, get_text, leading_system_count, set_text, text_parts
from rules.model import PLACEMENTS
from rules.placement import (
    LOCATIONS,
    extract_text_blocks,
    extract_turn_blocks,
    insert_turn_blocks,
    resolve_location,
    turn_spans,
)
from rules.segments import Position, compute_segments, normalize_position
from rules.transcript import PrefixHasher, TranscriptEntry, TranscriptMemory, conversation_scope
from rules.turn_rules import MAX_PASSES


def reference_apply(
    rs: RuleSet,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    memory: TranscriptMemory | None = None,
    scope: str = "",
) -> Canonical:
    """Canonicalize one chat request, turn by turn (see ``rules.placement.turn_spans``).

    Each turn is canonicalized as it was when it was the newest (rules select messages as in that
    request; its hoisted values go into a block inside that turn), so the canonical form of the earlier
    turns is exactly what was sent for them. Values hoisted from the system prompt go into the first
    turn's block. With ``memory``, the stored canonical messages of the longest earlier request of this
    conversation (same ``scope`` and tools) are reused verbatim, blocks with their old values included,
    and the system values that changed since that request go into a block in the first new turn.

    Args:
        messages: OpenAI chat messages (``role``; ``content`` a string, a list of parts, or null;
            other keys are kept as they are).
        tools: OpenAI (or Anthropic) tool schemas, or None.
        memory: the canonical transcript memory, or None (stateless: the result depends on the
            request alone).
        scope: what separates conversations in the memory (the gateway passes model and tenant).

    Returns:
        the ``Canonical`` request (new objects).

    Raises:
        RequestShapeError: messages or tools are not in that shape.
    """
    check_shape(messages, tools)
    messages = copy.deepcopy(messages)
    tools = copy.deepcopy(tools)
    if not rs.rules:
        return Canonical(messages, tools, compute_segments(messages, tools, []))
    applied: Counter[str] = Counter()
    tools = rs._apply_tool_rules(tools, applied)
    spans = turn_spans(messages)
    carried: list[dict[str, list[str]]] = [{} for _ in spans]
    if rs.turns.hoists:
        for j in range(len(spans) - 1, -1, -1):
            carried[j], _ = extract_turn_blocks(messages, *spans[j])
        spans = turn_spans(messages)
        if len(spans) != len(carried):  # only a hand-edited request gets here: keep every value
            # the first turn's stay in it (a system_end block has no place in a later turn); the later turns'
            # go to the last turn
            merged = {loc: [v for c in carried[1:] for v in c.get(loc, [])] for loc in LOCATIONS}
            first = carried[0]
            carried = [{} for _ in spans]
            if spans:
                carried[0] = {loc: list(v) for loc, v in first.items() if v}
                for loc, values in merged.items():
                    if values:
                        carried[-1][loc] = carried[-1].get(loc, []) + values
    systems = leading_system_count(messages)
    own: list[dict[str, list[str]]] = []
    system_values: list[tuple[str, str, bool]] = []
    for j, (start, end) in enumerate(spans):
        before = sum(applied.values())
        own.append(_reference_turn(rs, messages, start, end, j, systems, applied, system_values, scope))
        # session 9: blocks the rules uncovered are taken out too, and the rules run again (the canonical
        # output's next pass would take them for blocks of ours: idempotence); only a turn the rules changed
        for _ in range(MAX_PASSES if rs.turns.hoists and sum(applied.values()) != before else 0):
            uncovered = extract_text_blocks(messages, start, end)
            if not uncovered:
                break
            carried[j] = {**carried[j], **{k: [*carried[j].get(k, []), *v] for k, v in uncovered.items()}}
            more = _reference_turn(rs, messages, start, end, j, systems, applied, system_values, scope)
            own[j] = {**own[j], **{k: [*own[j].get(k, []), *v] for k, v in more.items()}}
    present_now = [v for _, v, _ in system_values]

    reused: list[dict[str, Any]] = []
    first_new = 0
    present = present_now
    history = HistoryInfo(turns=len(spans))
    keys: list[bytes] = []
    if memory is not None:
        hasher = PrefixHasher(conversation_scope(scope, system_values), tools)
        keys = hasher.keys(messages, [s for s, _ in spans[1:]] + [len(messages)])
        if len(spans) > 1:
            memory.count(lookups=1)
            found = _reference_reuse(memory, keys[:-1], messages, spans)
            if found is not None:
                first_new, entry = found
                reused = entry.messages
                present = entry.present
                memory.count(hits=1, reused_messages=len(reused))
                history.reused_turns = first_new
                history.reused_messages = len(reused)

    final = copy.deepcopy(reused)
    starts: list[Position] = []
    hoisted: list[str] = [v for c in _blocks_of(final) for v in c]
    newest_start = 0
    for j in range(first_new, len(spans)):
        start, end = spans[j]
        values = {loc: list(carried[j].get(loc, [])) + own[j].get(loc, []) for loc in LOCATIONS}
        if j == first_new > 0:
            # the reused history holds the system values of its time: those that changed since the
            # previous request go into this turn (a value said before and still current is not repeated)
            for placement, value, _ in system_values:
                if value not in present:
                    values[resolve_location(placement, messages, start, end)].append(value)
        offset = len(final) - start
        turn = copy.deepcopy(messages[start:end])
        final.extend(turn)
        turn_starts, _ = insert_turn_blocks(
            final, start + offset, end + offset, {loc: v for loc, v in values.items() if v}
        )
        hoisted.extend(v for loc in LOCATIONS for v in values[loc])
        starts.extend(turn_starts)
        if j == len(spans) - 1:
            newest_start = start + offset
    if memory is not None and keys:
        memory.remember(keys[-1], TranscriptEntry(final, present_now or present))
        if first_new == 0 and len(keys) > 1:  # history the memory never saw: the next request goes on from it
            memory.remember(keys[-2], TranscriptEntry(final[:newest_start], present_now or present))
    starts = [normalize_position(final, s) for s in starts]
    segments = compute_segments(final, tools, starts)
    return Canonical(final, tools, segments, dict(applied), hoisted, history)


def _reference_turn(
    rs: RuleSet,
    messages: list[dict[str, Any]],
    start: int,
    end: int,
    turn: int,
    systems: int,
    applied: Counter[str],
    system_values: list[tuple[str, str, bool]],
    scope: str = "",
) -> dict[str, list[str]]:
    """Run the span and normalize rules to a fixed point on the turn ``messages[start:end]`` (in place),
    selecting messages as in the request ``messages[:end]``. Values hoisted from the leading system
    messages are appended to ``system_values`` (with their placement) and, in the first turn, also
    returned; the others are returned by the location they take in this turn."""
    view = messages[:end]
    locations = {p: resolve_location(p, view, start, end) for p in PLACEMENTS}
    values: dict[str, list[str]] = {}
    # rules change texts, never roles or the message count: each selector picks the same messages all along
    chosen = [[i for i in selector.select(view) if i >= start] for selector in rs.turns.selectors]
    # a rule only touches the messages it selects, so a message's texts go through its own rules in rule
    # order whatever the other messages do: one memoized pass per text, replayed below in rule-major order
    slots_of: dict[int, list[int]] = {}
    for slot, (_, selector, _, _) in enumerate(rs.turns.slots):
        for index in chosen[selector]:
            slots_of.setdefault(index, []).append(slot)
    plans = [
        (index, rs.turns.pass_id(tuple(slots)), tuple(slots)) for index, slots in sorted(slots_of.items())
    ]
    for _ in range(MAX_PASSES):
        steps: list[tuple[int, int, int, int, tuple[str, ...]]] = []  # (slot, message, part, n, hoisted)
        for index, pass_id, slots in plans:
            message = messages[index]
            for part in text_parts(message):
                text = get_text(message, part)
                new_text, n, done = rs.pass_cache.get(
                    pass_id, text, lambda t, slots=slots: rs.turns.run_pass(slots, t, scope), scope
                )
                if n:
                    set_text(message, part, new_text)
                    steps.extend((slot, index, part, count, hoisted) for slot, count, hoisted in done)
        if not steps:
            break
        steps.sort(key=lambda step: step[:3])  # what the rule-major loop over messages and parts gives
        for slot, index, _, count, hoisted in steps:
            rule = rs.turns.slots[slot][2]
            applied[rule.id] += count
            for value in hoisted:
                if index < systems:
                    system_values.append((rule.placement, value, rule.value_per_request(value)))
                if index >= systems or turn == 0:
                    values.setdefault(locations[rule.placement], []).append(value)
    return values


def _reference_reuse(
    memory: TranscriptMemory,
    keys: list[bytes],
    messages: list[dict[str, Any]],
    spans: list[tuple[int, int]],
) -> tuple[int, TranscriptEntry] | None:
    """(index of the first turn not covered, entry) for the longest earlier request in the memory whose
    blocks taken out give exactly ``messages`` up to that turn; None when there is none."""
    for back, entry in memory.candidates(keys[::-1]):
        turn = len(keys) - back
        stripped = copy.deepcopy(entry.messages)
        for start, end in reversed(turn_spans(stripped)):
            extract_turn_blocks(stripped, start, end)
        if stripped == messages[: spans[turn][0]]:
            return turn, entry
        memory.count(rejected=1)
    return None


def _blocks_of(messages: list[dict[str, Any]]) -> list[list[str]]:
    """The values of every block in ``messages`` (canonical messages), in prompt order."""
    copied = copy.deepcopy(messages)
    per_turn: list[list[list[str]]] = []
    for start, end in reversed(turn_spans(copied)):  # last turn first: a removed note shifts later turns only
        found, _ = extract_turn_blocks(copied, start, end)
        per_turn.append([found[loc] for loc in LOCATIONS if found.get(loc)])
    return [values for turn in reversed(per_turn) for values in turn]
