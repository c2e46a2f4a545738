"""Automatic Anthropic cache breakpoints at the canonical segment boundaries (``add_breakpoints``).

Invariants: at most ``MAX_BREAKPOINTS`` per request, the client's own included and never moved or changed;
none below the model's minimum cacheable length (``min_cacheable_tokens``, counted as a lower bound); none on
a block that cannot carry ``cache_control``; no 1-hour entry after a 5-minute one; lookback breakpoints keep
entries more than ``LOOKBACK_BLOCKS`` blocks back reachable. The provider's rules and the placement order are
in docs/protocols.md. Reference: https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.core.tokens import TokenCounter, default_counter
from gateway.protocols.anthropic.boundaries import Boundary
from gateway.protocols.anthropic.prompt import BlockPath

MAX_BREAKPOINTS = 4
LOOKBACK_BLOCKS = 20

MIN_CACHEABLE_TOKENS: tuple[tuple[str, int], ...] = (
    ("claude-opus-4-5", 4096),
    ("claude-opus-4-6", 4096),
    ("claude-haiku-4-5", 4096),
    ("claude-sonnet-4-6", 2048),
    ("claude-3-5-haiku", 2048),
    ("claude-3-haiku", 2048),
    ("claude-haiku-3", 2048),
    ("claude", 1024),
)
"""Minimum cacheable prompt length in tokens by model-name prefix (longest matching prefix wins), from
Anthropic's prompt-caching documentation; 1024 for any other model."""

DEFAULT_MIN_TOKENS = 1024

UNCACHEABLE_BLOCKS = frozenset({"thinking", "redacted_thinking"})

BOUNDARY_PRIORITY = ("history", "system", "documents", "tools")
"""Which automatic breakpoints win when slots run out (first = most valuable)."""


def min_cacheable_tokens(model: str, overrides: Mapping[str, int] | None = None) -> int:
    """The minimum cacheable prefix of ``model`` in tokens: longest matching name prefix in ``overrides``,
    then in ``MIN_CACHEABLE_TOKENS``, else ``DEFAULT_MIN_TOKENS``."""
    for table in (overrides or {}).items(), MIN_CACHEABLE_TOKENS:
        matches = [(len(prefix), tokens) for prefix, tokens in table if model.startswith(prefix)]
        if matches:
            return max(matches)[1]
    return DEFAULT_MIN_TOKENS


def _block_text(block: Any) -> str:
    """The text of a block that the model reads as tokens (a lower bound: images count as nothing, and so do
    thinking blocks, which the provider drops from earlier turns)."""
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return str(block.get("name", "")) + json.dumps(block.get("input", {}), ensure_ascii=False)
    if kind == "tool_result":
        content = block.get("content", "")
        if isinstance(content, str):
            return content
        return "".join(_block_text(inner) for inner in content if isinstance(inner, dict))
    if kind == "document":
        source = block.get("source") or {}
        return str(source.get("data", "")) if source.get("type") == "text" else ""
    return ""


def _tool_text(tool: Mapping[str, Any]) -> str:
    return json.dumps(
        {k: v for k, v in tool.items() if k != "cache_control"}, ensure_ascii=False, sort_keys=True
    )


# ---- the flat block list -----------------------------------------------------------------------------------


@dataclass
class _Slot:
    path: BlockPath
    block: Any
    tokens: int
    group: tuple[Any, ...]  # blocks of one message / the system / one tool share a group


def _flatten(body: Mapping[str, Any], counter: TokenCounter) -> list[_Slot]:
    slots: list[_Slot] = []
    for i, tool in enumerate(body.get("tools") or []):
        slots.append(_Slot(("tools", i), tool, counter.count(_tool_text(tool)), ("tools", i)))
    system = body.get("system")
    if isinstance(system, str) and system:
        slots.append(_Slot(("system", 0), system, counter.count(system), ("system",)))
    elif isinstance(system, list):
        for j, block in enumerate(system):
            slots.append(_Slot(("system", j), block, counter.count(_block_text(block)), ("system",)))
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content")
        if isinstance(content, str):
            slots.append(_Slot(("messages", i, 0), content, counter.count(content), ("messages", i)))
        elif isinstance(content, list):
            for j, block in enumerate(content):
                slots.append(
                    _Slot(("messages", i, j), block, counter.count(_block_text(block)), ("messages", i))
                )
    return slots


def _has_breakpoint(block: Any) -> bool:
    return isinstance(block, dict) and "cache_control" in block


def _cacheable(block: Any) -> bool:
    if isinstance(block, str):
        return bool(block)
    if not isinstance(block, dict) or block.get("type") in UNCACHEABLE_BLOCKS:
        return False
    return not (block.get("type") == "text" and not block.get("text"))


# ---- planning ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breakpoint:
    """One breakpoint of the final request.

    Attributes:
        kind: ``"client"``, a boundary (``"history"``, ``"system"``, ``"documents"``, ``"tools"``) or
            ``"lookback"``.
        path: the block it was placed on, as a path into the body *given* to ``add_breakpoints`` (None for the
            client's top-level ``cache_control``).
        position: index in the flat block list (None for a top-level one).
        split_at: characters of that text block before the breakpoint when the block was split, else None.
        prefix_tokens: tokens up to the breakpoint (``counted_by`` of the plan).
        ttl: ``"1h"``, ``"5m"`` or None (the provider's default, 5 minutes).
    """

    kind: str
    path: BlockPath | None
    position: int | None
    prefix_tokens: int
    ttl: str | None
    split_at: int | None = None


@dataclass
class BreakpointPlan:
    """What ``add_breakpoints`` did: every breakpoint (client and automatic, in prompt order), the boundaries
    it skipped and why (``"below_minimum"``, ``"no_cacheable_block"``, ``"already_marked"``,
    ``"no_slot_left"``), the minimum used, and how tokens were counted."""

    breakpoints: list[Breakpoint] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    min_tokens: int = DEFAULT_MIN_TOKENS
    counted_by: str = ""

    @property
    def added(self) -> list[Breakpoint]:
        """The automatic breakpoints."""
        return [b for b in self.breakpoints if b.kind != "client"]


_Mark = tuple[int, int | None]  # (flat position, split_at); a split mark comes before the whole-block mark


def _mark_order(mark: _Mark) -> tuple[int, float]:
    return (mark[0], float("inf") if mark[1] is None else mark[1])


def _eligible_at_or_before(slots: list[_Slot], position: int) -> int | None:
    """The last cacheable position in ``position``'s group (message / system / tool) at or before it."""
    group = slots[position].group
    pos = position
    while pos >= 0 and slots[pos].group == group:
        if _cacheable(slots[pos].block):
            return pos
        pos -= 1
    return None


def _text_of(block: Any) -> str | None:
    if isinstance(block, str):
        return block
    if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    return None


def _resolve(
    slots: list[_Slot], position_of: Mapping[BlockPath, int], kind: str, boundary: Any
) -> _Mark | None:
    """The mark a boundary asks for, or None when no cacheable block ends the segment."""
    if not isinstance(boundary, Boundary):
        boundary = Boundary(tuple(boundary))
    path = tuple(boundary.path)
    if path not in position_of:
        raise KeyError(f"boundary {kind!r} points at {path}, which is not a block of the body")
    pos = position_of[path]
    if boundary.split_at is not None and boundary.split_at > 0:
        text = _text_of(slots[pos].block)
        if text is not None and boundary.split_at < len(text):
            return (pos, boundary.split_at)
        if text is None:  # not splittable: end at the block before it
            pos -= 1
            if pos < 0:
                return None
            earlier = _eligible_at_or_before(slots, pos)
            return None if earlier is None else (earlier, None)
    eligible = _eligible_at_or_before(slots, pos)
    return None if eligible is None else (eligible, None)


def add_breakpoints(
    body: Mapping[str, Any],
    boundaries: Mapping[str, BlockPath | Boundary],
    model: str,
    *,
    min_tokens: int | None = None,
    min_tokens_overrides: Mapping[str, int] | None = None,
    counter: TokenCounter | None = None,
    max_breakpoints: int = MAX_BREAKPOINTS,
    lookback_blocks: int = LOOKBACK_BLOCKS,
) -> tuple[dict[str, Any], BreakpointPlan]:
    """Add ``cache_control`` breakpoints to a Messages body (a new body; the input is not changed).

    Args:
        body: the Anthropic request body (``tools``, ``system``, ``messages``).
        boundaries: boundary kind (``"tools"``, ``"system"``, ``"documents"``, ``"history"``) -> where that
            segment ends (a ``Boundary``, or a bare ``BlockPath`` = after that block); missing kinds have
            none.
        model: the upstream model name (for the minimum cacheable length).
        min_tokens: the minimum, overriding the table.
        min_tokens_overrides: model-name prefix -> minimum, consulted before the built-in table.
        counter: token counter (default: ``default_counter()``).
        max_breakpoints: the provider's limit (4).
        lookback_blocks: the provider's lookback window in blocks (20).

    Returns:
        the new body and the plan.

    Raises:
        KeyError: a boundary path that is not a block of ``body``.
    """
    counter = counter or default_counter()
    minimum = min_tokens if min_tokens is not None else min_cacheable_tokens(model, min_tokens_overrides)
    plan = BreakpointPlan(min_tokens=minimum, counted_by=counter.counted_by)
    slots = _flatten(body, counter)
    position_of = {slot.path: pos for pos, slot in enumerate(slots)}
    cumulative: list[int] = []
    total = 0
    for slot in slots:
        total += slot.tokens
        cumulative.append(total)

    def prefix_tokens(mark: _Mark) -> int:
        pos, split = mark
        if split is None:
            return cumulative[pos]
        before = cumulative[pos - 1] if pos else 0
        return before + counter.count((_text_of(slots[pos].block) or "")[:split])

    client_ttl: dict[int, str | None] = {
        pos: (slot.block["cache_control"] or {}).get("ttl")
        if isinstance(slot.block["cache_control"], dict)
        else None
        for pos, slot in enumerate(slots)
        if _has_breakpoint(slot.block)
    }
    top_level = "cache_control" in body
    used = len(client_ttl) + (1 if top_level else 0)
    chosen: dict[_Mark, str] = {}

    for kind in BOUNDARY_PRIORITY:
        if kind not in boundaries:
            continue
        mark = _resolve(slots, position_of, kind, boundaries[kind])
        if mark is None:
            plan.skipped[kind] = "no_cacheable_block"
        elif (mark[1] is None and mark[0] in client_ttl) or mark in chosen:
            plan.skipped[kind] = "already_marked"
        elif prefix_tokens(mark) < minimum:
            plan.skipped[kind] = "below_minimum"
        elif used >= max_breakpoints:
            plan.skipped[kind] = "no_slot_left"
        else:
            chosen[mark] = kind
            used += 1

    # Lookback: a breakpoint more than ``lookback_blocks`` blocks after the previous one gets one in between.
    while used < max_breakpoints:
        positions = sorted({pos for pos in client_ttl} | {pos for pos, _ in chosen})
        gap = next(
            ((a, b) for a, b in zip(positions, positions[1:], strict=False) if b - a > lookback_blocks), None
        )
        if gap is None:
            break
        pos = _nearest_cacheable(slots, gap[0] + lookback_blocks, floor=gap[0])
        if pos is None or cumulative[pos] < minimum:
            break
        chosen[(pos, None)] = "lookback"
        used += 1

    ttls = {mark: _ttl_for(mark[0], client_ttl) for mark in chosen}
    new_body = _apply(body, slots, ttls)
    if top_level:
        raw = body["cache_control"]
        plan.breakpoints.append(
            Breakpoint("client", None, None, total, raw.get("ttl") if isinstance(raw, dict) else None)
        )
    marks = sorted(set(chosen) | {(pos, None) for pos in client_ttl}, key=_mark_order)
    for mark in marks:
        kind = chosen.get(mark, "client")
        ttl = client_ttl.get(mark[0]) if kind == "client" else ttls[mark]
        plan.breakpoints.append(
            Breakpoint(kind, slots[mark[0]].path, mark[0], prefix_tokens(mark), ttl, mark[1])
        )
    return new_body, plan


def _nearest_cacheable(slots: list[_Slot], position: int, floor: int) -> int | None:
    pos = position
    while pos > floor:
        if _cacheable(slots[pos].block) and not _has_breakpoint(slots[pos].block):
            return pos
        pos -= 1
    return None


def _ttl_for(position: int, client_ttls: Mapping[int, str | None]) -> str | None:
    """``"1h"`` when a client 1-hour breakpoint comes at or after ``position`` (the ordering rule), else
    None."""
    return "1h" if any(pos >= position and ttl == "1h" for pos, ttl in client_ttls.items()) else None


def _marker(ttl: str | None) -> dict[str, Any]:
    return {"type": "ephemeral", "ttl": ttl} if ttl else {"type": "ephemeral"}


def _apply(body: Mapping[str, Any], slots: list[_Slot], ttls: Mapping[_Mark, str | None]) -> dict[str, Any]:
    """A new body with the chosen marks applied, last first (so a split never shifts a path still to
    apply)."""
    new_body = dict(body)
    if not ttls:
        return new_body
    if "tools" in body:
        new_body["tools"] = [dict(t) for t in body["tools"]]
    system = body.get("system")
    if isinstance(system, list):
        new_body["system"] = [dict(b) if isinstance(b, dict) else b for b in system]
    if "messages" in body:
        new_body["messages"] = [dict(m) for m in body["messages"]]
    for mark in sorted(ttls, key=_mark_order, reverse=True):
        pos, split = mark
        path = slots[pos].path
        if path[0] == "tools":
            new_body["tools"][path[1]]["cache_control"] = _marker(ttls[mark])
            continue
        if path[0] == "system":
            if isinstance(new_body["system"], str):
                new_body["system"] = [{"type": "text", "text": new_body["system"]}]
            blocks, index = new_body["system"], path[1]
        else:
            message = new_body["messages"][path[1]]
            if isinstance(message["content"], str):
                message["content"] = [{"type": "text", "text": message["content"]}]
            else:
                message["content"] = list(message["content"])
            blocks, index = message["content"], path[2]
        block = blocks[index]
        if split is None:
            blocks[index] = {**block, "cache_control": _marker(ttls[mark])}
        else:
            head = {"type": "text", "text": block["text"][:split], "cache_control": _marker(ttls[mark])}
            blocks[index : index + 1] = [head, {**block, "text": block["text"][split:]}]
    return new_body
