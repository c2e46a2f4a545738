"""The text form of one server-sent event, encode side: ``event: <name>`` (optional), ``data: <compact
JSON>``, a blank line; and OpenAI's ``data: [DONE]`` sentinel. Pure bytes-in-bytes-out, so both the protocol
renderers and the transport can use it (parsing and the ASGI response are ``gateway.transport.sse``'s).

Format: WHATWG HTML Living Standard, "Server-sent events"
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).

Invariant: a ``data:`` line holds no character that any common line splitter takes for a line end. SSE
itself only ends lines at CR and LF (which JSON always escapes), but clients that read the stream with
``str.splitlines`` semantics (httpx's ``Response.aiter_lines``, Python's ``io`` text readers with
``splitlines``) also end a line at U+0085 (NEL), U+2028 and U+2029, which ``json.dumps(ensure_ascii=False)``
leaves raw: a model that samples one of them (the soak's random checkpoint did) would cut the client's
JSON in two. They are written as JSON escapes (``\u0085``, ``\u2028``, ``\u2029``), which decode to the
same string; every other non-ASCII character stays UTF-8.
"""

from __future__ import annotations

from typing import Any

from gateway.core.json_types import compact_json

DONE = b"data: [DONE]\n\n"
"""OpenAI's end-of-stream sentinel."""


_LINE_SEPARATORS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""The characters ``str.splitlines`` ends a line at that JSON leaves raw (the C0 ones are escaped already),
to their JSON escapes: they only ever occur inside JSON strings, where the escape means the same."""


def encode_event(data: Any, event: str | None = None) -> bytes:
    """One SSE event: optional ``event: <name>`` line, then ``data: <json>``, then a blank line (UTF-8
    bytes). U+0085, U+2028 and U+2029 are written as JSON escapes (see the module docstring)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {compact_json(data).translate(_LINE_SEPARATORS)}\n\n".encode()


def encode_event_value(value: Any) -> bytes:
    """The bytes ``encode_event`` writes for ``value`` where it stands inside an event's data (compact JSON,
    U+0085 / U+2028 / U+2029 escaped, UTF-8): a piece of an event that is put together from a cached frame
    (``gateway.protocols.openai.render.ContentChunkFrames``)."""
    return compact_json(value).translate(_LINE_SEPARATORS).encode()
