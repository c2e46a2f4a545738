"""Anthropic-face messages and tools for a backend that is not Anthropic (an OpenAI-compatible server, the
embedded engine): Anthropic-only keys removed, thinking blocks dropped, other Anthropic-only blocks refused
with ``UnsupportedContentError``. The one copy of this stripping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.protocols.anthropic.parse import OPAQUE, THINKING_TYPES
from gateway.protocols.anthropic.prompt import UnsupportedContentError

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    pass


_PLAIN_PART_KEYS = {"text": {"type", "text"}, "image_url": {"type", "image_url"}}


def plain_messages(messages: list[dict[str, Any]], target: str = "this") -> list[dict[str, Any]]:
    """Messages of an Anthropic-face request for a backend that is not Anthropic (an OpenAI-compatible server,
    the embedded engine): without what the translation carries along (Anthropic-only part keys such as
    ``cache_control`` and ``citations``; ``is_error`` and ``cache_control`` of tool messages; tool-call
    extras), thinking blocks dropped (the model cannot use another model's thinking).

    Raises:
        UnsupportedContentError: an Anthropic-only block other than thinking (document, server tool result,
            ...).
    """
    out = []
    for i, message in enumerate(messages):
        clean = {k: v for k, v in message.items() if k not in ("is_error", "cache_control")}
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    parts.append(part)
                    continue
                kind = part.get("type")
                if kind == OPAQUE:
                    block = part.get("block") or {}
                    if block.get("type") in THINKING_TYPES:
                        continue
                    raise UnsupportedContentError(
                        f"A {block.get('type')!r} content block cannot be sent to {target} model.",
                        param=f"messages[{i}].content[{j}]",
                    )
                keys = _PLAIN_PART_KEYS.get(kind)
                parts.append({k: v for k, v in part.items() if k in keys} if keys else part)
            if message.get("role") == "assistant" and not parts:
                clean["content"] = None
            elif message.get("role") == "tool" and all(p.get("type") == "text" for p in parts):
                clean["content"] = "".join(p.get("text", "") for p in parts)  # tool content: text only
            else:
                clean["content"] = parts
        if message.get("tool_calls"):
            clean["tool_calls"] = [
                {k: v for k, v in call.items() if k in ("id", "type", "function")}
                for call in message["tool_calls"]
            ]
        out.append(clean)
    return out


def plain_tools(tools: list[dict[str, Any]] | None, target: str = "this") -> list[dict[str, Any]] | None:
    """Function tools without the ``x-anthropic`` extras. Raises ``UnsupportedContentError`` on server
    tools."""
    if tools is None:
        return None
    out = []
    for j, tool in enumerate(tools):
        if tool.get("type") == OPAQUE:
            name = (tool.get("tool") or {}).get("type")
            raise UnsupportedContentError(
                f"The Anthropic server tool {name!r} cannot be used with {target} model.",
                param=f"tools[{j}]",
            )
        out.append({k: v for k, v in tool.items() if k not in (OPAQUE, "cache_control")})
    return out
