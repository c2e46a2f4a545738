"""``backend: anthropic``: the Anthropic Messages API (or a server speaking it) over HTTP.

Per request it POSTs ``{base_url}/v1/messages`` on the replica the prefix-affinity ring picks. Anthropic-face
requests go natively (the client's body with the canonical prompt, automatic cache breakpoints, the upstream's
own events relayed as ``NativeDelta``); OpenAI-face requests are translated and their answer turned into
``Delta`` / ``Finish``. Token counts come from the upstream's ``/v1/messages/count_tokens``. Details:
docs/upstreams.md. Reference: https://docs.anthropic.com/en/api/messages
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Unpack

from gateway.backends.anthropic_events import EventReader, MessageAssembler, anthropic_events, checked_usage
from gateway.backends.base import TokenCount, refuse_choices_and_logprobs
from gateway.backends.upstream import UpstreamBackend, UpstreamOptions, error_body, upstream_settings
from gateway.config.schema import AnthropicUpstream
from gateway.core.errors import InvalidRequestError
from gateway.core.events import BackendEvent, BackendUsage, Finish
from gateway.core.gateway_loops import VIA_HEADER, outgoing_via
from gateway.core.request import SAMPLING_FIELDS, ChatRequest
from gateway.core.tokens import TokenCounter
from gateway.protocols.anthropic.boundaries import boundaries_from_segments, default_boundaries
from gateway.protocols.anthropic.cache_control import (
    CacheControlError,
    CachePlan,
    check_client_cache_control,
    has_client_cache_control,
    plan_cache_control,
)
from gateway.protocols.anthropic.openai_fields import check_openai_fields_for_anthropic
from gateway.protocols.anthropic.parse import COUNT_TOKENS_PATH, FORWARDED_HEADERS, MESSAGES_ONLY_FIELDS
from gateway.protocols.anthropic.prompt import (
    AnthropicPrompt,
    openai_to_anthropic,
    openai_to_anthropic_tool_choice,
)
from gateway.protocols.anthropic.render import FINISH_REASONS, NativeDelta
from gateway.protocols.anthropic.structured_outputs import anthropic_output_config
from gateway.protocols.provider_usage import anthropic_miss_reason
from gateway.transport.failures import FailureKind
from gateway.transport.redact import redact_url
from gateway.transport.upstream_http import OpenedResponse

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` sent for OpenAI-face requests that set none (the Messages API requires one)."""


class AnthropicUpstreamBackend(UpstreamBackend):
    """A ``Backend`` forwarding to the Anthropic Messages API.

    Args:
        name: the client-facing model name.
        base_urls: one base URL per replica (``https://api.anthropic.com``); ``/v1/messages`` is appended.
        anthropic_version: the ``anthropic-version`` header.
        auto_breakpoints: where the client set no ``cache_control``, choose automatic caching or breakpoints at
            the segment boundaries (``protocols.anthropic.cache_control``), with TTLs from ``cache_ttl``.
        min_tokens_overrides: model-name prefix -> minimum cacheable tokens (before the price table's and the
            built-in table).
        prices: the model's prices (``gateway.config.price_table.ModelPrices``): its minimum cacheable length
            and the TTL options; None = TTL ``5m`` always.
        ttl_chooser: ``(request, body) -> {"stable": ttl, "history": ttl}`` (the service's retention choice,
            given by the registry); None = ``5m`` for every marker.
        counter: token counter for the thresholds (default ``breakpoints.default_counter()``).
        options: ``UpstreamBackend``'s (``api_key``, ``upstream_model``, ``timeout_s``, ``retries``,
            ``client``, ``ring``, ``sleep``); the key goes out as ``x-api-key``; ``upstream_model`` also picks
            the minimum cacheable length.
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
        prices: Any = None,
        ttl_chooser: Any = None,
        **options: Unpack[UpstreamOptions],
    ) -> None:
        super().__init__(name, base_urls, **options)
        self.anthropic_version = anthropic_version
        self.auto_breakpoints = auto_breakpoints
        self.min_tokens_overrides = dict(min_tokens_overrides or {})
        self.counter = counter
        self.prices = prices
        self.ttl_chooser = ttl_chooser

    def min_tokens(self) -> int | None:
        """The minimum cacheable prefix: a config override, else the price table's, else the built-in table
        (None: let ``cache_control`` read the built-in table)."""
        model = self.upstream_model
        matches = [(len(p), n) for p, n in self.min_tokens_overrides.items() if model.startswith(p)]
        if matches:
            return max(matches)[1]
        if self.prices is not None and self.prices.min_cacheable_tokens is not None:
            return int(self.prices.min_cacheable_tokens)
        return None

    # ---- request ------------------------------------------------------------------------------------------
    def build_body(self, request: ChatRequest, stream: bool) -> tuple[dict[str, Any], CachePlan | None]:
        """The Messages body sent upstream, and the cache plan (None when automatic breakpoints are off).

        Raises:
            InvalidRequestError: a client ``cache_control`` the provider would refuse (a fifth breakpoint, a 1h
                after a 5m, ...), answered in Anthropic's error shape before any upstream call.
            InvalidRequestError / UnsupportedContentError: content Anthropic cannot carry, or an OpenAI field
                it cannot honour (``check_openai_fields_for_anthropic``; OpenAI-face requests).
        """
        if request.kind != "chat":
            raise InvalidRequestError(
                "Anthropic models serve chat requests only; use /v1/chat/completions or /v1/messages.",
                param="prompt",
            )
        prompt = None
        if request.anthropic_body:
            # with rules on, system / messages / tools are replaced below (in place, key order kept): not
            # copied
            replaced = ("system", "messages", "tools") if request.rules_enabled else ()
            body = {k: v if k in replaced else copy.deepcopy(v) for k, v in request.anthropic_body.items()}
            if request.rules_enabled:
                prompt = openai_to_anthropic(request.messages, request.tools)
                _set_or_drop(body, "system", prompt.system)
                body["messages"] = prompt.messages
                _set_or_drop(body, "tools", prompt.tools)
            # rules off: system / messages / tools go exactly as the client sent them
        else:
            if request.openai_body is not None:
                check_openai_fields_for_anthropic(request.openai_body)
            prompt = openai_to_anthropic(request.messages, request.tools)
            body = self._translated_body(request, prompt)
        body["model"] = self.upstream_model
        body["stream"] = stream
        plan = None
        try:
            if self.auto_breakpoints or has_client_cache_control(body):
                check_client_cache_control(body)
            if self.auto_breakpoints:
                boundaries = self._boundaries(request, body, prompt)
                ttl = self.ttl_chooser(request, body) if self.ttl_chooser is not None else "5m"
                plan = plan_cache_control(
                    body,
                    boundaries,
                    self.upstream_model,
                    ttl=ttl,
                    min_tokens=self.min_tokens(),
                    counter=self.counter,
                )
                body = dict(plan.body)
        except CacheControlError as exc:
            raise InvalidRequestError(exc.args[0], param=exc.param) from None
        return body, plan

    @staticmethod
    def _boundaries(
        request: ChatRequest, body: dict[str, Any], prompt: AnthropicPrompt | None
    ) -> dict[str, Any]:
        """Segment ends from the rules when the body was built from the canonical messages, else read off the
        body (rules off). The turns' segments where the rules have them: an earlier turn's hoisted-value block
        is history there, so the history breakpoint still follows the previous turn (``segments`` end the
        stable part at the first block, which is what the prefix key needs, not where a breakpoint pays)."""
        canonical = request.canonical
        segments = None
        if canonical is not None:
            segments = canonical.turn_segments if canonical.turn_segments is not None else canonical.segments
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
            choice = openai_to_anthropic_tool_choice(request.tool_choice, request.parallel_tool_calls)
            if choice is not None:
                body["tool_choice"] = choice
        for name in SAMPLING_FIELDS:  # only what the client set: Anthropic's defaults are not OpenAI's
            if name in request.sampling_given:
                body[name] = getattr(params, name)
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop_sequences"] = list(params.stop)
        if request.user:
            body["metadata"] = {"user_id": request.user}
        output_config = anthropic_output_config((request.openai_body or {}).get("response_format"))
        if output_config is not None:  # structured outputs, generally available: no beta header
            body["output_config"] = output_config
        return body

    async def count_tokens(self, request: ChatRequest) -> TokenCount:
        """The upstream's own count: ``POST {base_url}/v1/messages/count_tokens`` with the body a
        ``/v1/messages`` passthrough would send (``build_body``: rules applied, ``model`` mapped, automatic
        breakpoints) less ``MESSAGES_ONLY_FIELDS``, with the same key, headers, replica choice, retries and
        error mapping (``post``). Reference: https://docs.anthropic.com/en/api/messages-count-tokens

        Raises:
            UpstreamCallError: refused (4xx passes through) or failed after retries, as for ``/v1/messages``.
            UpstreamStreamCut: kind ``protocol`` (502): the answer is not JSON with an integer
                ``input_tokens``.
            InvalidRequestError / UnsupportedContentError: what ``build_body`` refuses.
        """
        body, _ = self.build_body(request, stream=False)
        body = {key: value for key, value in body.items() if key not in MESSAGES_ONLY_FIELDS}
        headers = self.headers_for(
            request
        )  # the key, version and forwarded headers, as /v1/messages sends them
        opened = await self.post(request.prefix_key or request.request_id, COUNT_TOKENS_PATH, headers, body)
        try:
            answer = opened.json_object(await opened.read(), "a token count")
            tokens = answer.get("input_tokens")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise opened.cut(
                    "the upstream answered a token count without an integer input_tokens",
                    kind=FailureKind.PROTOCOL,
                )
        finally:
            await opened.aclose()
        return TokenCount(tokens, "upstream")

    def headers_for(self, request: ChatRequest) -> dict[str, str]:
        """The headers of an upstream call for ``request``: content type, ``anthropic-version``, the gateways
        passed (``gateway_loops``), ``x-api-key`` (when configured) and the forwarded client headers
        (``FORWARDED_HEADERS``)."""
        headers = {
            "content-type": "application/json",
            "anthropic-version": self.anthropic_version,
            VIA_HEADER: outgoing_via(),
        }
        if self.api_key:
            headers["x-api-key"] = self.api_key
        for name in FORWARDED_HEADERS:
            if request.forward_headers.get(name):
                headers[name] = request.forward_headers[name]
        return headers

    async def _open(self, request: ChatRequest, stream: bool) -> OpenedResponse:
        body, _ = self.build_body(request, stream)
        opened = await self.post(
            request.prefix_key or request.request_id, "/v1/messages", self.headers_for(request), body
        )
        request.upstream_request_id = opened.request_id
        request.replica = redact_url(opened.replica)
        return opened

    # ---- the backend stream --------------------------------------------------------------------------------
    async def stream_once(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """Yield ``Delta`` events then one ``Finish``.

        Anthropic-face requests get ``NativeDelta`` events carrying the upstream's own events (a streamed
        request: every event from ``message_start`` to ``message_stop``; a non-streamed one: the whole
        Message), and a ``Finish`` with ``native=True``. Others get text and tool-call deltas in OpenAI's
        streaming shape (thinking and server-tool blocks are not part of an OpenAI answer and are left out).

        Raises:
            UpstreamCallError: failed before the first byte (after retries), or refused (4xx passes through).
            UpstreamStreamCut: broke off after the first byte, or an ``error`` event arrived (its
                ``upstream_error`` is the upstream's ``error`` object).
            InvalidRequestError / UnsupportedContentError: content Anthropic cannot carry.
        """
        refuse_choices_and_logprobs(request, "an Anthropic upstream")
        native = bool(request.anthropic_body)
        started = time.monotonic()
        if native and not request.stream:
            message, usage = await self._message(request)
            blocks = message.get("content") if isinstance(message.get("content"), list) else []
            text = "".join(
                str(b.get("text", "")) for b in blocks if isinstance(b, dict) and b.get("type") == "text"
            )
            yield NativeDelta(text=text, events=(message,))
            yield Finish(
                FINISH_REASONS.get(message.get("stop_reason") or "", "stop"),
                usage,
                time.monotonic() - started,
                native=True,
                anthropic_stop_reason=stop_reason
                if isinstance(stop_reason := message.get("stop_reason"), str)
                else None,
                cache_miss_reason=anthropic_miss_reason(message),
            )
            return
        opened = await self._open(request, stream=True)
        try:
            reader = EventReader()
            async for data in anthropic_events(opened):
                try:
                    delta = reader.read(data)
                except (AttributeError, TypeError, ValueError):
                    raise opened.cut(
                        f"the upstream sent a {data.get('type')!r} event of an unexpected shape",
                        kind=FailureKind.PROTOCOL,
                    ) from None
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
            try:
                finish = reader.finish(opened.replica, native)
            except (
                TypeError,
                ValueError,
            ):  # a stop_reason that is not a string, usage counts that are not ints
                raise opened.cut(
                    "the upstream sent a malformed stop_reason or usage", kind=FailureKind.PROTOCOL
                ) from None
            yield finish
        finally:
            await opened.aclose()

    async def _message(self, request: ChatRequest) -> tuple[dict[str, Any], BackendUsage]:
        """The Message JSON for a non-streamed request, assembled from a streamed upstream call, and its
        usage.

        The upstream is always asked to stream: a non-streamed answer sends its first byte only when the whole
        generation is done, so the read timeout (seconds between two bytes) would have to cover all of it and
        a timeout, counted as a failure before the first byte, would be retried, running the generation again.
        Streamed, the upstream's events (and its pings) keep every wait short. An upstream that answers a JSON
        Message anyway (a proxy that ignores ``stream``) is read as one.
        """
        opened = await self._open(request, stream=True)
        try:
            if opened.content_type != "text/event-stream":  # an upstream that answered JSON all the same
                message = opened.json_object(await opened.read(), "an answer")
                error = error_body(message)
                if error is not None:  # an error answered as JSON (with 200): the upstream's own words
                    raise opened.cut(
                        f"the upstream answered an error: {error['message']}", upstream_error=error
                    )
                if message.get("type") != "message":
                    raise opened.cut(
                        "the upstream answered JSON that is not a Message", kind=FailureKind.PROTOCOL
                    )
                return message, checked_usage(opened, message)
            builder = MessageAssembler(opened)
            async for data in anthropic_events(opened):
                try:
                    builder.add(data)
                except (AttributeError, TypeError, ValueError):
                    raise opened.cut(
                        f"the upstream sent a {data.get('type')!r} event of an unexpected shape",
                        kind=FailureKind.PROTOCOL,
                    ) from None
            message = builder.message()
            return message, checked_usage(opened, message)
        finally:
            await opened.aclose()


def _set_or_drop(body: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        body.pop(key, None)
    else:
        body[key] = value


def create_anthropic_backend(model: AnthropicUpstream) -> AnthropicUpstreamBackend:
    """The backend of a ``backend: anthropic`` model entry."""
    return AnthropicUpstreamBackend(
        **upstream_settings(model),
        anthropic_version=model.anthropic_version,
        auto_breakpoints=model.auto_breakpoints,
        min_tokens_overrides=dict(model.min_cacheable_tokens),
        prices=model.prices,
    )
