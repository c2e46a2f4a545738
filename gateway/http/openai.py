"""HTTP routes of the OpenAI face: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /healthz``. Bodies are parsed and answers rendered by
``gateway.protocols.openai``; the path in between is ``gateway.service.pipeline``'s. Errors before the
response starts go to the app's handler (OpenAI error JSON); after it, an in-band error chunk.
Reference: https://platform.openai.com/docs/api-reference/chat
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.core.errors import APIError, ModelNotFoundError, openai_error_body
from gateway.core.event_stream import DONE, encode_event
from gateway.core.events import Delta, Finish
from gateway.core.request import ChatRequest
from gateway.http.auth import authenticate, authorize, visible_models
from gateway.http.body import read_json_object
from gateway.http.request_context import begin, gateway_of, run_unless_disconnected, started_at
from gateway.protocols.openai.parse import parse_chat_request, parse_completion_request
from gateway.protocols.openai.render import (
    ResponseMeta,
    chat_chunk,
    chat_completion_body,
    completion_body,
    completion_chunk,
    merge_tool_call_deltas,
    usage_chunk,
)
from gateway.service.gateway import Gateway
from gateway.service.pipeline import OpenedStream, open_stream
from gateway.transport.sse import EventStreamResponse


async def chat_sse(opened: OpenedStream, meta: ResponseMeta) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed chat completion (role chunk, text chunks, finish chunk, usage, [DONE])."""
    first = opened.first_event
    starts_with_tools = isinstance(first, Delta) and bool(first.tool_calls) and not first.text
    role: dict[str, Any] = {
        "role": "assistant",
        "content": None if starts_with_tools else "",
        "refusal": None,
    }
    yield encode_event(chat_chunk(meta, role))
    async with aclosing(_guarded(opened)) as events:
        async for event in events:
            if isinstance(event, Delta):
                delta: dict[str, Any] = {}
                if event.text:
                    delta["content"] = event.text
                if event.tool_calls:
                    delta["tool_calls"] = event.tool_calls
                if delta:
                    yield encode_event(chat_chunk(meta, delta))
            elif isinstance(event, Finish):
                yield encode_event(chat_chunk(meta, {}, event.finish_reason))
                if opened.request.include_usage:
                    yield encode_event(usage_chunk(meta, "chat.completion.chunk", event.usage))
                yield DONE
            else:
                yield event  # an error event, already encoded by _guarded


async def completion_sse(opened: OpenedStream, meta: ResponseMeta) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed legacy completion."""
    async with aclosing(_guarded(opened)) as events:
        async for event in events:
            if isinstance(event, Delta):
                if event.text:
                    yield encode_event(completion_chunk(meta, event.text))
            elif isinstance(event, Finish):
                yield encode_event(completion_chunk(meta, "", event.finish_reason))
                if opened.request.include_usage:
                    yield encode_event(usage_chunk(meta, "text_completion", event.usage))
                yield DONE
            else:
                yield event


def _guarded(opened: OpenedStream) -> AsyncIterator[Any]:
    """The stream's events; an API error after the response started becomes one ``data: {"error": ...}``
    event (what OpenAI sends mid-stream; the SDK raises it) and ends the stream."""
    return opened.guarded_events(lambda error: encode_event(openai_error_body(error)))


# ---- handlers --------------------------------------------------------------------------------------------


async def chat_completions(http_request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    request = parse_chat_request(body, http_request.headers)
    authorize(http_request, request, key)
    return await _serve(http_request, request, chat_sse, _collect_chat)


async def completions(http_request: Request) -> Response:
    """``POST /v1/completions`` (one string prompt)."""
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    request = parse_completion_request(body, http_request.headers)
    authorize(http_request, request, key)
    return await _serve(http_request, request, completion_sse, _collect_completion)


async def _serve(http_request: Request, request: ChatRequest, sse, collect) -> Response:
    gateway = gateway_of(http_request)
    begin(http_request, request)
    opened = await open_stream(gateway, request, http_request.url.path, started_at(http_request))
    meta = ResponseMeta(request, gateway.registry.get(request.model).system_fingerprint())
    if request.stream:
        return EventStreamResponse(sse(opened, meta), headers={"x-request-id": request.request_id})
    body = await run_unless_disconnected(http_request, collect(opened, meta), opened)
    return JSONResponse(body, headers={"x-request-id": request.request_id})


async def _collect_chat(opened: OpenedStream, meta: ResponseMeta) -> dict[str, Any]:
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async for event in opened.events():
        if isinstance(event, Delta):
            text.append(event.text)
            if event.tool_calls:
                merge_tool_call_deltas(calls, event.tool_calls)
        elif isinstance(event, Finish):
            return chat_completion_body(meta, "".join(text), [calls[i] for i in sorted(calls)], event)
    raise APIError("The backend ended the response without a finish.")


async def _collect_completion(opened: OpenedStream, meta: ResponseMeta) -> dict[str, Any]:
    text: list[str] = []
    async for event in opened.events():
        if isinstance(event, Delta):
            text.append(event.text)
        elif isinstance(event, Finish):
            return completion_body(meta, "".join(text), event)
    raise APIError("The backend ended the response without a finish.")


async def list_models(http_request: Request) -> Response:
    """``GET /v1/models``: the configured model names."""
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    data = [_model_object(gateway, name) for name in visible_models(http_request, key)]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(http_request: Request) -> Response:
    """``GET /v1/models/{model}``; 404 ``model_not_found`` for an unknown name."""
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    name = http_request.path_params["model"]
    gateway.registry.get(name)
    if name not in visible_models(http_request, key):
        raise ModelNotFoundError(name)
    return JSONResponse(_model_object(gateway, name))


def _model_object(gateway: Gateway, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": gateway.created, "owned_by": "prefixgate"}


async def healthz(http_request: Request) -> Response:
    """``GET /healthz``: 200 ``{"status": "ok", "models": [...]}`` once every backend has started."""
    gateway = gateway_of(http_request)
    return JSONResponse({"status": "ok", "models": gateway.registry.names()})


def routes() -> list[BaseRoute]:
    """This face's route table."""
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
