"""HTTP routes of the Anthropic face: ``POST /v1/messages``. Bodies are parsed and answers rendered by
``gateway.protocols.anthropic`` (an Anthropic upstream's own events relayed verbatim); the path in between is
``gateway.service.pipeline``'s. Errors before the response starts go to the app's handler (Anthropic error
JSON on this path); after it, an SSE ``error`` event. Reference: https://docs.anthropic.com/en/api/messages
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.core.errors import InvalidRequestError
from gateway.core.event_stream import encode_event
from gateway.core.events import Finish
from gateway.http.auth import authenticate, authorize
from gateway.http.body import read_json_object
from gateway.http.request_context import (
    answer_headers,
    begin,
    gateway_of,
    open_unless_disconnected,
    refuse_unknown_fields,
    request_id_of,
    run_unless_disconnected,
    started_at,
)
from gateway.protocols.anthropic.cache_control import (
    CacheControlError,
    check_client_cache_control,
    drop_null_markers,
)
from gateway.protocols.anthropic.parse import apply_request_headers, parse_messages_body
from gateway.protocols.anthropic.render import NativeDelta, build_message, relay_event
from gateway.protocols.anthropic.stream import StreamFormatter
from gateway.protocols.anthropic.structured_outputs import to_anthropic_format_error
from gateway.service.pipeline import OpenedStream
from gateway.transport.sse import EventStreamResponse


async def message_sse(opened: OpenedStream) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed Message from a ``gateway.service.pipeline.OpenedStream``: native events
    relayed, other backends' events formatted; an error after the start becomes an ``error`` event that ends
    the stream."""
    request = opened.request
    formatter = StreamFormatter(request.model, request.request_id)
    async with aclosing(opened.guarded_events(formatter.error)) as events:
        async for event in events:
            if isinstance(event, bytes):
                yield event  # the error event, already encoded by formatter.error
            elif isinstance(event, NativeDelta):
                formatter.started = True
                for raw in event.events:
                    yield encode_event(relay_event(raw, request.model), str(raw.get("type", "message")))
            elif isinstance(event, Finish) and event.native:
                continue
            else:
                yield formatter.feed(event)


async def collect_message(opened: OpenedStream) -> dict[str, Any]:
    """The Message JSON of a non-streamed request (see ``build_message``)."""
    request = opened.request
    message, _ = await build_message(opened.events(), request.model, request.request_id)
    return message


async def messages_endpoint(http_request: Request) -> Response:
    """``POST /v1/messages``: the Anthropic Messages API over every backend.

    Services come from ``request.app.state.gateway`` (``gateway.service.gateway.Gateway``) through
    ``gateway.service.pipeline``: rules, prefix key, routing, stats and the request log are the pipeline's;
    errors before the response starts propagate to the app's handler, which answers Anthropic error JSON on
    this path.
    Headers: ``x-prefixgate-rules: on|off``, ``x-prefixgate-tenant`` (cache salt), ``anthropic-beta``
    (forwarded to Anthropic upstreams). The answer carries ``x-prefixgate-cache`` when the cached count is
    known.
    """
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    body = drop_null_markers(await read_json_object(http_request, gateway.config.server.max_body_bytes))
    request = parse_messages_body(
        body, request_id=request_id_of(http_request), refuse_unknown=refuse_unknown_fields(gateway)
    )
    try:  # the Messages API's own cache_control checks (at most 4, ttl order, ...), whatever the backend
        check_client_cache_control(body)
    except CacheControlError as exc:
        raise InvalidRequestError(exc.args[0], param=exc.param) from None
    apply_request_headers(request, http_request.headers)
    authorize(http_request, request, key)
    begin(http_request, request)
    try:  # the engine names the output schema in chat terms (response_format): the client sent output_config
        opened = await open_unless_disconnected(
            http_request, gateway, request, http_request.url.path, started_at(http_request)
        )
    except InvalidRequestError as error:
        to_anthropic_format_error(error, body)
        raise
    headers = {"request-id": request.request_id, **answer_headers(http_request, request, opened)}
    if request.stream:
        headers.update(await opened.cache_header())
        return EventStreamResponse(message_sse(opened), headers=headers)
    message = await run_unless_disconnected(http_request, collect_message(opened), opened)
    headers.update(await opened.cache_header())
    headers.update(opened.cost_headers())
    return JSONResponse(message, headers=headers)


def routes() -> list[BaseRoute]:
    """This face's route table (``gateway.http.app`` collects it)."""
    return [Route("/v1/messages", messages_endpoint, methods=["POST"])]
