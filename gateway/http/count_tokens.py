"""``POST /v1/messages/count_tokens``: the input tokens of a Messages request, without running it.

Reference: https://docs.anthropic.com/en/api/messages-count-tokens. The body is a Messages body without the
generation's fields (``gateway.protocols.anthropic.validate.COUNT_TOKENS_FIELDS``: ``max_tokens``, ``stream``,
``temperature``... are refused as unknown fields); the answer is ``{"input_tokens": <int>}``; errors are Anthropic error JSON, as on
``/v1/messages`` (the app's error handler shapes every path under ``/v1/messages`` so).

The body is parsed, validated and canonicalized exactly as ``/v1/messages`` does it (same headers:
``x-prefixgate-rules``, ``x-prefixgate-tenant``, ``anthropic-beta``; the configured rules), so the count is
the count of what the model would be sent. The named model's backend counts (``Backend.count_tokens``: the
embedded engine renders its chat template, an Anthropic upstream asks its own count endpoint, any other
backend estimates locally). Every answer carries ``x-prefixgate-counted-by`` (``TokenCount.counted_by``) and
``x-prefixgate-count-estimate`` (``true`` for a local estimate, else ``false``).

A count is not a served request: it adds nothing to the stats' request, token or rule counters (an error
answer is counted as an error by the app's handler, as every error is). It is logged once in the request log
with ``prompt_tokens`` = the count.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.core.errors import InvalidRequestError
from gateway.http.auth import authenticate, authorize
from gateway.http.body import read_json_object
from gateway.http.request_context import begin, gateway_of, refuse_unknown_fields, request_id_of, started_at
from gateway.protocols.anthropic.cache_control import (
    CacheControlError,
    check_client_cache_control,
    drop_null_markers,
)
from gateway.protocols.anthropic.parse import COUNT_TOKENS_PATH, apply_request_headers, parse_count_body
from gateway.service.pipeline import canonicalize_off_loop
from gateway.service.request_log import RequestRecord, log_request

COUNTED_BY_HEADER = "x-prefixgate-counted-by"
ESTIMATE_HEADER = "x-prefixgate-count-estimate"


async def count_tokens_endpoint(http_request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}`` with ``x-prefixgate-counted-by`` and
    ``x-prefixgate-count-estimate`` headers (see the module docstring).

    Errors (Anthropic error JSON, by the app's handler): 400 not JSON / a bad field / content the backend
    cannot take, 404 unknown model, 413 body over ``server.max_body_bytes``, 503 an embedded model not
    started, and the upstream's errors mapped as for ``/v1/messages``.
    """
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    body = drop_null_markers(await read_json_object(http_request, gateway.config.server.max_body_bytes))
    request = parse_count_body(
        body, request_id=request_id_of(http_request), refuse_unknown=refuse_unknown_fields(gateway)
    )
    try:  # the same cache_control checks as /v1/messages (the count is of a body that endpoint would take)
        check_client_cache_control(body)
    except CacheControlError as exc:
        raise InvalidRequestError(exc.args[0], param=exc.param) from None
    apply_request_headers(request, http_request.headers)
    authorize(http_request, request, key, admit=False)
    begin(http_request, request)
    backend = gateway.registry.get(request.model)
    await canonicalize_off_loop(gateway, request)
    count = await backend.count_tokens(request)
    log_request(
        RequestRecord(
            request_id=request.request_id,
            path=http_request.url.path,
            status=200,
            model=request.model,
            key=request.client_key or None,
            tenant=request.tenant or None,
            prompt_tokens=count.input_tokens,
            duration_s=time.monotonic() - started_at(http_request),
            prefix_key=request.prefix_key or None,
        )
    )
    headers = {
        "request-id": request.request_id,
        "x-request-id": request.request_id,
        COUNTED_BY_HEADER: count.counted_by,
        ESTIMATE_HEADER: "true" if count.estimate else "false",
    }
    return JSONResponse({"input_tokens": count.input_tokens}, headers=headers)


def routes() -> list[BaseRoute]:
    """This module's routes (``gateway.http.routes`` joins them with the faces')."""
    return [Route(COUNT_TOKENS_PATH, count_tokens_endpoint, methods=["POST"])]
