"""Segment boundaries in an Anthropic Messages body: where the rules' segments (tools+system, documents,
history) end, as block paths a cache breakpoint can follow. From the rules' segments when the body was built
from the canonical messages (``boundaries_from_segments``), else read off the body (``default_boundaries``).
Reference: https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.protocols.anthropic.prompt import BlockPath


@dataclass(frozen=True)
class Boundary:
    """The end of a segment in a Messages body: after block ``path``, or, with ``split_at``, after the first
    ``split_at`` characters of that text block (the block is split in two there when a breakpoint goes in)."""

    path: BlockPath
    split_at: int | None = None


LEVEL_KINDS = {1: "system", 2: "documents", 3: "history"}


def boundaries_from_segments(
    segments: Sequence[Any],
    part_blocks: Sequence[Sequence[BlockPath | None]],
    last_block: Sequence[BlockPath | None],
    tool_count: int,
) -> dict[str, Boundary]:
    """Boundaries from the rules' segments (``rules.segments.Segment``).

    Args:
        segments: objects with ``level`` (1 tools+system, 2 documents, 3 history, 4 volatile),
            ``end_message`` (exclusive index into the canonical messages) and ``end_part`` / ``end_char``
            (where in message ``end_message - 1`` the segment stops, exclusive; None = at its end).
        part_blocks: per canonical message, per content part, the block path it became
            (``gateway.protocols.anthropic.prompt.AnthropicPrompt.part_blocks``).
        last_block: per canonical message, the path of its last block (``AnthropicPrompt.last_block``).
        tool_count: number of tools in the body (the ``tools`` boundary is the last one).

    Returns:
        kind -> ``Boundary``; a segment whose end maps to no block has none. A segment that stops inside a
        text part gives a split boundary; inside another block (a tool result, an image), the block before.
    """
    out: dict[str, Boundary] = {}
    if tool_count:
        out["tools"] = Boundary(("tools", tool_count - 1))
    for segment in segments:
        kind = LEVEL_KINDS.get(int(segment.level))
        message = int(segment.end_message) - 1
        if kind is None or message < 0:
            continue
        boundary = _segment_end(message, segment.end_part, segment.end_char or 0, part_blocks, last_block)
        if boundary is not None and (kind not in out or _boundary_key(boundary) > _boundary_key(out[kind])):
            out[kind] = boundary
    return out


def _segment_end(
    message: int,
    end_part: int | None,
    end_char: int,
    part_blocks: Sequence[Sequence[BlockPath | None]],
    last_block: Sequence[BlockPath | None],
) -> Boundary | None:
    if message >= len(last_block):
        return None
    parts = part_blocks[message] if message < len(part_blocks) else []
    if end_part is None:
        path = last_block[message]
        return Boundary(path) if path is not None else _before_message(message, last_block)
    if end_char > 0 and end_part < len(parts) and parts[end_part] is not None:
        return Boundary(parts[end_part], split_at=end_char)  # type: ignore[arg-type]
    if not parts:  # a tool result: one block, cannot end inside it
        return _before_message(message, last_block)
    for part in range(min(end_part, len(parts)) - 1, -1, -1):
        if parts[part] is not None:
            return Boundary(parts[part])  # type: ignore[arg-type]
    return _before_message(message, last_block)


def _before_message(message: int, last_block: Sequence[BlockPath | None]) -> Boundary | None:
    for index in range(message - 1, -1, -1):
        if last_block[index] is not None:
            return Boundary(last_block[index])  # type: ignore[arg-type]
    return None


def _boundary_key(boundary: Boundary) -> tuple[Any, ...]:
    return (*_path_key(boundary.path), float("inf") if boundary.split_at is None else boundary.split_at)


def default_boundaries(body: Mapping[str, Any]) -> dict[str, BlockPath]:
    """Boundaries read off a Messages body itself (no rules' segments): the last tool, the last system block,
    and the history = the last block of the message before the last user message."""
    out: dict[str, BlockPath] = {}
    tools = body.get("tools") or []
    if tools:
        out["tools"] = ("tools", len(tools) - 1)
    system = body.get("system")
    if isinstance(system, str) and system:
        out["system"] = ("system", 0)
    elif isinstance(system, list) and system:
        out["system"] = ("system", len(system) - 1)
    messages = body.get("messages") or []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is not None:
        for i in range(last_user - 1, -1, -1):
            content = messages[i].get("content")
            if isinstance(content, str) and content:
                out["history"] = ("messages", i, 0)
                break
            if isinstance(content, list) and content:
                out["history"] = ("messages", i, len(content) - 1)
                break
    return out


def _path_key(path: BlockPath) -> tuple[int, ...]:
    order = {"tools": 0, "system": 1, "messages": 2}
    return (order[path[0]], *path[1:])
