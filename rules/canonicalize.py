"""``RuleSet.apply``: a chat request in, its canonical form and segments out.

Invariants:

- pure and deterministic: the inputs are never mutated and the same input gives byte-identical output
  (rules run in load order; matches left to right; hoisted values keep that order). With a transcript
  memory the result also depends on what the memory holds (and the request is remembered).
- history never moves: a request is canonicalized turn by turn, each turn as it was when it was the
  newest, so the canonical form of ``messages[:a]`` (``a`` an assistant reply's index) is a prefix of the
  canonical form of ``messages`` whenever the system prompt's hoisted values did not change; with the
  memory, also when they did (docs/history-stability.md).
- idempotent: ``apply(apply(r)) == apply(r)``. Hoisted-value blocks from an earlier run are taken out
  first (``placement.extract_turn_blocks``) and put back in the same turn with the new values; the rules then run to a fixed
  point (at most ``MAX_PASSES`` passes), so text a rule's action creates or uncovers is already handled; a
  block the rules uncover (user text that is a block after them) is taken out too (``RuleSet._turn``), so a
  block is recognized the same before and after a pass.
  A user rule that never reaches a fixed point (e.g. replace ``a`` with ``aa``) is cut off after
  ``MAX_PASSES`` passes; the result is still deterministic but not idempotent.
- incremental: what the turns of an earlier request of the conversation gave is taken from ``history_memo``
  (keys hold the messages as sent, compared in full) and only the new turns are canonicalized; the result is
  the same as canonicalizing every turn (tests/rules/test_incremental.py, against the previous algorithm).
  Nothing a memo holds is handed out or changed.
- preserving: every hoisted value is in the final messages (inside a block); text is removed only by
  ``drop``, by ``replace`` and ``reorder`` (matched text their template does not use), and by ``round``
  and ``normalize`` (digits and whitespace they rewrite).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rules.actions import apply_span_action, canonical_json, normalize_text, sort_tools
from rules.bounded_lru import BoundedLRU
from rules.history_memo import (
    RULESET_TAGS,
    FirstTurn,
    LaterTurns,
    first_key,
    json_chars,
    later_key,
    new_history_memo,
    raw_items,
)
from rules.messages import check_shape, copy_json, get_text, leading_system_count, set_text, text_parts
from rules.model import PLACEMENTS, MessageSelector, Rule, with_keep_rules
from rules.placement import (
    LOCATIONS,
    extract_text_blocks,
    extract_turn_blocks,
    insert_turn_blocks,
    resolve_location,
    turn_spans,
)
from rules.segments import (
    Position,
    Segment,
    SegmentLevel,
    compute_segments,
    normalize_position,
    stable_material,
)
from rules.text_cache import Result as TextResult
from rules.text_cache import TextActionCache
from rules.transcript import PrefixHasher, Recalled, TranscriptMemory

MAX_PASSES = 8
"""Upper bound on rule passes per request (a pass that changes nothing ends the loop)."""

PLAN_MEMO_ENTRIES = 1_024
"""Most selections a ``RuleSet`` keeps the pass plan of (``RuleSet._plan``; cleared when full)."""

_REPLY_ROLE = "assistant"


@dataclass
class _Turns:
    """The turns of one request, blocks taken out and rules run (``RuleSet._turns_full`` / ``_turns_incremental``).

    Attributes:
        work: the messages, blocks out and rules run; spans: their turns.
        carried, own: per turn, values of the blocks taken out / hoisted by the rules, by location.
        applied: rule id -> applications over the turns, in first-application order.
        system_values: (placement, value) hoisted from the leading system messages.
        merged: the turns changed when the blocks came out, and every carried value went to the last turn.
        first: the first turn's memo entry (incremental only); later: the later turns' entry it went on from.
        later_applied: applications in the turns after the first (incremental only).
    """

    work: list[dict[str, Any]]
    spans: list[tuple[int, int]]
    carried: list[dict[str, list[str]]]
    own: list[dict[str, list[str]]]
    applied: dict[str, int]
    system_values: list[tuple[str, str]]
    merged: bool = False
    first: FirstTurn | None = None
    later: LaterTurns | None = None
    later_applied: dict[str, int] | None = None


@dataclass
class HistoryInfo:
    """How the history of a request was canonicalized.

    Attributes:
        turns: the request's turns (``rules.placement.turn_spans``).
        reused_turns: leading turns taken verbatim from the transcript memory (0: none, stateless form).
        reused_messages: canonical messages taken from the memory.
    """

    turns: int = 0
    reused_turns: int = 0
    reused_messages: int = 0


@dataclass
class Canonical:
    """The canonical request and where its stable prefix ends.

    Attributes:
        messages: the canonical messages (new objects; the caller's are untouched).
        tools: the canonical tools, or None when the request had none.
        segments: contiguous segments covering the prompt (see ``rules.segments``).
        applied: rule id -> number of times the rule changed the prompt in this request.
        hoisted: every value inside a hoisted-value block, in prompt order (values carried over from an
            already canonical request included).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    segments: list[Segment]
    applied: dict[str, int] = field(default_factory=dict)
    hoisted: list[str] = field(default_factory=list)
    history: HistoryInfo = field(default_factory=HistoryInfo)

    def stable_prefix_material(self, level: SegmentLevel = SegmentLevel.HISTORY) -> bytes:
        """Canonical JSON bytes (UTF-8, sorted keys, no spaces) of the stable segments, tools and
        messages up to the end of the last leading segment of level <= ``level`` (``TOOLS_SYSTEM``;
        ``DOCUMENTS``: + documents; ``HISTORY``, the default: + history; a plain 1-3 works too). The
        gateway hashes this into the prefix key. Requests whose stable prefixes are identical give identical
        bytes."""
        return stable_material(self.messages, self.tools, self.segments, level)

    @property
    def stable_end(self) -> Position:
        """Where the stable prefix ends: the start of the volatile tail (``Position(len(messages))`` when
        the whole prompt is stable)."""
        for segment in self.segments:
            if segment.level == SegmentLevel.VOLATILE:
                return Position(segment.start_message, segment.start_part, segment.start_char)
        return Position(len(self.messages))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: messages, tools, stable_prefix_end, segments, applied, hoisted."""
        end = self.stable_end
        return {
            "messages": self.messages,
            "tools": self.tools,
            "stable_prefix_end": {"message": end.message, "part": end.part, "char": end.char},
            "segments": [s.to_dict() for s in self.segments],
            "applied": dict(sorted(self.applied.items())),
            "hoisted": list(self.hoisted),
        }


class RuleSet:
    """An ordered, validated list of rules (build it with ``rules.load_ruleset``).

    Attributes:
        rules: the rules in application order.
        sources: the files they came from, in load order.
        history_memo: the memo of earlier turns (``history_memo``); pass another rule set's to share one bound
            (a learned rule set shares its base's); None: its own.
    """

    def __init__(
        self,
        rules: list[Rule] | tuple[Rule, ...] = (),
        sources: list[str] | tuple[str, ...] = (),
        *,
        history_memo: BoundedLRU[tuple[Any, ...], Any] | None = None,
    ):
        self.rules: tuple[Rule, ...] = with_keep_rules(rules)
        self.sources: tuple[str, ...] = tuple(sources)
        self._hoists = any(r.action == "hoist" for r in self.rules)
        selectors: dict[Any, int] = {}
        self._turn_rules = tuple(
            (i, selectors.setdefault(r.selector, len(selectors)), r, _action_of(r))
            for i, r in enumerate(self.rules)
            if r.action != "sort_tools"
        )
        self._selectors = tuple(selectors)  # the distinct selectors, each evaluated once per turn
        self.text_cache = TextActionCache()
        """What each rule did to each text seen lately (the actions are pure: a repeated text is not rescanned)."""
        self.pass_cache = TextActionCache()
        """What one whole pass (every rule selecting a message, in order) did to each text seen lately: (final
        text, applications, per-rule steps), so a repeated system prompt costs one lookup per pass, not one
        per rule."""
        self._pass_ids: dict[tuple[int, ...], int] = {}
        self._plans: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, int, tuple[int, ...]], ...]] = {}
        """``_plan``'s results by the messages each selector chose (at most ``PLAN_MEMO_ENTRIES``)."""
        self._tool_rules = tuple(r for r in self.rules if r.action == "sort_tools")
        self.history_memo: BoundedLRU[tuple[Any, ...], Any] = (
            history_memo if history_memo is not None else new_history_memo()
        )
        self._memo_tag = next(RULESET_TAGS)  # this rule set's keys in a memo shared with others
        """What canonicalizing the turns of earlier requests gave: ``history_memo.first_key`` -> ``FirstTurn``;
        ``history_memo.later_key`` -> ``LaterTurns`` (for requests that do not end with an assistant reply: a
        later request of the conversation extends them)."""

    @property
    def rule_ids(self) -> list[str]:
        """Rule ids in application order."""
        return [r.id for r in self.rules]

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        return f"RuleSet({len(self.rules)} rules from {list(self.sources)})"

    def apply(
        self,
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

        A conversation resent turn after turn costs about its new turn: what the turns of an earlier request
        gave is kept (``history_memo``, keyed by a digest of the scope, the tools and the messages as sent)
        and only the turns after the longest remembered request are canonicalized; the memory's entries are
        decoded, stripped and encoded incrementally too (``TranscriptMemory.recall``, ``remember_after``).
        The result is the same as canonicalizing every turn again (tests/rules/test_incremental.py).

        Args:
            messages: OpenAI chat messages (``role``; ``content`` a string, a list of parts, or null;
                other keys are kept as they are). JSON data: a message object that occurs twice in the list
                is treated as two equal messages.
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
        tools = copy_json(tools)
        if not self.rules:
            messages = copy_json(messages)
            return Canonical(messages, tools, compute_segments(messages, tools, []))
        applied: dict[
            str, int
        ] = {}  # plain dicts in first-application order: cheaper to make than collections'
        tools = self._apply_tool_rules(tools, applied)
        tools_json = canonical_json(tools)
        raw_spans = turn_spans(messages)
        items = raw_items(messages)
        done = self._turns_incremental(messages, raw_spans, items, scope, tools_json) if items else None
        if done is None:
            done = self._turns_full(messages, raw_spans, scope)
        work, spans, carried, own, system_values = (
            done.work,
            done.spans,
            done.carried,
            done.own,
            done.system_values,
        )
        for rule_id, count in done.applied.items():
            applied[rule_id] = applied.get(rule_id, 0) + count
        present_now = [v for _, v in system_values]

        first_new = 0
        present = present_now
        history = HistoryInfo(turns=len(spans))
        keys: list[bytes] = []
        hasher: PrefixHasher | None = None
        found: tuple[int, Recalled] | None = None
        later = done.later
        if memory is not None:
            ends = [s for s, _ in spans[1:]] + [len(work)]
            if later is not None and later.hasher is not None:
                hasher = later.hasher.copy()
                keys = list(later.keys[:-1]) + hasher.keys(work, [e for e in ends if e >= hasher.count])
            else:
                hasher = PrefixHasher(scope, tools, tools_json)
                keys = hasher.keys(work, ends)
            if len(spans) > 1:
                memory.count(lookups=1)
                found = self._reuse(memory, keys[:-1], work, spans)
                if found is not None:
                    first_new, recalled = found
                    present = list(recalled.present)
                    memory.count(hits=1, reused_messages=len(recalled.messages))
                    history.reused_turns = first_new
                    history.reused_messages = len(recalled.messages)

        first = done.first
        if first is not None and items and len(spans) > 1 and work[-1].get("role") != _REPLY_ROLE:
            # the later turns of this request, for the next request of the conversation to go on from
            e0 = raw_spans[0][1]
            later_items = items[e0:]
            key_scope, key_tools = scope, tools_json
            if later is not None:  # the prefix's strings, not this request's equal copies
                key_scope, key_tools = later.scope, later.tools_json
                later_items[: len(later.sent)] = later.sent
            done_before = len(first.processed) + (len(later.processed) if later is not None else 0)
            chars = (later.chars if later is not None else 0) + sum(json_chars(m) for m in work[done_before:])
            assert done.later_applied is not None
            state = LaterTurns(
                tuple(work[len(first.processed) :]),
                tuple(spans[1:]),
                tuple(carried[1:]),
                tuple(own[1:]),
                tuple(done.later_applied.items()),
                hasher,
                tuple(keys),
                later_key(self._memo_tag, key_scope, key_tools, first.items, tuple(later_items)),
                chars,
            )
            self.history_memo.put(state.key, state)

        final = copy_json(list(found[1].messages)) if found is not None else []
        starts: list[Position] = []
        hoisted: list[str] = [v for c in found[1].blocks for v in c] if found is not None else []
        for j in range(first_new, len(spans)):
            start, end = spans[j]
            values = {loc: list(carried[j].get(loc, [])) + own[j].get(loc, []) for loc in LOCATIONS}
            if j == first_new > 0:
                # the reused history holds the system values of its time: those that changed since the
                # previous request go into this turn (a value said before and still current is not repeated)
                for placement, value in system_values:
                    if value not in present:
                        values[resolve_location(placement, work, start, end)].append(value)
            offset = len(final) - start
            final.extend(copy_json(work[start:end]))
            turn_starts, _ = insert_turn_blocks(
                final, start + offset, end + offset, {loc: v for loc, v in values.items() if v}
            )
            hoisted.extend(v for loc in LOCATIONS for v in values[loc])
            starts.extend(turn_starts)
        if memory is not None and keys:
            memory.remember_after(
                keys[-1], final, present_now or present, found[1] if found is not None else None
            )
        starts = [normalize_position(final, s) for s in starts]
        segments = compute_segments(final, tools, starts)
        return Canonical(final, tools, segments, dict(applied), hoisted, history)

    def _turns_full(
        self, messages: list[dict[str, Any]], raw_spans: list[tuple[int, int]], scope: str
    ) -> _Turns:
        """Take the blocks out of every turn of a copy of ``messages`` and run the rules on every turn."""
        work = copy_json(messages)
        carried: list[dict[str, list[str]]] = [{} for _ in raw_spans]
        spans = raw_spans
        merged = False
        if self._hoists:
            for j in range(len(raw_spans) - 1, -1, -1):
                carried[j], _ = extract_turn_blocks(work, *raw_spans[j])
            spans = turn_spans(work)
            if len(spans) != len(
                carried
            ):  # only a hand-edited request gets here: keep every value, last turn
                merged_values = {loc: [v for c in carried for v in c.get(loc, [])] for loc in LOCATIONS}
                carried = [{} for _ in spans]
                if spans:
                    carried[-1] = {loc: v for loc, v in merged_values.items() if v}
                merged = True
        systems = leading_system_count(work)
        applied: dict[str, int] = {}
        system_values: list[tuple[str, str]] = []
        firsts: dict[Any, int | None] = {}
        own = [
            self._turn(work, start, end, j, systems, applied, system_values, scope, firsts, carried)
            for j, (start, end) in enumerate(spans)
        ]
        return _Turns(work, spans, carried, own, applied, system_values, merged)

    def _turns_incremental(
        self,
        messages: list[dict[str, Any]],
        raw_spans: list[tuple[int, int]],
        items: list[Any],
        scope: str,
        tools_json: str,
    ) -> _Turns | None:
        """What ``_turns_full`` gives, from the memo: the first turn by its messages as sent, the later turns of
        the longest earlier request of the conversation by the first turn as processed and their messages as
        sent; only the turns after those are canonicalized. None (go the full way) when taking the blocks out
        changed the turns (a hand-edited request)."""
        e0 = raw_spans[0][1]
        key0 = first_key(self._memo_tag, scope, tuple(items[:e0]))
        first = self.history_memo.get(key0)
        if first is None:
            w0 = copy_json(messages[:e0])
            carried0: dict[str, list[str]] = {}
            if self._hoists:
                carried0, _ = extract_turn_blocks(w0, 0, e0)
            applied0: dict[str, int] = {}
            values0: list[tuple[str, str]] = []
            systems0 = leading_system_count(w0)
            carried_first = [carried0]
            own0 = self._turn(w0, 0, len(w0), 0, systems0, applied0, values0, scope, {}, carried_first)
            carried0 = carried_first[0]
            items0 = raw_items(w0)
            if items0 is None:
                return None
            first = FirstTurn(
                tuple(w0), carried0, own0, tuple(applied0.items()), tuple(values0), tuple(items0)
            )
            if len(raw_spans) > 1:
                # kept once the conversation has a second turn: a one-turn request (a chatbot's single question)
                # stores nothing here, and its next turn recomputes the first from the pass memo, once
                self.history_memo.put(key0, first)
        later: LaterTurns | None = None
        k = 1
        n_turns = len(raw_spans)
        if n_turns > 2:
            for j in range(n_turns - 1, 1, -1):  # the longest earlier request first
                later = self.history_memo.get(
                    later_key(
                        self._memo_tag, scope, tools_json, first.items, tuple(items[e0 : raw_spans[j][0]])
                    )
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
        if self._hoists:
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
                self._turn(work, start, end, j, systems, later_applied, system_values, scope, firsts, carried)
            )
        applied: dict[str, int] = dict(first.applied)
        for rule_id, count in later_applied.items():
            applied[rule_id] = applied.get(rule_id, 0) + count
        return _Turns(work, spans, carried, own, applied, system_values, False, first, later, later_applied)

    def _turn(
        self,
        messages: list[dict[str, Any]],
        start: int,
        end: int,
        turn: int,
        systems: int,
        applied: dict[str, int],
        system_values: list[tuple[str, str]],
        scope: str,
        firsts: dict[Any, int | None],
        carried: list[dict[str, list[str]]],
    ) -> dict[str, list[str]]:
        """``_apply_turn``, then the blocks the rules uncovered taken out (``carried[turn]`` gets their values,
        a new dict) and the rules run again, until no block is found: the turn as the next canonicalization
        of its output will see it.

        A pass recognizes blocks on the text it was given, before the rules; a rule can turn user-authored text
        into a block in a place a block is looked for (a hoisted line removed before a ``<request_context>``
        block at the end of the system prompt, whitespace normalized in front of one at the end of a user
        message). The canonical output's next pass would take that text for a block of ours, so this pass takes
        it too (``placement.extract_text_blocks``: blocks inside a message's text; rules never make or remove
        messages), and ``apply(apply(r)) == apply(r)`` holds (docs/history-stability.md, "Blocks the rules
        uncover"). Text that is no block after the rules, the whole ordinary traffic, is untouched.

        Only a turn whose text the rules changed is searched: ``extract_turn_blocks`` already searched the text as
        sent (its text locations last, after any message it removed), so a turn the rules left alone has no block
        left where nothing is put back, and the next pass leaves it alone too."""
        before = sum(applied.values()) if self._hoists else 0
        own = self._apply_turn(messages, start, end, turn, systems, applied, system_values, scope, firsts)
        if not self._hoists or sum(applied.values()) == before:
            return own
        for _ in range(MAX_PASSES):
            uncovered = extract_text_blocks(messages, start, end)
            if not uncovered:
                break
            merged = dict(carried[turn])
            for location, values in uncovered.items():
                merged[location] = [*merged.get(location, []), *values]
            carried[turn] = merged
            more = self._apply_turn(
                messages, start, end, turn, systems, applied, system_values, scope, firsts
            )
            for location, values in more.items():
                own[location] = [*own.get(location, []), *values]
        return own

    def _apply_turn(
        self,
        messages: list[dict[str, Any]],
        start: int,
        end: int,
        turn: int,
        systems: int,
        applied: dict[str, int],
        system_values: list[tuple[str, str]],
        scope: str = "",
        firsts: dict[Any, int | None] | None = None,
    ) -> dict[str, list[str]]:
        """Run the span and normalize rules to a fixed point on the turn ``messages[start:end]`` (in place),
        selecting messages as in the request ``messages[:end]``. Values hoisted from the leading system
        messages are appended to ``system_values`` (with their placement) and, in the first turn, also
        returned; the others are returned by the location they take in this turn. Reads only the turn (and,
        for a ``first`` selector, the messages up to its first match: ``firsts`` keeps those per request)."""
        # rules change texts, never roles or the message count: each selector picks the same messages all along,
        # and the placements' locations (which read roles only) are the same before and after the passes
        locations: dict[str, str] | None = None
        values: dict[str, list[str]] = {}
        if firsts is None:
            firsts = {}
        chosen = tuple(
            _select_in_turn(selector, messages, start, end, firsts) for selector in self._selectors
        )
        plans = self._plans.get(chosen)
        if plans is None:
            plans = self._plan(chosen)
        for _ in range(MAX_PASSES):
            steps: list[tuple[int, int, int, int, tuple[str, ...]]] = []  # (slot, message, part, n, hoisted)
            for index, pass_id, slots in plans:
                message = messages[index]
                for part in text_parts(message):
                    text = get_text(message, part)
                    new_text, n, done = self.pass_cache.get(
                        pass_id, text, lambda t, slots=slots: self._run_pass(slots, t, scope), scope
                    )
                    if n:
                        set_text(message, part, new_text)
                        steps.extend((slot, index, part, count, hoisted) for slot, count, hoisted in done)
            if not steps:
                break
            steps.sort(key=lambda step: step[:3])  # what the rule-major loop over messages and parts gives
            for slot, index, _, count, hoisted in steps:
                rule = self._turn_rules[slot][2]
                applied[rule.id] = applied.get(rule.id, 0) + count
                for value in hoisted:
                    if index < systems:
                        system_values.append((rule.placement, value))
                    if index >= systems or turn == 0:
                        if locations is None:
                            locations = {p: resolve_location(p, messages, start, end) for p in PLACEMENTS}
                        values.setdefault(locations[rule.placement], []).append(value)
        return values

    def _plan(self, chosen: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """(message index, pass id, rule slots) for each message some rule selects, in message order, given the
        messages each distinct selector chose (``chosen``, in ``self._selectors`` order); kept in ``_plans``
        (a pure function of ``chosen``: a chatbot's turns all choose alike).

        A rule only touches the messages it selects, so a message's texts go through its own rules in rule
        order whatever the other messages do: one memoized pass per text, replayed in rule-major order."""
        slots_of: dict[int, list[int]] = {}
        for slot, (_, selector, _, _) in enumerate(self._turn_rules):
            for index in chosen[selector]:
                slots_of.setdefault(index, []).append(slot)
        plans = tuple(
            (index, self._pass_id(tuple(slots)), tuple(slots)) for index, slots in sorted(slots_of.items())
        )
        if len(self._plans) >= PLAN_MEMO_ENTRIES:
            self._plans.clear()
        self._plans[chosen] = plans
        return plans

    def _pass_id(self, slots: tuple[int, ...]) -> int:
        """A small number naming one sequence of rule slots (the pass memo's index)."""
        found = self._pass_ids.get(slots)
        if found is None:
            found = self._pass_ids.setdefault(slots, len(self._pass_ids))
        return found

    def _run_pass(self, slots: tuple[int, ...], text: str, scope: str) -> TextResult:
        """One pass of the rules in ``slots`` (``self._turn_rules`` places, in order) over ``text``: (final
        text, applications, ((slot, applications, hoisted values), ...) for each rule that applied)."""
        done: list[tuple[int, int, tuple[str, ...]]] = []
        total = 0
        for slot in slots:
            position, _, _, action = self._turn_rules[slot]
            new_text, n, hoisted = self.text_cache.get(position, text, action, scope)
            if n:
                done.append((slot, n, hoisted))
                total += n
                text = new_text
        return text, total, tuple(done)

    def _apply_tool_rules(
        self, tools: list[dict[str, Any]] | None, applied: dict[str, int]
    ) -> list[dict[str, Any]] | None:
        for rule in self._tool_rules:
            if tools:
                sorted_tools = sort_tools(tools)
                if _differs(sorted_tools, tools):
                    applied[rule.id] = applied.get(rule.id, 0) + 1
                    tools = sorted_tools
        return tools

    @staticmethod
    def _reuse(
        memory: TranscriptMemory,
        keys: list[bytes],
        messages: list[dict[str, Any]],
        spans: list[tuple[int, int]],
    ) -> tuple[int, Recalled] | None:
        """(index of the first turn not covered, recalled entry) for the longest earlier request in the memory
        whose blocks taken out give exactly ``messages`` up to that turn; None when there is none."""
        for back, recalled in memory.recall(keys[::-1]):
            turn = len(keys) - back
            if recalled.stripped == messages[: spans[turn][0]]:
                return turn, recalled
            memory.count(rejected=1)
        return None


def _action_of(rule: Rule) -> Callable[[str], TextResult]:
    """``text -> (new text, applications, hoisted values)`` of a span or normalize rule (pure)."""
    if rule.action == "normalize":

        def normalize(text: str) -> tuple[str, int, tuple[str, ...]]:
            new_text = normalize_text(text, rule.normalize)
            return (new_text, 1, ()) if new_text != text else (text, 0, ())

        return normalize

    def span(text: str) -> tuple[str, int, tuple[str, ...]]:
        new_text, n, values = apply_span_action(rule, text)
        return new_text, n, tuple(values)

    return span


def _select_in_turn(
    selector: MessageSelector,
    messages: list[dict[str, Any]],
    start: int,
    end: int,
    firsts: dict[Any, int | None],
) -> tuple[int, ...]:
    """``tuple(i for i in selector.select(messages[:end]) if i >= start)``, reading only the turn (and, for a
    ``first`` selector, the messages up to its first match, found once per request in ``firsts``)."""
    roles = selector.roles
    if selector.index is not None:
        i = selector.index if selector.index >= 0 else end + selector.index
        ok = 0 <= i < end and i >= start and (roles is None or messages[i].get("role") in roles)
        return (i,) if ok else ()
    if selector.position == "first":
        if selector not in firsts:
            firsts[selector] = next(
                (i for i, m in enumerate(messages) if roles is None or m.get("role") in roles), None
            )
        first = firsts[selector]
        return (first,) if first is not None and start <= first < end else ()
    if roles is None:
        indices: tuple[int, ...] = tuple(range(start, end))
    else:
        indices = tuple(i for i in range(start, end) if messages[i].get("role") in roles)
    if selector.position == "last":
        return indices[-1:]
    return indices


def _differs(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` differ in value or in the order of any object's keys (key order is what
    sort_tools changes, and ``==`` on dicts ignores it)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) != list(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is not type(b) or a != b
