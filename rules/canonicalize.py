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
  point (at most ``MAX_PASSES`` passes), so text a rule's action creates or uncovers is already handled.
  A user rule that never reaches a fixed point (e.g. replace ``a`` with ``aa``) is cut off after
  ``MAX_PASSES`` passes; the result is still deterministic but not idempotent.
- preserving: every hoisted value is in the final messages (inside a block); text is removed only by
  ``drop``, by ``replace`` and ``reorder`` (matched text their template does not use), and by ``round``
  and ``normalize`` (digits and whitespace they rewrite).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rules.actions import apply_span_action, normalize_text, sort_tools
from rules.messages import check_shape, get_text, leading_system_count, set_text, text_parts
from rules.model import PLACEMENTS, Rule, with_keep_rules
from rules.placement import (
    LOCATIONS,
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
from rules.transcript import PrefixHasher, TranscriptEntry, TranscriptMemory

MAX_PASSES = 8
"""Upper bound on rule passes per request (a pass that changes nothing ends the loop)."""


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
    """

    def __init__(self, rules: list[Rule] | tuple[Rule, ...] = (), sources: list[str] | tuple[str, ...] = ()):
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
        if not self.rules:
            return Canonical(messages, tools, compute_segments(messages, tools, []))
        applied: Counter[str] = Counter()
        tools = self._apply_tool_rules(tools, applied)
        spans = turn_spans(messages)
        carried: list[dict[str, list[str]]] = [{} for _ in spans]
        if self._hoists:
            for j in range(len(spans) - 1, -1, -1):
                carried[j], _ = extract_turn_blocks(messages, *spans[j])
            spans = turn_spans(messages)
            if len(spans) != len(
                carried
            ):  # only a hand-edited request gets here: keep every value, last turn
                merged = {loc: [v for c in carried for v in c.get(loc, [])] for loc in LOCATIONS}
                carried = [{} for _ in spans]
                if spans:
                    carried[-1] = {loc: v for loc, v in merged.items() if v}
        systems = leading_system_count(messages)
        own: list[dict[str, list[str]]] = []
        system_values: list[tuple[str, str]] = []
        for j, (start, end) in enumerate(spans):
            own.append(self._apply_turn(messages, start, end, j, systems, applied, system_values, scope))
        present_now = [v for _, v in system_values]

        reused: list[dict[str, Any]] = []
        first_new = 0
        present = present_now
        history = HistoryInfo(turns=len(spans))
        keys: list[bytes] = []
        if memory is not None:
            hasher = PrefixHasher(scope, tools)
            keys = hasher.keys(messages, [s for s, _ in spans[1:]] + [len(messages)])
            if len(spans) > 1:
                memory.count(lookups=1)
                found = self._reuse(memory, keys[:-1], messages, spans)
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
        for j in range(first_new, len(spans)):
            start, end = spans[j]
            values = {loc: list(carried[j].get(loc, [])) + own[j].get(loc, []) for loc in LOCATIONS}
            if j == first_new > 0:
                # the reused history holds the system values of its time: those that changed since the
                # previous request go into this turn (a value said before and still current is not repeated)
                for placement, value in system_values:
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
        if memory is not None and keys:
            memory.remember(keys[-1], TranscriptEntry(final, present_now or present))
        starts = [normalize_position(final, s) for s in starts]
        segments = compute_segments(final, tools, starts)
        return Canonical(final, tools, segments, dict(applied), hoisted, history)

    def _apply_turn(
        self,
        messages: list[dict[str, Any]],
        start: int,
        end: int,
        turn: int,
        systems: int,
        applied: Counter[str],
        system_values: list[tuple[str, str]],
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
        chosen = [[i for i in selector.select(view) if i >= start] for selector in self._selectors]
        # a rule only touches the messages it selects, so a message's texts go through its own rules in rule
        # order whatever the other messages do: one memoized pass per text, replayed below in rule-major order
        slots_of: dict[int, list[int]] = {}
        for slot, (_, selector, _, _) in enumerate(self._turn_rules):
            for index in chosen[selector]:
                slots_of.setdefault(index, []).append(slot)
        plans = [
            (index, self._pass_id(tuple(slots)), tuple(slots)) for index, slots in sorted(slots_of.items())
        ]
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
                applied[rule.id] += count
                for value in hoisted:
                    if index < systems:
                        system_values.append((rule.placement, value))
                    if index >= systems or turn == 0:
                        values.setdefault(locations[rule.placement], []).append(value)
        return values

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
        self, tools: list[dict[str, Any]] | None, applied: Counter[str]
    ) -> list[dict[str, Any]] | None:
        for rule in self.rules:
            if rule.action == "sort_tools" and tools:
                sorted_tools = sort_tools(tools)
                if _differs(sorted_tools, tools):
                    applied[rule.id] += 1
                    tools = sorted_tools
        return tools

    @staticmethod
    def _reuse(
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


def _blocks_of(messages: list[dict[str, Any]]) -> list[list[str]]:
    """The values of every block in ``messages`` (canonical messages), in prompt order."""
    copied = copy.deepcopy(messages)
    per_turn: list[list[list[str]]] = []
    for start, end in reversed(turn_spans(copied)):  # last turn first: a removed note shifts later turns only
        found, _ = extract_turn_blocks(copied, start, end)
        per_turn.append([found[loc] for loc in LOCATIONS if found.get(loc)])
    return [values for turn in reversed(per_turn) for values in turn]


def _differs(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` differ in value or in the order of any object's keys (key order is what
    sort_tools changes, and ``==`` on dicts ignores it)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) != list(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is not type(b) or a != b
