"""The text form of one server-sent event, encode side: ``event: <name>`` (optional), ``data: <compact
JSON>``, a blank line; and OpenAI's ``data: [DONE]`` sentinel. Pure bytes-in-bytes-out, so both the protocol
renderers and the transport can use it (parsing and the ASGI response are ``gateway.transport.sse``'s).

Format: WHATWG HTML Living Standard, "Server-sent events"
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).
"""

from __future__ import annotations

from typing import Any

from gateway.core.json_types import compact_json

DONE = b"data: [DONE]\n\n"
"""OpenAI's end-of-stream sentinel."""


def encode_event(data: Any, event: str | None = None) -> bytes:
    """One SSE event: optional ``event: <name>`` line, then ``data: <json>``, then a blank line (UTF-8
    bytes)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {compact_json(data)}\n\n".encode()
