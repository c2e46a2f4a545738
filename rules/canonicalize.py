"""``RuleSet.apply``: a chat request in, its canonical form and segments out.

Invariants:

- pure and deterministic: the inputs are never mutated and the same input gives byte-identical output
  (rules run in load order; matches left to right; hoisted values keep that order).
- idempotent: ``apply(apply(r)) == apply(r)``. Hoisted-value blocks from an earlier run are taken out
  first (``placement.extract_blocks``) and put back with the new values; the rules then run to a fixed
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
from dataclasses import dataclass, field
from typing import Any

from rules.actions import apply_span_action, normalize_text, sort_tools
from rules.messages import check_shape, get_text, set_text, text_parts
from rules.model import Rule, with_keep_rules
from rules.placement import LOCATIONS, extract_blocks, insert_blocks, resolve_location, strip_tail_newlines
from rules.segments import Position, Segment, compute_segments, normalize_position, stable_material

MAX_PASSES = 8
"""Upper bound on rule passes per request (a pass that changes nothing ends the loop)."""


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

    def stable_prefix_material(self, level: int = 3) -> bytes:
        """Canonical JSON bytes (UTF-8, sorted keys, no spaces) of the stable segments, tools and
        messages up to the end of the last leading segment of level <= ``level`` (1: tools+system;
        2: + documents; 3, the default: + history). The gateway hashes this into the prefix key. Requests
        whose stable prefixes are identical give identical bytes."""
        return stable_material(self.messages, self.tools, self.segments, level)

    @property
    def stable_end(self) -> Position:
        """Where the stable prefix ends: the start of the volatile tail (``Position(len(messages))`` when
        the whole prompt is stable)."""
        for segment in self.segments:
            if segment.level == 4:
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

    @property
    def rule_ids(self) -> list[str]:
        """Rule ids in application order."""
        return [r.id for r in self.rules]

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        return f"RuleSet({len(self.rules)} rules from {list(self.sources)})"

    def apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Canonical:
        """Canonicalize one chat request.

        Args:
            messages: OpenAI chat messages (``role``; ``content`` a string, a list of parts, or null;
                other keys are kept as they are).
            tools: OpenAI (or Anthropic) tool schemas, or None.

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
        carried = extract_blocks(messages) if self._hoists else {}
        locations = {p: resolve_location(p, messages) for p in ("last_user_prefix", "before_last_user",
                                                                 "system_end")}
        new_values: dict[str, list[str]] = {}
        applied: Counter[str] = Counter()
        for _ in range(MAX_PASSES):
            changed = False
            for rule in self.rules:
                count, tools = self._apply_rule(rule, messages, tools, locations, new_values)
                if count:
                    applied[rule.id] += count
                    changed = True
            if (carried.get("user_prefix") or new_values.get("user_prefix")) and strip_tail_newlines(messages):
                changed = True
            if not changed:
                break
        blocks = {loc: carried.get(loc, []) + new_values.get(loc, []) for loc in LOCATIONS}
        starts = insert_blocks(messages, {loc: v for loc, v in blocks.items() if v})
        starts = [normalize_position(messages, s) for s in starts]
        hoisted = [v for loc in LOCATIONS for v in blocks[loc]]
        segments = compute_segments(messages, tools, starts)
        return Canonical(messages, tools, segments, dict(applied), hoisted)

    @staticmethod
    def _apply_rule(rule: Rule, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    locations: dict[str, str], new_values: dict[str, list[str]]
                    ) -> tuple[int, list[dict[str, Any]] | None]:
        """Apply one rule to every selected text (in place); return (applications, tools)."""
        if rule.action == "sort_tools":
            if not tools:
                return 0, tools
            sorted_tools = sort_tools(tools)
            if _differs(sorted_tools, tools):
                return 1, sorted_tools
            return 0, tools
        count = 0
        for index in rule.selector.select(messages):
            message = messages[index]
            for part in text_parts(message):
                text = get_text(message, part)
                if rule.action == "normalize":
                    new_text = normalize_text(text, rule.normalize)
                    if new_text != text:
                        count += 1
                        set_text(message, part, new_text)
                    continue
                new_text, n, values = apply_span_action(rule, text)
                if n:
                    count += n
                    set_text(message, part, new_text)
                    if values:
                        new_values.setdefault(locations[rule.placement], []).extend(values)
        return count, tools


def _differs(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` differ in value or in the order of any object's keys (key order is what
    sort_tools changes, and ``==`` on dicts ignores it)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) != list(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is not type(b) or a != b
