"""The OpenAI face: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/healthz``.

Bodies are validated into a ``ChatRequest`` with OpenAI's error shapes (param named, codes
``missing_required_parameter``, ``invalid_type``, ``invalid_value``, ``unknown_parameter``); responses and
SSE chunks follow the API reference (https://platform.openai.com/docs/api-reference/chat) and the recorded
streams in ``shared/fixtures/protocol/openai``: a first chunk with the assistant role, one chunk per text
piece, a chunk with ``finish_reason`` and an empty delta, with ``stream_options.include_usage`` a last chunk
with empty ``choices`` and ``usage``, then ``data: [DONE]``. ``usage.prompt_tokens_details.cached_tokens`` is
reported in both modes.

prefixgate extensions: header ``x-prefixgate-rules: on|off`` (rules opt-out), header ``x-prefixgate-tenant``
(cache salt: tenants never share cached prefixes), body field ``top_k`` (int >= 0).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from engine.api import SamplingParams
from gateway.backends.base import BackendUsage, Delta, Finish
from gateway.body import read_json_object
from gateway.canonical import rules_enabled
from gateway.errors import APIError, InvalidRequestError, openai_error_body
from gateway.pipeline import OpenedStream, begin, open_stream, run_unless_disconnected
from gateway.request import ChatRequest
from gateway.sse import DONE, EventStreamResponse, encode_event
from gateway.state import Gateway, gateway_of

TENANT_HEADER = "x-prefixgate-tenant"
MAX_TENANT_CHARS = 256
MAX_STOP_SEQUENCES = 4

CHAT_FIELDS = frozenset(
    {
        "model", "messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "stop",
        "seed", "user", "n", "stream", "stream_options", "tools", "tool_choice",
        # accepted and passed on (upstreams); the embedded backend refuses values it cannot honour
        "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format",
        "parallel_tool_calls", "metadata", "store", "service_tier", "modalities", "audio", "prediction",
        "reasoning_effort", "functions", "function_call", "web_search_options", "verbosity",
        "prompt_cache_key", "safety_identifier",
    }
)  # fmt: skip
COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "user", "n", "stream",
        "stream_options", "echo", "suffix", "logprobs", "best_of", "presence_penalty", "frequency_penalty",
        "logit_bias",
    }
)  # fmt: skip
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's documented default of ``max_tokens`` for ``/v1/completions`` (chat has no default: up to the
context window)."""


# ---- parsing ---------------------------------------------------------------------------------------------


def parse_chat_request(body: dict[str, Any], headers: Mapping[str, str]) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body into a ``ChatRequest``.

    Raises:
        InvalidRequestError: a missing, unknown or ill-typed field, or a value out of range (``n`` != 1...).
    """
    _reject_unknown(body, CHAT_FIELDS)
    model = _model(body)
    messages = _messages(body)
    tools = _tools(body)
    stream, include_usage = _stream(body)
    max_tokens = _optional_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", minimum=1)
    return ChatRequest(
        model=model,
        messages=messages,
        params=_sampling(body, max_tokens),
        tools=tools,
        tool_choice=body.get("tool_choice"),
        stream=stream,
        include_usage=include_usage,
        user=_optional_str(body, "user"),
        tenant=tenant(headers),
        protocol="openai",
        kind="chat",
        body=body,
        rules_enabled=rules_enabled(headers),
    )


def parse_completion_request(body: dict[str, Any], headers: Mapping[str, str]) -> ChatRequest:
    """Validate a ``/v1/completions`` body (a single string prompt) into a ``ChatRequest`` of kind completion.

    Raises:
        InvalidRequestError: as ``parse_chat_request``; also a prompt that is not one string.
    """
    _reject_unknown(body, COMPLETION_FIELDS)
    model = _model(body)
    if "prompt" not in body:
        raise _missing("prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequestError(
            "Invalid 'prompt': prefixgate accepts one string prompt per request.", param="prompt", code="invalid_type"
        )
    stream, include_usage = _stream(body)
    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    return ChatRequest(
        model=model,
        messages=[],
        params=_sampling(body, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens),
        stream=stream,
        include_usage=include_usage,
        user=_optional_str(body, "user"),
        tenant=tenant(headers),
        protocol="openai",
        kind="completion",
        prompt=prompt,
        body=body,
        rules_enabled=rules_enabled(headers),
    )


def tenant(headers: Mapping[str, str]) -> str:
    """The cache salt from ``x-prefixgate-tenant`` ("" when absent).

    Raises:
        InvalidRequestError: longer than 256 characters.
    """
    value = headers.get(TENANT_HEADER, "")
    if len(value) > MAX_TENANT_CHARS:
        raise InvalidRequestError(
            f"Header {TENANT_HEADER} is longer than {MAX_TENANT_CHARS} characters.",
            param=TENANT_HEADER,
            code="invalid_value",
        )
    return value


def _reject_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter"
            )


def _model(body: dict[str, Any]) -> str:
    if "model" not in body:
        raise _missing("model")
    model = body["model"]
    if not isinstance(model, str) or not model:
        raise _invalid_type("model", "a non-empty string", model)
    return model


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" not in body:
        raise _missing("messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _invalid_type("messages", "an array", messages)
    if not messages:
        raise InvalidRequestError(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
            param="messages",
            code="empty_array",
        )
    return [_message(message, index) for index, message in enumerate(messages)]


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _invalid_type(where, "an object", message)
    if "role" not in message:
        raise _missing(f"{where}.role")
    role = message["role"]
    if role not in ROLES:
        raise InvalidRequestError(
            f"Invalid value: '{role}'. Supported values are: {', '.join(sorted(ROLES))}.",
            param=f"{where}.role",
            code="invalid_value",
        )
    content = message.get("content")
    has_tool_calls = role == "assistant" and bool(message.get("tool_calls"))
    if content is None:
        if not (has_tool_calls or (role == "assistant" and "function_call" in message)):
            raise _missing(f"{where}.content")
    elif isinstance(content, list):
        for part_index, part in enumerate(content):
            _content_part(part, f"{where}.content[{part_index}]")
    elif not isinstance(content, str):
        raise _invalid_type(f"{where}.content", "a string or array of content parts", content)
    if "name" in message and not isinstance(message["name"], str):
        raise _invalid_type(f"{where}.name", "a string", message["name"])
    if role == "tool":
        if "tool_call_id" not in message:
            raise _missing(f"{where}.tool_call_id")
        if not isinstance(message["tool_call_id"], str):
            raise _invalid_type(f"{where}.tool_call_id", "a string", message["tool_call_id"])
    if "tool_calls" in message and message["tool_calls"] is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise _invalid_type(f"{where}.tool_calls", "an array of objects", calls)
    return message


def _content_part(part: Any, where: str) -> None:
    if not isinstance(part, dict):
        raise _invalid_type(where, "an object", part)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise _missing(f"{where}.type")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise _invalid_type(f"{where}.text", "a string", part.get("text"))


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _invalid_type("tools", "an array", tools)
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _invalid_type(where, "an object", tool)
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"Invalid value for '{where}.type': supported values are: 'function'.",
                param=f"{where}.type",
                code="invalid_value",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _missing(f"{where}.function")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _missing(f"{where}.function.name")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise _invalid_type(f"{where}.function.parameters", "an object", function["parameters"])
    return tools


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _invalid_type("stream", "a boolean", stream)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    if not isinstance(options, dict):
        raise _invalid_type("stream_options", "an object", options)
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _invalid_type("stream_options.include_usage", "a boolean", include_usage)
    return stream, include_usage


def _sampling(body: dict[str, Any], max_tokens: int | None) -> SamplingParams:
    n = _optional_int(body, "n", minimum=1)
    if n is not None and n != 1:
        raise InvalidRequestError(
            f"Invalid 'n': prefixgate generates one choice per request (n=1), got {n}.",
            param="n",
            code="invalid_value",
        )
    temperature = _optional_number(body, "temperature", 0.0, 2.0)
    top_p = _optional_number(body, "top_p", 0.0, 1.0)
    top_k = _optional_int(body, "top_k", minimum=0)
    seed = _optional_int(body, "seed")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
        seed=seed,
        stop=_stop(body),
    )
    if params.top_p == 0.0:
        # The nucleus of mass -> 0 is the single most likely token: greedy decoding.
        params = SamplingParams(**{**params.__dict__, "top_p": 1.0, "temperature": 0.0})
    return params


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _invalid_type("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(
            f"Invalid 'stop': array too long. Expected at most {MAX_STOP_SEQUENCES} items, got {len(stop)}.",
            param="stop",
            code="array_above_max_length",
        )
    if any(s == "" for s in stop):
        raise InvalidRequestError(
            "Invalid 'stop': stop sequences must not be empty.", param="stop", code="invalid_value"
        )
    return tuple(stop)


def _optional_int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid_type(name, "an integer", value)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(
            f"Invalid '{name}': integer below minimum value. Expected a value >= {minimum}, but got {value} instead.",
            param=name,
            code="integer_below_min_value",
        )
    return value


def _optional_number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid_type(name, "a number", value)
    if not low <= value <= high:
        raise InvalidRequestError(
            f"Invalid '{name}': expected a value between {low:g} and {high:g}, but got {value} instead.",
            param=name,
            code="invalid_value",
        )
    return float(value)


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid_type(name, "a string", value)
    return value


def _missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _invalid_type(param: str, expected: str, value: Any) -> InvalidRequestError:
    got = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), "null" if value is None else type(value).__name__)
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.", param=param, code="invalid_type"
    )


# ---- formatting ------------------------------------------------------------------------------------------


def usage_body(usage: BackendUsage) -> dict[str, Any]:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


class ResponseMeta:
    """The fields every response object and chunk of one request repeats."""

    def __init__(self, request: ChatRequest, system_fingerprint: str | None) -> None:
        prefix = "chatcmpl-" if request.kind == "chat" else "cmpl-"
        self.id = prefix + request.request_id
        self.created = int(time.time())
        self.model = request.model
        self.system_fingerprint = system_fingerprint

    def header(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}


def merge_tool_call_deltas(calls: dict[int, dict[str, Any]], fragments: list[dict[str, Any]]) -> None:
    """Fold streaming ``tool_calls`` fragments (by ``index``) into whole calls, as the OpenAI SDK does."""
    for fragment in fragments:
        index = fragment.get("index", len(calls))
        call = calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if fragment.get("id"):
            call["id"] = fragment["id"]
        if fragment.get("type"):
            call["type"] = fragment["type"]
        function = fragment.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]


def chat_completion_body(meta: ResponseMeta, text: str, tool_calls: list[dict[str, Any]], finish: Finish) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["annotations"] = []
    return {
        **meta.header("chat.completion"),
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish.finish_reason}
        ],
        "usage": usage_body(finish.usage),
        "service_tier": "default",
        "system_fingerprint": meta.system_fingerprint,
    }


def chat_chunk(meta: ResponseMeta, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with a single choice."""
    return {
        **meta.header("chat.completion.chunk"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(meta: ResponseMeta, object_name: str, usage: BackendUsage) -> dict[str, Any]:
    """The last chunk under ``include_usage``: empty ``choices`` and the request's ``usage``."""
    return {**meta.header(object_name), "system_fingerprint": meta.system_fingerprint, "choices": [], "usage": usage_body(usage)}


def completion_body(meta: ResponseMeta, text: str, finish: Finish) -> dict[str, Any]:
    """A whole ``text_completion`` object."""
    return {
        **meta.header("text_completion"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish.finish_reason}],
        "usage": usage_body(finish.usage),
    }


def completion_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return {
        **meta.header("text_completion"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }


async def chat_sse(opened: OpenedStream, meta: ResponseMeta) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed chat completion (role chunk, text chunks, finish chunk, usage, [DONE])."""
    first = opened.first_event
    starts_with_tools = isinstance(first, Delta) and bool(first.tool_calls) and not first.text
    role: dict[str, Any] = {"role": "assistant", "content": None if starts_with_tools else "", "refusal": None}
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
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    request = parse_chat_request(body, http_request.headers)
    return await _serve(http_request, request, chat_sse, _collect_chat)


async def completions(http_request: Request) -> Response:
    """``POST /v1/completions`` (one string prompt)."""
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    request = parse_completion_request(body, http_request.headers)
    return await _serve(http_request, request, completion_sse, _collect_completion)


async def _serve(http_request: Request, request: ChatRequest, sse, collect) -> Response:
    gateway = gateway_of(http_request)
    begin(http_request, request)
    opened = await open_stream(gateway, request, http_request)
    meta = ResponseMeta(request, getattr(gateway.registry.get(request.model), "system_fingerprint", None))
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
    gateway = gateway_of(http_request)
    data = [_model_object(gateway, name) for name in gateway.registry.names()]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(http_request: Request) -> Response:
    """``GET /v1/models/{model}``; 404 ``model_not_found`` for an unknown name."""
    gateway = gateway_of(http_request)
    name = http_request.path_params["model"]
    gateway.registry.get(name)
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
