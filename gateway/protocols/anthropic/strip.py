"""Anthropic-face messages and tools for a backend that is not Anthropic (an OpenAI-compatible server, the
embedded engine): Anthropic-only keys removed, thinking blocks dropped, other Anthropic-only blocks refused
with ``UnsupportedContentError``; Anthropic-only top-level fields refused unless they ask for nothing
(``check_anthropic_only_fields``). The one copy of this stripping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.core.errors import InvalidRequestError
from gateway.protocols.anthropic.parse import OPAQUE, THINKING_TYPES
from gateway.protocols.anthropic.prompt import UnsupportedContentError

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    pass


ANTHROPIC_ONLY_FIELDS: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}, {"type": "adaptive"}),
    "output_config": (None, {}),
    "output_format": (None,),
    "container": (None,),
    "mcp_servers": (None, []),
    "context_management": (None,),
    "inference_geo": (None,),
    "diagnostics": (None,),
    "speed": (None,),
    "user_profile_id": (None,),
    "workspace_id": (None,),
}
"""Top-level Messages fields with no equivalent outside Anthropic -> the values that ask for nothing (``adaptive``
thinking leaves thinking to the model, and an answer without it is one; ``context_management`` edits that only
clear thinking blocks, ``clears_thinking_only``, change nothing where no thinking block reaches the model). The
other Messages fields are translated (``metadata.user_id`` -> ``user``, ``stop_sequences`` -> ``stop``, ...) or
harmless to leave out (``service_tier``: capacity, not the answer; ``cache_control``: a caching hint, the
gateway routes by prefix key). docs/upstreams.md lists the decisions."""

_PLAIN_PART_KEYS = {"text": {"type", "text"}, "image_url": {"type", "image_url"}}


TOOL_ERROR_PREFIX = "Error: "
"""What a failed tool's result (``tool_result`` with ``is_error: true``) starts with for a backend that is not
Anthropic: the flag has no field there, so the model reads it in the text (``plain_messages``)."""


def plain_messages(messages: list[dict[str, Any]], target: str = "this") -> list[dict[str, Any]]:
    """Messages of an Anthropic-face request for a backend that is not Anthropic (an OpenAI-compatible server,
    the embedded engine): without what the translation carries along (Anthropic-only part keys such as
    ``cache_control`` and ``citations``; ``is_error`` and ``cache_control`` of tool messages; tool-call
    extras), thinking blocks dropped (the model cannot use another model's thinking). A tool message with
    ``is_error: true`` starts with ``TOOL_ERROR_PREFIX`` instead (its text, or a text part before its parts), so
    the model still learns the call failed.

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
        if message.get("role") == "tool" and message.get("is_error") is True:
            clean["content"] = failed_result(clean.get("content"))
        if message.get("tool_calls"):
            clean["tool_calls"] = [
                {k: v for k, v in call.items() if k in ("id", "type", "function")}
                for call in message["tool_calls"]
            ]
        out.append(clean)
    return out


def failed_result(content: Any) -> Any:
    """A failed tool's content (``is_error: true``) as a backend that is not Anthropic gets it:
    ``TOOL_ERROR_PREFIX`` prepended to text, or as a text part before parts (an empty result is the prefix alone,
    without its trailing space). ``plain_messages`` and the embedded engine's ``template_message`` use it."""
    if isinstance(content, list):
        return [{"type": "text", "text": TOOL_ERROR_PREFIX.rstrip()}, *content]
    if isinstance(content, str) and content:
        return TOOL_ERROR_PREFIX + content
    return TOOL_ERROR_PREFIX.rstrip()


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


def clears_thinking_only(value: Any) -> bool:
    """Whether a ``context_management`` value only clears thinking blocks (``{"edits": [{"type":
    "clear_thinking_20251015", ...}]}``, as Claude Code sends on every request): nothing to do for a backend
    whose prompts hold no thinking block (they are dropped from the history it is sent)."""
    if not isinstance(value, dict) or set(value) - {"edits"}:
        return False
    edits = value.get("edits")
    return isinstance(edits, list) and all(
        isinstance(edit, dict) and str(edit.get("type", "")).startswith("clear_thinking_") for edit in edits
    )


def check_anthropic_only_fields(
    body: Mapping[str, Any], target: str, honoured: frozenset[str] = frozenset()
) -> None:
    """Refuse the Anthropic-only top-level fields of ``body`` (``ANTHROPIC_ONLY_FIELDS``) set to a value that
    asks for something, rather than drop them silently.

    Args:
        body: the client's Messages body.
        target: the backend in words (``"an OpenAI-compatible upstream"``), for the message.
        honoured: fields the backend checks and honours itself (the embedded engine: ``thinking``,
            ``output_config``).

    Raises:
        InvalidRequestError: code ``unsupported_value``, ``param`` the field.
    """
    for name, accepted in ANTHROPIC_ONLY_FIELDS.items():
        if name in honoured or name not in body or any(body[name] == value for value in accepted):
            continue
        if name == "context_management" and clears_thinking_only(body[name]):
            continue
        neutral = [json.dumps(value) for value in accepted if value is not None]
        hint = f"omit it or send {' or '.join(neutral)}" if neutral else "omit it"
        raise InvalidRequestError(
            f"{name}: '{name}' is Anthropic-only and {target} model cannot honour it; {hint}.",
            param=name,
            code="unsupported_value",
        )
