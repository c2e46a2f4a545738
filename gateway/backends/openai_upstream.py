"""``backend: openai``: any OpenAI-compatible server (vLLM, SGLang, TGI, the OpenAI API) over HTTP.

Per request it POSTs ``{base_url}/chat/completions`` (``/completions`` for raw-prompt requests), always
streaming, on the replica the prefix-affinity ring picks, and turns the answer (SSE, or plain JSON) into
``Delta`` / ``Finish`` events. An OpenAI-face body is forwarded with the canonical messages and tools; an
Anthropic-face request is translated (``gateway.protocols.anthropic.strip``). ``prompt_cache_key`` = the
prefix key (which includes the tenant) unless the client set one, which is then salted with the tenant
(``gateway.core.keys.tenant_cache_key``); usage always requested. Details: docs/upstreams.md.
Reference: https://platform.openai.com/docs/api-reference/chat/create
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any, Unpack

from gateway.backends.base import refuse_choices_and_logprobs
from gateway.backends.upstream import UpstreamBackend, UpstreamOptions, error_body, upstream_settings
from gateway.config.schema import OpenAIUpstream
from gateway.core.events import BackendEvent, BackendUsage, Delta, Finish
from gateway.core.gateway_loops import VIA_HEADER, outgoing_via
from gateway.core.keys import tenant_cache_key
from gateway.core.request import SAMPLING_FIELDS, ChatRequest
from gateway.core.tokens import default_counter
from gateway.protocols.anthropic.strip import check_anthropic_only_fields, plain_messages, plain_tools
from gateway.protocols.anthropic.structured_outputs import anthropic_output_schema, openai_response_format
from gateway.protocols.provider_usage import UpstreamUsageError, deepseek_cache_usage, openai_cache_usage
from gateway.transport.failures import FailureKind
from gateway.transport.redact import redact_url
from gateway.transport.upstream_http import OpenedResponse

PROMPT_CACHE_KEY_MAX = 64  # characters OpenAI accepts in prompt_cache_key
STRUCTURED_OUTPUT_FIELDS = frozenset({"output_config", "output_format"})
"""Anthropic-only fields an Anthropic-face request to this backend may set: its output format becomes
``response_format`` (``structured_outputs.anthropic_output_schema``); ``output_config.effort`` is a 400."""


class OpenAIUpstreamBackend(UpstreamBackend):
    """A ``Backend`` forwarding to an OpenAI-compatible server.

    Args:
        name: the client-facing model name.
        base_urls: one base URL per replica, ending in the API root (``https://api.openai.com/v1``,
            ``http://vllm:8000/v1``).
        set_prompt_cache_key: send ``prompt_cache_key`` = prefix key when the client did not.
        prices: the model's prices (``gateway.config.price_table.ModelPrices``) or None.
        retention_chooser: ``request -> retention or None`` (the service's choice, attached by the app), for
            ``prompt_cache_retention`` where the client set none; None = never sent.
        cache_salt: the upstream (vLLM, SGLang) accepts ``cache_salt``: send the request's tenant in it.
        retention_auto: the config allows ``prompt_cache_retention`` to be chosen (``auto``).
        options: ``UpstreamBackend``'s (``api_key``, ``upstream_model``, ``timeout_s``, ``retries``,
            ``client``, ``ring``, ``sleep``); the key goes out as ``Authorization: Bearer`` (None sends none).

    Token counts (``count_tokens``) are the base's local estimate: OpenAI has no count endpoint.
    """

    estimate_target = "an OpenAI-compatible"

    def __init__(
        self,
        name: str,
        base_urls: Sequence[str],
        *,
        set_prompt_cache_key: bool = True,
        prices: Any = None,
        retention_chooser: Any = None,
        cache_salt: bool = False,
        retention_auto: bool = True,
        **options: Unpack[UpstreamOptions],
    ) -> None:
        super().__init__(name, base_urls, **options)
        self.set_prompt_cache_key = set_prompt_cache_key
        self.prices = prices
        self.retention_chooser = retention_chooser
        self.cache_salt = cache_salt
        self.tenant_isolated = cache_salt
        self.retention_auto = retention_auto

    # ---- request ------------------------------------------------------------------------------------------
    def build_body(self, request: ChatRequest) -> dict[str, Any]:
        """The JSON body sent upstream (always streaming, usage requested). An OpenAI-face chat body holds the
        request's canonical ``messages`` and ``tools`` themselves, not copies: the body is serialized once and
        read, never changed (copying them was a deep copy of the whole conversation per request).

        Raises:
            UnsupportedContentError: Anthropic-only content an OpenAI server cannot take.
        """
        if request.kind == "completion":
            body = copy.deepcopy(request.openai_body) if request.openai_body else {}
            body["prompt"] = request.prompt if request.prompt is not None else body.get("prompt", "")
            _fill_sampling(body, request, only_missing=bool(request.openai_body))
        elif request.openai_body:
            # the client's messages and tools are replaced below (in place, so key order stays): not copied
            body = {
                k: v if k in ("messages", "tools") else copy.deepcopy(v)
                for k, v in request.openai_body.items()
            }
            body["messages"] = without_empty_instructions(request.messages)
            if request.tools is not None:
                body["tools"] = request.tools
            else:
                body.pop("tools", None)
        else:
            body = self._translated_body(request)
        body["model"] = self.upstream_model
        body["stream"] = True
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        body["stream_options"] = {**options, "include_usage": True}
        if self.set_prompt_cache_key and request.prefix_key and "prompt_cache_key" not in body:
            body["prompt_cache_key"] = request.prefix_key[:PROMPT_CACHE_KEY_MAX]
        elif request.tenant and isinstance(body.get("prompt_cache_key"), str):
            body["prompt_cache_key"] = tenant_cache_key(request.tenant, body["prompt_cache_key"])
        if self.retention_chooser is not None and "prompt_cache_retention" not in body:
            retention = self.retention_chooser(request)
            if retention is not None:
                body["prompt_cache_retention"] = retention
        body.pop("cache_salt", None)  # the client's is in request.tenant (gateway.http.auth)
        if self.cache_salt and request.tenant:
            body["cache_salt"] = request.tenant
        return body

    def _translated_body(self, request: ChatRequest) -> dict[str, Any]:
        schema = None
        if request.anthropic_body is not None:  # Anthropic-only fields: a 400, never silently dropped
            target = "an OpenAI-compatible upstream"
            check_anthropic_only_fields(request.anthropic_body, target, STRUCTURED_OUTPUT_FIELDS)
            schema = anthropic_output_schema(request.anthropic_body, target)
        body: dict[str, Any] = {
            "messages": without_empty_instructions(plain_messages(request.messages, "an OpenAI-compatible"))
        }
        if schema is not None:  # Anthropic's structured outputs: the same schema, strictly
            body["response_format"] = openai_response_format(schema)
        _fill_sampling(body, request, only_missing=False)
        tools = plain_tools(request.tools, "an OpenAI-compatible")
        if tools is not None:
            body["tools"] = tools
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice
        if request.parallel_tool_calls is False and tools:
            body["parallel_tool_calls"] = False
        if request.user:
            body["user"] = request.user
        return body

    def _headers(self) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream",
            VIA_HEADER: outgoing_via(),
        }
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    # ---- response -----------------------------------------------------------------------------------------
    async def stream_once(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """Yield ``Delta`` events then one ``Finish``.

        Raises:
            UpstreamCallError: the call failed before the first byte (after retries), or was refused (4xx).
            UpstreamStreamCut: the stream broke after the first byte.
            UnsupportedContentError: content the server cannot take (400).
        """
        refuse_choices_and_logprobs(request, "an OpenAI-compatible upstream")
        started = time.monotonic()
        body = self.build_body(request)
        path = "/completions" if request.kind == "completion" else "/chat/completions"
        opened = await self.post(
            request.prefix_key or request.request_id, path, self._headers(), body, request.tenant
        )
        request.upstream_request_id = opened.request_id
        request.replica = redact_url(opened.replica)
        try:
            if opened.content_type == "application/json":
                events = _events_from_json(opened, request, started)
            else:
                events = _events_from_sse(opened, request, started)
            retention = body.get("prompt_cache_retention")
            async with aclosing(events):  # closed here, not by the loop's async-generator finalizer (a task)
                async for event in events:
                    if isinstance(event, Finish) and isinstance(retention, str):
                        event = dataclasses.replace(event, cache_retention=retention)
                    yield event
        finally:
            await opened.aclose()


# ---- translation helpers -----------------------------------------------------------------------------------


def _fill_sampling(body: dict[str, Any], request: ChatRequest, only_missing: bool) -> None:
    params = request.params
    values: dict[str, Any] = {}
    if params.max_tokens is not None:
        values["max_tokens"] = params.max_tokens
    # an Anthropic client that left temperature / top_p unset gets the upstream's default, not Anthropic's
    for name in SAMPLING_FIELDS:
        if request.anthropic_body is None or name in request.sampling_given:
            values[name] = getattr(params, name)
    if params.top_k:
        values["top_k"] = params.top_k  # vLLM / SGLang / TGI extension
    if params.stop:
        values["stop"] = list(params.stop)
    if params.seed is not None:
        values["seed"] = params.seed
    for key, value in values.items():
        if not only_missing or key not in body:
            body[key] = value


def backend_usage(usage: dict[str, Any]) -> BackendUsage:
    """OpenAI ``usage`` -> BackendUsage (``cached_tokens`` / ``cache_write_tokens`` from
    ``prompt_tokens_details``; DeepSeek's ``prompt_cache_hit_tokens`` when that is what the upstream sends).

    Raises:
        UpstreamUsageError (a ValueError): a count that is not an integer >= 0 (the caller answers 502).
    """
    if "prompt_cache_hit_tokens" in usage and "prompt_tokens_details" not in usage:
        cache = deepseek_cache_usage(usage)
    else:
        cache = openai_cache_usage(usage)
    completion = usage.get("completion_tokens")
    if completion is not None and (
        isinstance(completion, bool) or not isinstance(completion, int) or completion < 0
    ):
        raise UpstreamUsageError("completion_tokens", completion)
    return BackendUsage(
        prompt_tokens=cache.prompt_tokens,
        completion_tokens=completion or 0,
        cached_tokens=cache.cache_read_tokens,
        cache_creation_tokens=cache.written,
        counted_by="upstream",
    )


def _counted_usage(request: ChatRequest, completion_text: str) -> BackendUsage:
    counter = default_counter()
    if request.kind == "completion":
        prompt_text = request.prompt or ""
    else:
        prompt_text = json.dumps(request.messages, ensure_ascii=False)
    return BackendUsage(
        prompt_tokens=counter.count(prompt_text),
        completion_tokens=counter.count(completion_text),
        counted_by=counter.counted_by,
    )


def _chunk_choice(choice: dict[str, Any], kind: str) -> tuple[str, Any, str | None, dict[str, Any]]:
    """One choice of a streamed chunk: (text, tool-call deltas, finish reason, matched stop string).

    Raises:
        AttributeError / TypeError: the choice is not shaped like an OpenAI chunk choice (the caller turns
            that into a protocol cut).
    """
    if kind == "completion":
        text, calls = choice.get("text") or "", None
    else:
        delta = choice.get("delta") or {}
        text, calls = delta.get("content") or "", delta.get("tool_calls")
    if not isinstance(text, str) or not (calls is None or isinstance(calls, list)):
        raise TypeError("content is not a string or tool_calls not a list")
    finish = choice.get("finish_reason")
    return text, calls, finish or None, _stop_sequence(choice) if finish else None


def _stop_sequence(choice: dict[str, Any]) -> str | None:
    stop = choice.get("stop_reason")  # vLLM: the stop string that matched (or a token id)
    return stop if isinstance(stop, str) else None


async def _events_from_sse(
    opened: OpenedResponse, request: ChatRequest, started: float
) -> AsyncIterator[BackendEvent]:
    finish_reason: str | None = None
    stop_sequence: str | None = None
    usage: BackendUsage | None = None
    ttft: float | None = None
    done = False
    text_parts: list[str] = []
    async with aclosing(opened.events()) as events:
        async for event in events:
            if event.data.strip() == "[DONE]":
                done = True
                opened.completed()
                break
            chunk = opened.json_object(event.data, "a chunk")
            error = error_body(chunk)
            if error is not None:
                raise opened.cut(
                    f"the upstream reported an error mid-stream: {error['message']}", upstream_error=error
                )
            try:
                if isinstance(chunk.get("usage"), dict):
                    usage = backend_usage(chunk["usage"])
                pieces = [_chunk_choice(choice, request.kind) for choice in chunk.get("choices") or []]
            except (AttributeError, TypeError, ValueError):
                raise opened.cut(
                    "the upstream sent a chunk that is not a completion chunk", kind=FailureKind.PROTOCOL
                ) from None
            for text, calls, choice_finish, choice_stop in pieces:
                if text or calls:
                    if ttft is None:
                        ttft = time.monotonic() - started
                    text_parts.append(text)
                    yield Delta(text=text, tool_calls=calls)
                if choice_finish:
                    finish_reason, stop_sequence = choice_finish, choice_stop
    if finish_reason is None or not (done or usage is not None):
        raise opened.cut("the upstream stream ended before its final chunk")
    if usage is None:
        usage = _counted_usage(request, "".join(text_parts))
    yield Finish(finish_reason, usage, ttft, stop_sequence=stop_sequence, replica=redact_url(opened.replica))


async def _events_from_json(
    opened: OpenedResponse, request: ChatRequest, started: float
) -> AsyncIterator[BackendEvent]:
    raw = await opened.read()
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    error = error_body(data)
    if error is not None:  # an error answered as JSON (with 200): the upstream's own words
        raise opened.cut(f"the upstream answered an error: {error['message']}", upstream_error=error)
    try:
        choice = data["choices"][0]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        raise opened.cut(
            "the upstream answered JSON that is not a completion", kind=FailureKind.PROTOCOL
        ) from None
    ttft = time.monotonic() - started
    try:
        if request.kind == "completion":
            text, calls = choice.get("text") or "", None
        else:
            message = choice.get("message") or {}
            text = message.get("content") or ""
            calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or [])] or None
        if not isinstance(text, str):
            raise TypeError("content is not a string")
        usage = (
            backend_usage(data["usage"])
            if isinstance(data.get("usage"), dict)
            else _counted_usage(request, text)
        )
        stop_sequence = _stop_sequence(choice)
        reason = choice.get("finish_reason") or "stop"
    except (AttributeError, TypeError, ValueError):
        raise opened.cut(
            "the upstream answered JSON that is not a completion", kind=FailureKind.PROTOCOL
        ) from None
    if text or calls:
        yield Delta(text=text, tool_calls=calls)
    yield Finish(reason, usage, ttft, stop_sequence=stop_sequence, replica=redact_url(opened.replica))


# ---- registry ----------------------------------------------------------------------------------------------


def create_openai_backend(model: OpenAIUpstream) -> OpenAIUpstreamBackend:
    """The backend of a ``backend: openai`` model entry."""
    return OpenAIUpstreamBackend(
        **upstream_settings(model),
        set_prompt_cache_key=model.prompt_cache_key,
        prices=model.prices,
        cache_salt=model.cache_salt,
        retention_auto=model.prompt_cache_retention == "auto",
    )


def without_empty_instructions(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` without the ``system`` / ``developer`` messages that hold no text: ``""``, null, or only
    empty text parts (a system prompt the rules hoisted whole, such as a lone ``Current date:`` line; an
    OpenAI-compatible server may refuse an empty text part, as Anthropic's API does). The same list object
    when there is none (the common request is not copied); the messages themselves are never changed."""

    def empty(message: dict[str, Any]) -> bool:
        if message.get("role") not in ("system", "developer"):
            return False
        content = message.get("content")
        if content is None or content == "":
            return True
        return isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and part.get("text") == ""
            for part in content
        )

    if not any(empty(m) for m in messages):
        return messages
    return [m for m in messages if not empty(m)]
