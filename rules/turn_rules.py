"""Running the span and normalize rules on one turn of a request (``TurnRules``), for ``RuleSet.apply``.

A turn's messages are selected as in the request that ended with that turn; each message some rule selects
goes through its rules in rule order, one memoized pass per text (``pass_cache``; each rule's action memoized
in ``text_cache``), replayed in rule-major order, to a fixed point (at most ``MAX_PASSES`` passes); blocks the
rules uncover are taken out and the rules run again (``TurnRules.run``). The plan of which rules run on which
message is a pure function of the messages each selector chose (``_plans``, at most ``PLAN_MEMO_ENTRIES``).

Invariants: rules change texts, never roles or the message count; only the turn's messages are changed (in
place) and read, with, for a ``first`` selector, the messages up to its first match; the memos hold what pure
actions gave, so the result is the same with them cold or warm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rules.actions import apply_span_action, normalize_text
from rules.messages import get_text, set_text, text_parts
from rules.model import PLACEMENTS, PRIVATE, MessageSelector, Rule
from rules.placement import extract_text_blocks, resolve_location
from rules.text_cache import Result as TextResult
from rules.text_cache import TextActionCache

MAX_PASSES = 8
"""Upper bound on rule passes per request (a pass that changes nothing ends the loop)."""

PLAN_MEMO_ENTRIES = 1_024
"""Most selections a ``TurnRules`` keeps the pass plan of (``TurnRules._plan``; cleared when full)."""


class TurnRules:
    """The span and normalize rules of a rule set, compiled for running turn by turn, with their memos.

    Args:
        rules: the rule set's rules in application order (``sort_tools`` rules are skipped: they act on tools).

    Attributes:
        hoists: whether any rule hoists (blocks are taken out and put back only then).
        slots: per turn rule, (index among all rules, selector number, rule, pure action).
        selectors: the distinct selectors, each evaluated once per turn.
        text_cache: what each rule did to each text seen lately (the actions are pure: a repeated text is not
            rescanned).
        pass_cache: what one whole pass (every rule selecting a message, in order) did to each text seen
            lately: (final text, applications, per-rule steps), so a repeated system prompt costs one lookup
            per pass, not one per rule.
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.hoists = any(r.action == "hoist" for r in rules)
        selectors: dict[Any, int] = {}
        self.slots = tuple(
            (i, selectors.setdefault(r.selector, len(selectors)), r, _action_of(r))
            for i, r in enumerate(rules)
            if r.action != "sort_tools"
        )
        self.selectors = tuple(selectors)
        self.text_cache = TextActionCache()
        self.pass_cache = TextActionCache()
        self._pass_ids: dict[tuple[int, ...], int] = {}
        self._plans: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, int, tuple[int, ...]], ...]] = {}

    def run(
        self,
        messages: list[dict[str, Any]],
        start: int,
        end: int,
        turn: int,
        systems: int,
        applied: dict[str, int],
        system_values: list[tuple[str, str, bool]],
        scope: str,
        firsts: dict[Any, int | None],
        carried: list[dict[str, list[str]]],
    ) -> dict[str, list[str]]:
        """``apply_turn``, then the blocks the rules uncovered taken out (``carried[turn]`` gets their values,
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
        before = sum(applied.values()) if self.hoists else 0
        own = self.apply_turn(messages, start, end, turn, systems, applied, system_values, scope, firsts)
        if not self.hoists or sum(applied.values()) == before:
            return own
        for _ in range(MAX_PASSES):
            uncovered = extract_text_blocks(messages, start, end)
            if not uncovered:
                break
            merged = dict(carried[turn])
            for location, values in uncovered.items():
                merged[location] = [*merged.get(location, []), *values]
            carried[turn] = merged
            more = self.apply_turn(messages, start, end, turn, systems, applied, system_values, scope, firsts)
            for location, values in more.items():
                own[location] = [*own.get(location, []), *values]
        return own

    def apply_turn(
        self,
        messages: list[dict[str, Any]],
        start: int,
        end: int,
        turn: int,
        systems: int,
        applied: dict[str, int],
        system_values: list[tuple[str, str, bool]],
        scope: str = "",
        firsts: dict[Any, int | None] | None = None,
    ) -> dict[str, list[str]]:
        """Run the span and normalize rules to a fixed point on the turn ``messages[start:end]`` (in place),
        selecting messages as in the request ``messages[:end]``. Values hoisted from the leading system
        messages are appended to ``system_values`` (with their placement and whether they are per request)
        and, in the first turn, also returned; the others are returned by the location they take in this turn.
        Reads only the turn (and, for a ``first`` selector, the messages up to its first match: ``firsts``
        keeps those per request)."""
        # rules change texts, never roles or the message count: each selector picks the same messages all along,
        # and the placements' locations (which read roles only) are the same before and after the passes
        locations: dict[str, str] | None = None
        values: dict[str, list[str]] = {}
        if firsts is None:
            firsts = {}
        chosen = tuple(_select_in_turn(selector, messages, start, end, firsts) for selector in self.selectors)
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
                        pass_id, text, lambda t, slots=slots: self.run_pass(slots, t, scope), scope
                    )
                    if n:
                        set_text(message, part, new_text)
                        steps.extend((slot, index, part, count, hoisted) for slot, count, hoisted in done)
            if not steps:
                break
            steps.sort(key=lambda step: step[:3])  # what the rule-major loop over messages and parts gives
            for slot, index, _, count, hoisted in steps:
                rule = self.slots[slot][2]
                applied[rule.id] = applied.get(rule.id, 0) + count
                for value in hoisted:
                    if index < systems:
                        per_request = rule.value_per_request(value)
                        kind = PRIVATE if per_request and rule.private else per_request
                        system_values.append((rule.placement, value, kind))
                    if index >= systems or turn == 0:
                        if locations is None:
                            locations = {p: resolve_location(p, messages, start, end) for p in PLACEMENTS}
                        values.setdefault(locations[rule.placement], []).append(value)
        return values

    def _plan(self, chosen: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """(message index, pass id, rule slots) for each message some rule selects, in message order, given the
        messages each distinct selector chose (``chosen``, in ``self.selectors`` order); kept in ``_plans``
        (a pure function of ``chosen``: a chatbot's turns all choose alike).

        A rule only touches the messages it selects, so a message's texts go through its own rules in rule
        order whatever the other messages do: one memoized pass per text, replayed in rule-major order."""
        slots_of: dict[int, list[int]] = {}
        for slot, (_, selector, _, _) in enumerate(self.slots):
            for index in chosen[selector]:
                slots_of.setdefault(index, []).append(slot)
        plans = tuple(
            (index, self.pass_id(tuple(slots)), tuple(slots)) for index, slots in sorted(slots_of.items())
        )
        if len(self._plans) >= PLAN_MEMO_ENTRIES:
            self._plans.clear()
        self._plans[chosen] = plans
        return plans

    def pass_id(self, slots: tuple[int, ...]) -> int:
        """A small number naming one sequence of rule slots (the pass memo's index)."""
        found = self._pass_ids.get(slots)
        if found is None:
            found = self._pass_ids.setdefault(slots, len(self._pass_ids))
        return found

    def run_pass(self, slots: tuple[int, ...], text: str, scope: str) -> TextResult:
        """One pass of the rules in ``slots`` (``self.slots`` places, in order) over ``text``: (final
        text, applications, ((slot, applications, hoisted values), ...) for each rule that applied)."""
        done: list[tuple[int, int, tuple[str, ...]]] = []
        total = 0
        for slot in slots:
            position, _, _, action = self.slots[slot]
            new_text, n, hoisted = self.text_cache.get(position, text, action, scope)
            if n:
                done.append((slot, n, hoisted))
                total += n
                text = new_text
        return text, total, tuple(done)


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
