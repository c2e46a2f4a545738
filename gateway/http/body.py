"""Reading a JSON request body with a hard size limit enforced while reading.

``Content-Length`` is checked first (a quick 413 for honest clients) but never trusted alone: the streamed
bytes are counted as they arrive, so a chunked body or a lying header cannot push more than
``max_bytes`` (+ one network chunk) into memory. A client that disconnects before its body is complete is
``ClientDisconnected`` (logged as 499 by the app's handler), not an unexpected error.

Before a 413 the rest of the body is read and thrown away (``drain``: up to ``DRAIN_MAX_BYTES`` more, for at most
``DRAIN_TIMEOUT_S``): a client that sends its whole body before reading the answer (Python's ``urllib``) otherwise
found the connection reset by the server's close with its body unread, and never saw the 413's error JSON.
Nothing drained is kept. A declared body with ``Expect: 100-continue`` is not drained: that client sends nothing
before a 100 Continue (which reading the body would send), so it gets the 413 at once, as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.core.errors import InvalidRequestError, PayloadTooLargeError
from gateway.core.json_body import loads_request_json
from gateway.http.request_context import ClientDisconnected

DRAIN_MAX_BYTES = 64 * 1024 * 1024
"""Most bytes of an oversized body read and thrown away before its 413 (``drain``); past them the answer goes out
and the connection may be reset."""
DRAIN_TIMEOUT_S = 10.0
"""Most seconds ``drain`` waits for the rest of an oversized body (a slow or stalled sender)."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` bytes.

    Raises:
        PayloadTooLargeError: the declared or the actual body is larger than ``max_bytes`` (the rest of the body
            drained first: ``drain``).
        InvalidRequestError: a ``Content-Length`` that is not a number.
        ClientDisconnected: the client disconnected before the body's end (``logged`` False).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidRequestError("Invalid Content-Length header.", code="invalid_header")
        if int(declared) > max_bytes:
            if request.headers.get("expect", "").strip().lower() != "100-continue":
                await drain(request)  # a client waiting for 100 Continue has sent nothing: answer at once
            raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                break
            chunks.append(chunk)
    except ClientDisconnect:  # Starlette's: an ``http.disconnect`` before the body's last part
        raise ClientDisconnected(logged=False) from None
    if size > max_bytes:
        chunks.clear()
        await drain(request)
        raise _too_large(max_bytes)
    return b"".join(chunks)


async def drain(
    request: Request, max_bytes: int = DRAIN_MAX_BYTES, timeout_s: float = DRAIN_TIMEOUT_S
) -> int:
    """Read and throw away what is left of the request's body, at most ``max_bytes`` bytes for at most
    ``timeout_s`` seconds, so a client still sending it can then read the answer (module docstring). Never raises:
    a disconnect, a timeout or the byte bound just end it.

    Returns:
        The bytes thrown away.
    """
    drained = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                drained += len(chunk)
                if drained > max_bytes:
                    break
    except (ClientDisconnect, TimeoutError, RuntimeError):  # RuntimeError: the stream was already consumed
        pass
    return drained


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body parsed as a JSON object; ``request.state.stream`` notes whether it asks to stream (``"stream":
    true``), so that an error raised before the request is parsed is logged with it.

    Raises:
        PayloadTooLargeError, ClientDisconnected: see ``read_body``.
        InvalidRequestError: not UTF-8 JSON, or JSON that is not an object (code ``invalid_json``), too deep
            or with a lone surrogate (``gateway.core.json_body.loads_request_json``).
    """
    body = loads_request_json(await read_body(request, max_bytes))
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    # the body's own word on streaming, for the request log of an error raised before the request is parsed
    # (``gateway.http.request_context.begin`` sets the parsed value)
    request.state.stream = body.get("stream") is True
    return body


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"Request body too large: the limit is {max_bytes} bytes.")
