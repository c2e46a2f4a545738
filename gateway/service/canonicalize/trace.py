"""Trace lines: one recorded request body a line, parsed into OpenAI-shaped messages and tools.

Owns ``parse_line`` and its types: ``TraceRequest`` (a parsed line), ``BrokenLine`` (a skipped line and
why) and ``TraceLineError``. A line is an OpenAI chat body, an Anthropic messages body (validated and
converted by the protocol layer's own code), or an envelope ``{"protocol": ..., "tenant": ..., "body": ...}``.

Invariants: a ``TraceRequest``'s ``messages`` and ``tools`` pass ``rules.messages.check_shape`` whatever the
protocol; a ``TraceLineError``'s message says why without quoting the line's text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import APIError
from gateway.protocols.anthropic.parse import anthropic_to_openai_messages, anthropic_to_openai_tools
from gateway.protocols.anthropic.validate import validate_body
from rules import RequestShapeError
from rules.messages import check_shape


class TraceLineError(ValueError):
    """One trace line cannot be replayed; the message says why (without the line's text)."""


@dataclass(frozen=True)
class TraceRequest:
    """One parsed trace line: OpenAI-shaped ``messages`` and ``tools`` whatever the protocol."""

    line: int
    protocol: str
    model: str
    tenant: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class BrokenLine:
    """A line that was skipped: its 1-based number and why."""

    line: int
    reason: str


def parse_line(text: str, number: int) -> TraceRequest:
    """One trace line as a ``TraceRequest``.

    Raises:
        TraceLineError: not JSON, not an object, no model, or not a chat body of the protocol it claims or
            looks like (Anthropic: a top-level ``system`` or content blocks of types OpenAI has no such name
            for; otherwise OpenAI).
    """
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        raise TraceLineError(f"not JSON ({reason})") from None
    if not isinstance(obj, dict):
        raise TraceLineError(f"not a JSON object (a {type(obj).__name__})")
    tenant, protocol, body = "", None, obj
    if "body" in obj and isinstance(obj.get("body"), dict):
        body = obj["body"]
        protocol = obj.get("protocol")
        if protocol not in (None, "openai", "anthropic"):
            raise TraceLineError("envelope 'protocol' must be 'openai' or 'anthropic'")
        tenant = obj.get("tenant", "")
        if not isinstance(tenant, str):
            raise TraceLineError("envelope 'tenant' must be a string")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise TraceLineError("wrong shape: 'model' must be a non-empty string")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise TraceLineError("wrong shape: 'messages' must be a non-empty list")
    protocol = protocol or ("anthropic" if _looks_anthropic(body) else "openai")
    if protocol == "anthropic":
        messages, tools = _anthropic(body)
    else:
        messages, tools = body["messages"], body.get("tools")
    try:
        check_shape(messages, tools)
    except RequestShapeError as e:
        raise TraceLineError(f"wrong shape: {e}") from None
    return TraceRequest(number, protocol, model, tenant, messages, tools)


_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "document"})


def _looks_anthropic(body: dict[str, Any]) -> bool:
    if "system" in body:
        return True
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and (
                    block.get("type") in _ANTHROPIC_BLOCKS
                    or (block.get("type") == "image" and "source" in block)
                ):
                    return True
    return False


def _anthropic(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The protocol layer's own validation and conversion to OpenAI-shaped messages and tools."""
    try:
        validate_body(body, require_max_tokens=False)
    except APIError as e:
        raise TraceLineError(f"wrong shape (anthropic): {e}") from None
    return anthropic_to_openai_messages(body), anthropic_to_openai_tools(body.get("tools"))
