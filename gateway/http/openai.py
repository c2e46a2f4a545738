"""HTTP routes of the OpenAI face: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /healthz``. Bodies are parsed and answers rendered by
``gateway.protocols.openai``; the path in between is ``gateway.service.pipeline``'s. Errors before the
response starts go to the app's handler (OpenAI error JSON); after it, an in-band error chunk. Chat answers
carry ``x-prefixgate-cache`` (``OpenedStream.cache_header``) when the cached count is known.
Reference: https://platform.openai.com/docs/api-reference/chat
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from gateway.core.errors import APIError, ModelNotFoundError, openai_error_body
from gateway.core.event_stream import DONE, encode_event
from gateway.core.events import BackendEvent, Delta, Finish, TokenLogprob
from gateway.core.request import ChatRequest
from gateway.core.token_spelling import TokenSpelling
from gateway.http.anthropic_models import model_object as anthropic_model_object
from gateway.http.anthropic_models import model_page, wants_anthropic_shape
from gateway.http.auth import authenticate, authorize, visible_models
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
from gateway.protocols.openai.parse import parse_chat_request, parse_completion_request
from gateway.protocols.openai.render import (
    ContentChunkFrames,
    ResponseMeta,
    chat_choice,
    chat_chunk,
    chat_completion_body,
    chat_logprobs,
    choice_count,
    completion_body,
    completion_chunk,
    completion_logprobs,
    finish_reason_of,
    merge_tool_call_deltas,
    usage_chunk,
)
from gateway.service.gateway import Gateway
from gateway.service.pipeline import OpenedStream
from gateway.transport.sse import EventStreamResponse


async def chat_sse(opened: OpenedStream, meta: ResponseMeta) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed chat completion (role chunk per choice, text / tool-call chunks with their
    choice's ``index`` and logprobs, a finish chunk per choice, usage once, [DONE])."""
    first = opened.first_event
    starts_with_tools = isinstance(first, Delta) and bool(first.tool_calls) and not first.text
    choices = opened.request.params.n
    frames = ContentChunkFrames(meta)
    for index in range(choices):
        role: dict[str, Any] = {
            "role": "assistant",
            "content": None if starts_with_tools and index == first.index else "",
            "refusal": None,
        }
        yield encode_event(chat_chunk(meta, role, index=index))
    async with aclosing(_guarded(opened)) as events:
        async for event in events:
            if isinstance(event, Delta):
                if event.text and not event.tool_calls and not event.logprobs:  # a token's text: most events
                    yield frames.content(event.text, event.index)
                    continue
                delta: dict[str, Any] = {}
                if event.text:
                    delta["content"] = event.text
                if event.tool_calls:
                    delta["tool_calls"] = event.tool_calls
                logprobs = chat_logprobs(event.logprobs) if event.logprobs else None
                if delta or logprobs:
                    yield encode_event(chat_chunk(meta, delta, index=event.index, logprobs=logprobs))
            elif isinstance(event, Finish):
                for index in range(choice_count(event)):
                    yield encode_event(chat_chunk(meta, {}, finish_reason_of(event, index), index=index))
                if opened.request.include_usage:
                    yield encode_event(usage_chunk(meta, "chat.completion.chunk", event.usage))
                yield DONE
            else:
                yield event  # an error event, already encoded by _guarded


async def completion_sse(opened: OpenedStream, meta: ResponseMeta) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed legacy completion (chunks carry their choice's ``index``)."""
    spellings: dict[int, TokenSpelling] = {}  # choice -> its tokens so far (logprobs' text_offset)
    async with aclosing(_guarded(opened)) as events:
        async for event in events:
            if isinstance(event, Delta):
                if event.text or event.logprobs:
                    logprobs = None
                    if event.logprobs:
                        spelling = spellings.setdefault(event.index, TokenSpelling())
                        logprobs = completion_logprobs(event.logprobs, spelling)
                    yield encode_event(
                        completion_chunk(meta, event.text, index=event.index, logprobs=logprobs)
                    )
            elif isinstance(event, Finish):
                for index in range(choice_count(event)):
                    yield encode_event(
                        completion_chunk(meta, "", finish_reason_of(event, index), index=index)
                    )
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
    request = parse_chat_request(body, http_request.headers, refuse_unknown_fields(gateway))
    authorize(http_request, request, key)
    return await _serve(http_request, request, chat_sse, _collect_chat)


async def completions(http_request: Request) -> Response:
    """``POST /v1/completions`` (one string prompt)."""
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    request = parse_completion_request(body, http_request.headers, refuse_unknown_fields(gateway))
    authorize(http_request, request, key)
    return await _serve(http_request, request, completion_sse, _collect_completion)


async def _serve(http_request: Request, request: ChatRequest, sse, collect) -> Response:
    gateway = gateway_of(http_request)
    begin(http_request, request)
    path = http_request.scope["path"]  # what ``url.path`` gives for this route's fixed path, without the URL
    opened = await open_unless_disconnected(http_request, gateway, request, path, started_at(http_request))
    meta = ResponseMeta(request, gateway.registry.get(request.model).system_fingerprint())
    headers = answer_headers(http_request, request, opened)
    if request.stream:
        headers.update(await opened.cache_header())
        return EventStreamResponse(sse(opened, meta), headers=headers)
    events = opened.events()
    body = await run_unless_disconnected(http_request, collect(opened, events, meta), opened)
    headers.update(await opened.cache_header())
    headers.update(opened.cost_headers())
    # the stream is closed once the answer is sent (the upstream connection drained and pooled, the request's
    # log line written): work that shapes nothing of the answer is kept off the client's wait
    return JSONAnswer(body, headers, events.aclose)  # type: ignore[attr-defined]


class JSONAnswer(Response):
    """A 200 JSON answer with the bytes and headers Starlette's ``JSONResponse(content, headers=headers)``
    sends (compact JSON, ``ensure_ascii=False``, NaN refused; ``headers`` lower-cased in order, then
    ``content-length`` and ``content-type: application/json``), followed by ``await after()`` once the body
    was sent (what a ``BackgroundTask`` of an async function does), without Starlette's per-response
    look-ups (docs/overhead.md, session 9).

    Raises (at construction):
        ValueError: a float that is NaN or infinite in ``content``; TypeError: a value JSON cannot hold.
    """

    media_type = "application/json"

    def __init__(
        self, content: Any, headers: Mapping[str, str], after: Callable[[], Awaitable[None]]
    ) -> None:
        self.status_code = 200
        self.background = None
        self.after = after
        self.body = _ANSWER_JSON.encode(content).encode("utf-8")
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.raw_headers.append((b"content-length", str(len(self.body)).encode("latin-1")))
        self.raw_headers.append((b"content-type", b"application/json"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})
        await self.after()


_ANSWER_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""``JSONResponse.render``'s ``json.dumps`` arguments, as one encoder (``json.dumps`` with arguments builds an
encoder per call)."""


async def _collect_chat(
    opened: OpenedStream, events: AsyncIterator[BackendEvent], meta: ResponseMeta
) -> dict[str, Any]:
    """The chat completion object, from ``events`` (``opened.events()``, left open at its ``Finish``)."""
    want_logprobs = opened.request.params.logprobs is not None
    text: dict[int, list[str]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    async for event in events:
        if isinstance(event, Delta):
            text.setdefault(event.index, []).append(event.text)
            logprobs.setdefault(event.index, []).extend(event.logprobs)
            if event.tool_calls:
                merge_tool_call_deltas(calls.setdefault(event.index, {}), event.tool_calls)
        elif isinstance(event, Finish):
            choices = []
            for index in range(choice_count(event)):
                merged = calls.get(index, {})
                choices.append(
                    chat_choice(
                        index,
                        "".join(text.get(index, [])),
                        [merged[i] for i in sorted(merged)],
                        event,
                        logprobs.get(index, []) if want_logprobs else None,
                    )
                )
            body = chat_completion_body(meta, "", [], event, more_choices=choices[1:])
            body["choices"][0] = choices[0]
            return body
    raise APIError("The backend ended the response without a finish.")


async def _collect_completion(
    opened: OpenedStream, events: AsyncIterator[BackendEvent], meta: ResponseMeta
) -> dict[str, Any]:
    """The completion object, from ``events`` (``opened.events()``, left open at its ``Finish``)."""
    want_logprobs = opened.request.params.logprobs is not None
    text: dict[int, list[str]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    async for event in events:
        if isinstance(event, Delta):
            text.setdefault(event.index, []).append(event.text)
            logprobs.setdefault(event.index, []).extend(event.logprobs)
        elif isinstance(event, Finish):
            count = choice_count(event)
            texts = ["".join(text.get(index, [])) for index in range(count)]
            per_choice = [logprobs.get(index, []) for index in range(count)] if want_logprobs else None
            return completion_body(meta, texts, event, per_choice)
    raise APIError("The backend ended the response without a finish.")


async def list_models(http_request: Request) -> Response:
    """``GET /v1/models``: the configured model names; in Anthropic's paged shape for a request with
    ``anthropic-version`` (``gateway.http.anthropic_models``).

    Raises:
        InvalidRequestError: Anthropic's paging parameters out of range or naming no model.
    """
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    names = visible_models(http_request, key)
    if wants_anthropic_shape(http_request.url.path, http_request.headers):
        return JSONResponse(model_page(names, gateway.created, http_request.query_params))
    return JSONResponse({"object": "list", "data": [_model_object(gateway, name) for name in names]})


async def retrieve_model(http_request: Request) -> Response:
    """``GET /v1/models/{model}``; 404 ``model_not_found`` for an unknown name (both shapes, as
    ``list_models``)."""
    key = authenticate(http_request)
    gateway = gateway_of(http_request)
    name = http_request.path_params["model"]
    gateway.registry.get(name)
    if name not in visible_models(http_request, key):
        raise ModelNotFoundError(name)
    if wants_anthropic_shape(http_request.url.path, http_request.headers):
        return JSONResponse(anthropic_model_object(name, gateway.created))
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
