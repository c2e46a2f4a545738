"""Reading a JSON request body with a hard size limit enforced while reading.

``Content-Length`` is checked first (a quick 413 for honest clients) but never trusted alone: the streamed
bytes are counted as they arrive, so a chunked body or a lying header cannot push more than
``max_bytes`` (+ one network chunk) into memory. A client that disconnects before its body is complete is
``ClientDisconnected`` (logged as 499 by the app's handler), not an unexpected error.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.core.errors import InvalidRequestError, PayloadTooLargeError
from gateway.core.json_body import loads_request_json
from gateway.http.request_context import ClientDisconnected


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` bytes.

    Raises:
        PayloadTooLargeError: the declared or the actual body is larger than ``max_bytes``.
        InvalidRequestError: a ``Content-Length`` that is not a number.
        ClientDisconnected: the client disconnected before the body's end (``logged`` False).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidRequestError("Invalid Content-Length header.", code="invalid_header")
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # Starlette's: an ``http.disconnect`` before the body's last part
        raise ClientDisconnected(logged=False) from None
    return b"".join(chunks)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body parsed as a JSON object.

    Raises:
        PayloadTooLargeError, ClientDisconnected: see ``read_body``.
        InvalidRequestError: not UTF-8 JSON, or JSON that is not an object (code ``invalid_json``), too deep
            or with a lone surrogate (``gateway.core.json_body.loads_request_json``).
    """
    body = loads_request_json(await read_body(request, max_bytes))
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    return body


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"Request body too large: the limit is {max_bytes} bytes.")
