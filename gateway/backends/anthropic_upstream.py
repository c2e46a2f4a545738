"""``backend: anthropic``: the Anthropic Messages API (or a server speaking it) over HTTP.

Per request it POSTs ``{base_url}/v1/messages`` with ``x-api-key`` and ``anthropic-version`` on the replica the
prefix-affinity ring picks. Two ways in:

- **Native passthrough** (Anthropic-face requests): the client's body is kept (``thinking``, ``metadata``,
  ``service_tier``, ... untouched), its ``system`` / ``messages`` / ``tools`` replaced by the canonical ones
  translated back (``anthropic_face.openai_to_anthropic``; exactly the client's own when rules are off),
  ``model`` mapped to ``upstream_model``, and automatic cache breakpoints added
  (``gateway.breakpoints``; the client's ``cache_control``, ``ttl`` included, stays as it was). ``stream``
  yields ``anthropic_face.NativeDelta`` events carrying the upstream's own events (or whole Message), which the
  Anthropic face relays verbatim: thinking, citations, server tools and signatures survive.
- **Translation** (OpenAI-face requests): the request is built from the ``ChatRequest`` fields, and ``stream``
  turns Anthropic events into ``Delta`` / ``Finish`` (text and tool use; thinking and server-tool blocks are
  not part of an OpenAI answer and are left out).

Usage: ``cache_read_input_tokens`` -> ``BackendUsage.cached_tokens``, ``cache_creation_input_tokens`` ->
``cache_creation_tokens``, ``prompt_tokens`` = input + cache read + cache write (Anthropic's ``input_tokens``
excludes both).
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Unpack

from gateway.anthropic_face import (
    FINISH_REASONS,
    FORWARDED_HEADERS,
    AnthropicPrompt,
    NativeDelta,
    backend_usage_from_anthropic,
    openai_to_anthropic,
    openai_to_anthropic_tool_choice,
)
from gateway.backends.base import BackendEvent, Delta, Finish
from gateway.backends.registry import register_backend
from gateway.backends.upstream import UpstreamBackend, UpstreamOptions, upstream_settings
from gateway.breakpoints import (
    BreakpointPlan,
    TokenCounter,
    add_breakpoints,
    boundaries_from_segments,
    default_boundaries,
)
from gateway.config import ModelConfig
from gateway.errors import InvalidRequestError
from gateway.request import ChatRequest
from gateway.upstream_http import OpenedResponse, redact_url

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` sent for OpenAI-face requests that set none (the Messages API requires one)."""


class AnthropicUpstreamBackend(UpstreamBackend):
    """A ``Backend`` forwarding to the Anthropic Messages API.

    Args:
        name: the client-facing model name.
        base_urls: one base URL per replica (``https://api.anthropic.com``); ``/v1/messages`` is appended.
        anthropic_version: the ``anthropic-version`` header.
        auto_breakpoints: add cache breakpoints at the segment boundaries.
        min_tokens_overrides: model-name prefix -> minimum cacheable tokens (before the built-in table).
        counter: token counter for the thresholds (default ``breakpoints.default_counter()``).
        options: ``UpstreamBackend``'s (``api_key``, ``upstream_model``, ``timeout_s``, ``retries``, ``client``,
            ``ring``, ``sleep``); the key goes out as ``x-api-key``; ``upstream_model`` also picks the minimum
            cacheable length.
    """

    def __init__(
        self,
        name: str,
        base_urls: Sequence[str],
        *,
        anthropic_version: str = ANTHROPIC_VERSION,
        auto_breakpoints: bool = True,
        min_tokens_overrides: Mapping[str, int] | None = None,
        counter: TokenCounter | None = None,
        **options: Unpack[UpstreamOptions],
    ) -> None:
        super().__init__(name, base_urls, **options)
        self.anthropic_version = anthropic_version
        self.auto_breakpoints = auto_breakpoints
        self.min_tokens_overrides = dict(min_tokens_overrides or {})
        self.counter = counter

    # ---- request ------------------------------------------------------------------------------------------
    def build_body(self, request: ChatRequest, stream: bool) -> tuple[dict[str, Any], BreakpointPlan | None]:
        """The Messages body sent upstream, and the breakpoint plan (None when automatic breakpoints are off).

        Raises:
            InvalidRequestError / UnsupportedContentError: content Anthropic cannot carry (OpenAI-face requests).
        """
        if request.kind != "chat":
            raise InvalidRequestError(
                "Anthropic models serve chat requests only; use /v1/chat/completions or /v1/messages.",
                param="prompt",
            )
        prompt = None
        if request.protocol == "anthropic" and request.body:
            # with rules on, system / messages / tools are replaced below (in place, key order kept): not copied
            replaced = ("system", "messages", "tools") if request.rules_enabled else ()
            body = {k: v if k in replaced else copy.deepcopy(v) for k, v in request.body.items()}
            if request.rules_enabled:
                prompt = openai_to_anthropic(request.messages, request.tools)
                _set_or_drop(body, "system", prompt.system)
                body["messages"] = prompt.messages
                _set_or_drop(body, "tools", prompt.tools)
            # rules off: system / messages / tools go exactly as the client sent them
        else:
            prompt = openai_to_anthropic(request.messages, request.tools)
            body = self._translated_body(request, prompt)
        body["model"] = self.upstream_model
        body["stream"] = stream
        plan = None
        if self.auto_breakpoints:
            boundaries = self._boundaries(request, body, prompt)
            body, plan = add_breakpoints(
                body,
                boundaries,
                self.upstream_model,
                min_tokens_overrides=self.min_tokens_overrides,
                counter=self.counter,
            )
        return body, plan

    @staticmethod
    def _boundaries(
        request: ChatRequest, body: dict[str, Any], prompt: AnthropicPrompt | None
    ) -> dict[str, Any]:
        """Segment ends from the rules when the body was built from the canonical messages, else read off the
        body (rules off)."""
        segments = getattr(request.canonical, "segments", None)
        if segments and prompt is not None:
            return boundaries_from_segments(
                segments, prompt.part_blocks, prompt.last_block, len(body.get("tools") or [])
            )
        return default_boundaries(body)

    def _translated_body(self, request: ChatRequest, prompt: Any) -> dict[str, Any]:
        params = request.params
        body: dict[str, Any] = {
            "model": self.upstream_model,
            "max_tokens": params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS,
            "messages": prompt.messages,
        }
        if prompt.system is not None:
            body["system"] = prompt.system
        if prompt.tools is not None:
            body["tools"] = prompt.tools
            parallel = request.body.get("parallel_tool_calls") if request.protocol == "openai" else None
            choice = openai_to_anthropic_tool_choice(request.tool_choice, parallel)
            if choice is not None:
                body["tool_choice"] = choice
        native = request.body if request.protocol == "openai" else {}
        if native.get("temperature") is not None:
            body["temperature"] = params.temperature
        if native.get("top_p") is not None:
            body["top_p"] = params.top_p
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop_sequences"] = list(params.stop)
        if request.user:
            body["metadata"] = {"user_id": request.user}
        return body

    def _headers(self, request: ChatRequest) -> dict[str, str]:
        headers = {"content-type": "application/json", "anthropic-version": self.anthropic_version}
        if self.api_key:
            headers["x-api-key"] = self.api_key
        for name in FORWARDED_HEADERS:
            if request.forward_headers.get(name):
                headers[name] = request.forward_headers[name]
        return headers

    async def _open(self, request: ChatRequest, stream: bool) -> OpenedResponse:
        body, _ = self.build_body(request, stream)
        return await self.post(
            request.prefix_key or request.request_id, "/v1/messages", self._headers(request), body
        )

    # ---- the backend stream ------------------------------------------------------------------------------------
    async def stream(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """Yield ``Delta`` events then one ``Finish``.

        Anthropic-face requests get ``NativeDelta`` events carrying the upstream's own events (a streamed request:
        every event from ``message_start`` to ``message_stop``; a non-streamed one: the whole Message), and a
        ``Finish`` with ``extra["native"] = True``. Others get text and tool-call deltas in OpenAI's streaming
        shape (thinking and server-tool blocks are not part of an OpenAI answer and are left out).

        Raises:
            UpstreamCallError: failed before the first byte (after retries), or refused (4xx passes through).
            UpstreamStreamCut: broke off after the first byte, or an ``error`` event arrived (its
                ``upstream_error`` is the upstream's ``error`` object).
            InvalidRequestError / UnsupportedContentError: content Anthropic cannot carry.
        """
        native = request.protocol == "anthropic" and bool(request.body)
        started = time.monotonic()
        if native and not request.stream:
            message = await self._message(request)
            text = "".join(b.get("text", "") for b in message.get("content") or [] if b.get("type") == "text")
            yield NativeDelta(text=text, events=(message,))
            yield Finish(
                FINISH_REASONS.get(message.get("stop_reason") or "", "stop"),
                backend_usage_from_anthropic(message.get("usage") or {}),
                time.monotonic() - started,
                {"native": True, "anthropic_stop_reason": message.get("stop_reason")},
            )
            return
        opened = await self._open(request, stream=True)
        try:
            reader = _EventReader()
            async for data in _anthropic_events(opened):
                delta = reader.read(data)
                if delta is not None and reader.ttft_s is None:
                    reader.ttft_s = time.monotonic() - started
                if native:
                    yield NativeDelta(
                        text=delta.text if delta else "",
                        tool_calls=delta.tool_calls if delta else None,
                        events=(data,),
                    )
                elif delta is not None:
                    yield delta
            yield reader.finish(opened.replica, native)
        finally:
            await opened.aclose()

    async def _message(self, request: ChatRequest) -> dict[str, Any]:
        """The upstream's Message JSON for a non-streamed request."""
        opened = await self._open(request, stream=False)
        try:
            message = opened.json_object(await opened.read(), "an answer")
            if message.get("type") != "message":
                raise opened.cut("the upstream answered JSON that is not a Message", kind="protocol")
            return message
        finally:
            await opened.aclose()


class _EventReader:
    """Anthropic stream events -> OpenAI-shaped ``Delta`` (text, tool calls) and the final usage / stop reason."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] = {}
        self.block_tool: dict[int, int] = {}  # content block index -> OpenAI tool-call index
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.ttft_s: float | None = None

    def read(self, data: dict[str, Any]) -> Delta | None:
        """Update the state with one event; the Delta it implies, if any."""
        kind = data.get("type")
        if kind == "message_start":
            self.usage.update((data.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self.block_tool.setdefault(data.get("index", 0), len(self.block_tool))
                call = {"index": index, "id": block.get("id"), "type": "function"}
                return Delta(
                    tool_calls=[{**call, "function": {"name": block.get("name", ""), "arguments": ""}}]
                )
            if block.get("type") == "text" and block.get("text"):
                return Delta(text=block["text"])
        elif kind == "content_block_delta":
            change = data.get("delta") or {}
            if change.get("type") == "text_delta" and change.get("text"):
                return Delta(text=change["text"])
            if change.get("type") == "input_json_delta" and data.get("index") in self.block_tool:
                if change.get("partial_json"):
                    fragment = {"arguments": change["partial_json"]}
                    return Delta(tool_calls=[{"index": self.block_tool[data["index"]], "function": fragment}])
        elif kind == "message_delta":
            delta = data.get("delta") or {}
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            self.stop_sequence = delta.get("stop_sequence")
            self.usage.update({k: v for k, v in (data.get("usage") or {}).items() if v is not None})
        return None

    def finish(self, replica: str, native: bool) -> Finish:
        """The ``Finish`` after ``message_stop``."""
        extra: dict[str, Any] = {"replica": redact_url(replica)}
        if native:
            extra["native"] = True
        if self.stop_reason:
            extra["anthropic_stop_reason"] = self.stop_reason
        if self.stop_sequence:
            extra["stop_sequence"] = self.stop_sequence
        reason = FINISH_REASONS.get(self.stop_reason or "", "stop")
        return Finish(reason, backend_usage_from_anthropic(self.usage), self.ttft_s, extra)


def _set_or_drop(body: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        body.pop(key, None)
    else:
        body[key] = value


async def _anthropic_events(opened: OpenedResponse) -> AsyncIterator[dict[str, Any]]:
    """Parsed Anthropic SSE events up to ``message_stop`` (pings included); raises a cut on an ``error`` event,
    bad JSON, or an end before ``message_stop``."""
    async for event in opened.events():
        data = opened.json_object(event.data, "an event")
        if event.event == "error" or data.get("type") == "error":
            error = data.get("error") if isinstance(data.get("error"), dict) else {"type": "api_error"}
            raise opened.cut(
                f"the upstream reported an error mid-stream: {error.get('message', '')}", upstream_error=error
            )
        yield data
        if data.get("type") == "message_stop":
            return
    raise opened.cut("the upstream stream ended before message_stop")


@register_backend("anthropic")
def create_anthropic_backend(model: ModelConfig) -> AnthropicUpstreamBackend:
    """The backend of a ``backend: anthropic`` model entry."""
    return AnthropicUpstreamBackend(
        **upstream_settings(model),
        anthropic_version=model.anthropic_version,
        auto_breakpoints=model.auto_breakpoints,
        min_tokens_overrides=dict(model.min_cacheable_tokens),
    )
