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
  point (at most ``turn_rules.MAX_PASSES`` passes), so text a rule's action creates or uncovers is already handled; a
  block the rules uncover (user text that is a block after them) is taken out too (``TurnRules.run``), so a
  block is recognized the same before and after a pass.
  A user rule that never reaches a fixed point (e.g. replace ``a`` with ``aa``) is cut off after
  ``MAX_PASSES`` passes; the result is still deterministic but not idempotent.
- incremental: what the turns of an earlier request of the conversation gave is taken from ``history_memo``
  (keys hold the messages as sent, compared in full) and only the new turns are canonicalized
  (``history_turns``); the result is
  the same as canonicalizing every turn (tests/rules/test_incremental.py, against the previous algorithm).
  Nothing a memo holds is handed out or changed.
- preserving: every hoisted value is in the final messages (inside a block); text is removed only by
  ``drop``, by ``replace`` and ``reorder`` (matched text their template does not use), and by ``round``
  and ``normalize`` (digits and whitespace they rewrite).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rules.actions import canonical_json, sort_tools
from rules.bounded_lru import BoundedLRU
from rules.cache_markers import restore_markers, take_markers
from rules.history_memo import RULESET_TAGS, LaterTurns, json_chars, later_key, new_history_memo, raw_items
from rules.history_turns import turns_full, turns_incremental
from rules.messages import check_shape, copy_json
from rules.model import Rule, with_keep_rules
from rules.placement import LOCATIONS, insert_turn_blocks, resolve_location, turn_spans
from rules.segments import (
    Position,
    Segment,
    SegmentLevel,
    compute_segments,
    normalize_position,
    stable_material,
)
from rules.transcript import (
    PrefixHasher,
    Recalled,
    TranscriptEntry,
    TranscriptMemory,
    conversation_scope,
    same_forms,
)
from rules.turn_rules import MAX_PASSES, TurnRules

__all__ = ["MAX_PASSES", "Canonical", "HistoryInfo", "RuleSet"]

_REPLY_ROLE = "assistant"


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
        turn_segments: the segments of the prompt's turns, where only the newest turn's hoisted-value blocks
            start the volatile tail: a block in an earlier turn is part of that turn (``history``), whatever
            values it holds. None when that is ``segments`` (no earlier turn got a block in this request).
            ``segments`` start the tail at the first block, since an earlier turn's block holds this request's
            values when the transcript memory held no earlier request of the conversation (a new system
            prompt, a stateless canonicalization), so the prefix key never hashes them; the miss explanation
            takes ``turn_segments``: what the cache could have served is the whole history, and a change that
            cost it (a new system prompt, a new value in that block) is its miss.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    segments: list[Segment]
    applied: dict[str, int] = field(default_factory=dict)
    hoisted: list[str] = field(default_factory=list)
    history: HistoryInfo = field(default_factory=HistoryInfo)
    turn_segments: list[Segment] | None = None

    @property
    def turn_stable_end(self) -> Position:
        """Where the stable prefix of the prompt's turns ends (``stable_end`` of ``turn_segments``): the start of
        the newest turn's volatile tail."""
        return _tail_start(
            self.turn_segments if self.turn_segments is not None else self.segments, self.messages
        )

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
        return _tail_start(self.segments, self.messages)

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
        self.turns = TurnRules(self.rules)
        """The span and normalize rules compiled for running turn by turn, with their memos."""
        self.text_cache = self.turns.text_cache
        self.pass_cache = self.turns.pass_cache
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
        and the system values that changed since that request go into a block in the first new turn, with the
        changed values of the reused turns' own messages (a later system message's time).

        A conversation resent turn after turn costs about its new turn: what the turns of an earlier request
        gave is kept (``history_memo``, keyed by a digest of the scope, the tools and the messages as sent)
        and only the turns after the longest remembered request are canonicalized; the memory's entries are
        decoded, stripped and encoded incrementally too (``TranscriptMemory.recall``, ``remember_after``).
        The result is the same as canonicalizing every turn again (tests/rules/test_incremental.py).

        Client cache markers (``cache_control`` on a part or a message) are taken off first and put back on the
        same parts after (``rules.cache_markers``): where a client puts its breakpoint never changes the
        canonical bytes, the memory's keys or what it reuses.

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
        if self.rules:
            # the rules never see a client's cache markers (``rules.cache_markers``): where a marker sits must not
            # change the canonical bytes, nor the memory's keys
            bare, markers = take_markers(messages)
            if markers:
                canonical = self._canonicalize(bare, tools, memory, scope)
                if restore_markers(bare, canonical.messages, markers):
                    return canonical
        return self._canonicalize(messages, tools, memory, scope)

    def _canonicalize(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        memory: TranscriptMemory | None,
        scope: str,
    ) -> Canonical:
        """``apply`` on messages whose shape was checked."""
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
        done = None
        if items:
            done = turns_incremental(
                self.turns, self.history_memo, self._memo_tag, messages, raw_spans, items, scope, tools_json
            )
        if done is None:
            done = turns_full(self.turns, messages, raw_spans, scope)
        work, spans, carried, own, system_values = (
            done.work,
            done.spans,
            done.carried,
            done.own,
            done.system_values,
        )
        for rule_id, count in done.applied.items():
            applied[rule_id] = applied.get(rule_id, 0) + count
        present_now = [v for _, v, _ in system_values]
        # the memory's keys (and the later turns' memo) name the values that tell whose conversation it is
        memory_scope = done.memory_scope
        if memory_scope is None:  # not computed for the later turns' memo (fewer than three turns, full path)
            memory_scope = conversation_scope(scope, system_values)

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
                hasher = PrefixHasher(memory_scope, tools, tools_json)
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
            key_scope, key_tools = memory_scope, tools_json
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
        newest: list[Position] = []  # the blocks of the request's newest turn
        hoisted: list[str] = [v for c in found[1].blocks for v in c] if found is not None else []
        newest_start = 0  # where the newest turn begins in ``final``
        for j in range(first_new, len(spans)):
            start, end = spans[j]
            values = {loc: list(carried[j].get(loc, [])) + own[j].get(loc, []) for loc in LOCATIONS}
            if j == first_new and found is not None:
                # the reused history holds the system values of its time: those that changed since the
                # previous request go into this turn (a value said before and still current is not repeated)
                for placement, value, _ in system_values:
                    if value not in present:
                        values[resolve_location(placement, work, start, end)].append(value)
                # ... and so do the values of a later turn's own messages (a system message mid-conversation
                # whose time changed): reused verbatim, the history holds their old values, which the model
                # would otherwise go on reading as current
                said = {v for block in found[1].blocks for v in block} | set(present)
                for k in range(1, first_new):
                    for value in (v for loc in LOCATIONS for v in own[k].get(loc, [])):
                        if value not in said:
                            said.add(value)
                            values[resolve_location("tail_end", work, start, end)].append(value)
            offset = len(final) - start
            final.extend(copy_json(work[start:end]))
            turn_starts, _ = insert_turn_blocks(
                final, start + offset, end + offset, {loc: v for loc, v in values.items() if v}
            )
            hoisted.extend(v for loc in LOCATIONS for v in values[loc])
            starts.extend(turn_starts)
            if j == len(spans) - 1:
                newest = turn_starts
                newest_start = start + offset
        if memory is not None and keys:
            memory.remember_after(
                keys[-1], final, present_now or present, found[1] if found is not None else None
            )
            if found is None and len(keys) > 1:
                # history the memory never saw (a few-shot prompt's examples, a conversation that reached a
                # restarted gateway): its earlier turns as canonicalized now are what the next request with the
                # same history and a new last turn goes on from, instead of putting its own values into the first
                # turn's block and missing from there on
                memory.remember(keys[-2], TranscriptEntry(final[:newest_start], present_now or present))
        starts = [normalize_position(final, s) for s in starts]
        segments = compute_segments(final, tools, starts)
        turn_segments = None
        if len(newest) < len(starts):  # an earlier turn holds a block: it is history there
            turn_segments = compute_segments(final, tools, [normalize_position(final, s) for s in newest])
        return Canonical(final, tools, segments, dict(applied), hoisted, history, turn_segments)

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
            if same_forms(recalled.stripped, messages[: spans[turn][0]]):  # a part or a string alike
                return turn, recalled
            memory.count(rejected=1)
        return None


def _tail_start(segments: list[Segment], messages: list[dict[str, Any]]) -> Position:
    """The start of the volatile segment of ``segments`` (``Position(len(messages))`` when there is none)."""
    for segment in segments:
        if segment.level == SegmentLevel.VOLATILE:
            return Position(segment.start_message, segment.start_part, segment.start_char)
    return Position(len(messages))


def _differs(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` differ in value or in the order of any object's keys (key order is what
    sort_tools changes, and ``==`` on dicts ignores it)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) != list(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is not type(b) or a != b
