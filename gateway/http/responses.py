"""HTTP route of the OpenAI Responses API: ``POST /v1/responses`` (stateless). The body is translated into the
equivalent Chat Completions body (``gateway.protocols.openai.responses``) and parsed by the chat parser, so the
request takes the chat path (``gateway.service.pipeline``: rules, prefix key, prefix cache, backends); the
answer is a ``Response`` object or its SSE stream of typed events. Errors are OpenAI error JSON (before the
response starts) or an in-band ``error`` event (after). With ``truncation: "auto"`` a prompt that does not fit
is opened again without its oldest input items (``gateway.protocols.openai.responses_truncation``). Reference:
https://platform.openai.com/docs/api-reference/responses
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.core.errors import APIError, ContextLengthExceededError, InvalidRequestError
from gateway.core.event_stream import encode_event
from gateway.core.events import Delta, Finish
from gateway.http.auth import authenticate, authorize
from gateway.http.body import read_json_object
from gateway.http.request_context import (
    answer_headers,
    begin,
    gateway_of,
    open_unless_disconnected,
    refuse_unknown_fields,
    run_unless_disconnected,
    started_at,
)
from gateway.protocols.openai.parse import parse_chat_request
from gateway.protocols.openai.response_builder import ResponseBuilder
from gateway.protocols.openai.responses import chat_message_origins, responses_to_chat_body
from gateway.protocols.openai.responses_params import to_responses_error
from gateway.protocols.openai.responses_tools import chat_tool_paths
from gateway.protocols.openai.responses_truncation import (
    MAX_RETRIES,
    droppable_groups,
    groups_to_drop,
    without_oldest,
)
from gateway.service.pipeline import OpenedStream
from gateway.transport.failures import FailureKind, UpstreamCallError, overflow_counts
from gateway.transport.sse import EventStreamResponse


async def responses_endpoint(http_request: Request) -> Response:
    """``POST /v1/responses``: a ``Response`` object, or with ``stream: true`` its events as SSE. Client keys,
    model access, tenant and limits apply as on ``/v1/chat/completions`` (``gateway.http.auth``)."""
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    tries, sent = 0, body
    while True:  # more than once only for truncation "auto" over a prompt that does not fit
        chat_body = responses_to_chat_body(body, refuse_unknown_fields(gateway))
        try:  # the chat parser, the rules and the backend name fields in chat terms: rename them
            request = parse_chat_request(chat_body, http_request.headers, refuse_unknown=False)
            authorize(http_request, request, key, admit=tries == 0)  # limits count the request once
            begin(http_request, request)
            opened = await open_unless_disconnected(
                http_request, gateway, request, http_request.url.path, started_at(http_request)
            )
            break
        except (InvalidRequestError, UpstreamCallError) as error:
            # the gateway's refusal, or an upstream's of the chat body it got: both name the client's fields
            if not isinstance(error, UpstreamCallError) or error.kind == FailureKind.CLIENT_ERROR:
                if (shorter := _truncated(body, error, tries)) is not None:
                    body, tries = shorter, tries + 1
                    continue
                _say_truncated(error, sent, body)
                to_responses_error(error, chat_message_origins(body), chat_tool_paths(body))
            raise
    builder = ResponseBuilder(body, request.model, request.request_id)
    headers = answer_headers(http_request, request, opened)
    if request.stream:
        headers.update(await opened.cache_header())
        return EventStreamResponse(response_sse(opened, builder), headers=headers)
    result = await run_unless_disconnected(http_request, collect_response(opened, builder), opened)
    headers.update(await opened.cache_header())
    return JSONResponse(result, headers=headers)


def _truncated(body: dict[str, Any], error: APIError, tries: int) -> dict[str, Any] | None:
    """``body`` with its oldest input items dropped (``responses_truncation``), when it asked for ``truncation:
    "auto"``, ``error`` says the prompt does not fit the context (the gateway's own, or an OpenAI-compatible
    upstream's 400 ``context_length_exceeded``), fewer than ``MAX_RETRIES`` tries were made and something may
    still go; else None (the error stands)."""
    if body.get("truncation") != "auto" or tries >= MAX_RETRIES or not isinstance(body.get("input"), list):
        return None
    if isinstance(error, ContextLengthExceededError):
        counts = (error.prompt_tokens, error.excess_tokens)
    elif error.code == "context_length_exceeded":
        counts = overflow_counts(error.message) or (None, None)
    else:
        return None
    groups = droppable_groups(body["input"])
    count = groups_to_drop(body["input"], groups, *counts)
    return without_oldest(body, groups, count) if count else None


def _say_truncated(error: APIError, sent: dict[str, Any], body: dict[str, Any]) -> None:
    """Tell the client of a ``truncation: "auto"`` request that still did not fit how many input items were
    left out: the counts in the message are the shortened prompt's, not those of the input it sent (found by a
    re-trial: the same input read 11,119 tokens refused and 8,923 with "auto")."""
    dropped = len(sent["input"]) - len(body["input"]) if body is not sent else 0
    if dropped:
        left_out = f'truncation "auto" left out the {dropped} oldest input items'
        error.message += f" ({left_out}; what is left does not fit either)"


async def response_sse(opened: OpenedStream, builder: ResponseBuilder) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed response (``event: <type>`` + ``data: <json>`` per event)."""
    for event in builder.start():
        yield encode_event(event, event["type"])
    guarded = opened.guarded_events(lambda error: _error_event(builder, error))
    async with aclosing(guarded) as events:
        async for event in events:
            if isinstance(event, bytes):
                yield event
                continue
            for out in _events_of(builder, event):
                yield encode_event(out, out["type"])


async def collect_response(opened: OpenedStream, builder: ResponseBuilder) -> dict[str, Any]:
    """The ``Response`` object of a non-streamed request."""
    async for event in opened.events():
        _events_of(builder, event)
        if isinstance(event, Finish):
            return builder.response("incomplete" if event.finish_reason == "length" else "completed", event)
    raise APIError("The backend ended the response without a finish.")


def _events_of(builder: ResponseBuilder, event: Delta | Finish) -> list[dict[str, Any]]:
    if isinstance(event, Finish):
        return builder.finish(event)
    out = builder.text(event.text, event.logprobs) if event.text else []
    if not event.text and not event.tool_calls:
        builder.logprobs(event.logprobs)  # tokens whose text is held back: they go with the next text
    if event.tool_calls:
        out += builder.tool_calls(event.tool_calls)
    return out


def _error_event(builder: ResponseBuilder, error: APIError) -> bytes:
    """The ``error`` event that ends a stream which failed after it started."""
    event = builder.event("error", code=error.code, message=error.message, param=error.param)
    return encode_event(event, "error")


def routes() -> list[BaseRoute]:
    """This face's route table (``gateway.http.routes`` collects it)."""
    return [Route("/v1/responses", responses_endpoint, methods=["POST"])]
