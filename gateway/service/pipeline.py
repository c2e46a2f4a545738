"""The protocol-independent path of one request: canonicalize, key, route, open the backend stream, and keep
the stats and the request log exactly once per request; explain its cache result (``cache_header``) and
feed the slot learner once it finished.

An HTTP face (``gateway.http.openai``, ``gateway.http.anthropic``) parses its body into a ``ChatRequest``,
calls ``open_stream`` with the request's path and arrival time (this layer sees no HTTP request object), and
renders the ``OpenedStream``'s events. ``open_stream`` waits for the backend's first
event before returning, so errors raised before any output (unknown model, prompt too long, bad parameter)
become a proper HTTP error status instead of a broken stream.

Exactly one of these ends each request's bookkeeping:
- the backend's ``Finish`` (``OpenedStream`` records usage and logs status 200);
- the stream closed before ``Finish`` without an error (client disconnect: recorded as aborted, logged 499);
- the client left while ``open_stream`` waited for the first event (the HTTP layer cancels it, which closes the
  backend's stream, and calls ``record_abandoned``: recorded as aborted, logged 499);
- an error after the response started (``OpenedStream.fail``: recorded and logged with the error's status);
- any other error propagates to the app's exception handler, which records and logs it.

Charges: a request is charged once, to its key and tenant (usage counters, tpm bucket, spend) and its model's
cost: with the backend's usage when it finished, or, when it ended after its stream opened but before its
``Finish`` (cancelled, failed mid-stream), with what it consumed until then
(``gateway.service.usage_estimate.unfinished_usage``: its prompt and the tokens generated so far; the 499 line
carries those counts). A key with a budget reserves the request's cost estimate before the backend is asked
(``BudgetHold``), released exactly once when the request ends, whichever way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine.errors import EngineError
from gateway.backends.base import Backend
from gateway.config.schema import AnthropicUpstream, EmbeddedModel
from gateway.core.errors import APIError, as_api_error, from_engine_error
from gateway.core.events import BackendEvent, BackendUsage, Delta, Finish
from gateway.core.prompt_size import INLINE_CANONICALIZE_CHARS, INLINE_EXPLAIN_CHARS, prompt_chars
from gateway.core.request import ChatRequest
from gateway.core.tenants import accounting_tenant
from gateway.protocols.anthropic.breakpoints import min_cacheable_tokens
from gateway.service.budget_hold import BudgetHold
from gateway.service.cache_explain import HEADER as CACHE_HEADER
from gateway.service.cache_explain import CacheExplanations, PreparedPrompt
from gateway.service.canonicalize import Canonicalizer
from gateway.service.canonicalize.prompt_tokenizers import PromptTokenizer
from gateway.service.cost_ledger import COST_HEADER, RequestCost
from gateway.service.gateway import Gateway
from gateway.service.miss_explain import Epoch
from gateway.service.miss_explanation import MissExplanation
from gateway.service.prompt_levels import level_ends
from gateway.service.provider_diagnostics import provider_miss_cause
from gateway.service.registry import prefix_key
from gateway.service.request_log import CLIENT_CLOSED, RequestRecord, log_request
from gateway.service.shared_prefix import mark_public_prefix
from gateway.service.usage_estimate import GeneratedText, unfinished_usage

T = TypeVar("T")
UPSTREAM_REQUEST_ID_HEADER = "x-prefixgate-upstream-request-id"
"""Response header carrying the upstream's own id for its answer (``ChatRequest.upstream_request_id``)."""
logger = logging.getLogger("prefixgate.pipeline")


def canonicalize(gateway: Gateway, request: ChatRequest) -> None:
    """Apply the configured rules to ``request`` (none with ``x-prefixgate-rules: off``) and set its prefix
    key (``gateway.routing.prefix_key`` of the stable material; "" when there is none). Records nothing in the
    stats.

    Raises:
        InvalidRequestError: a request shape the rules refuse.
    """
    gateway.canonicalizer.apply(request)
    mark_public_prefix(request, gateway.config.shared_prefixes)
    material = gateway.canonicalizer.stable_material(request)
    request.prefix_key = prefix_key(request.model, request.tenant, material) if material is not None else ""


async def canonicalize_off_loop(gateway: Gateway, request: ChatRequest) -> None:
    """``canonicalize``, in a worker thread for a prompt over ``INLINE_CANONICALIZE_CHARS`` characters.

    Raises:
        InvalidRequestError: a request shape the rules refuse.
    """
    if prompt_chars(request) > INLINE_CANONICALIZE_CHARS:
        await asyncio.to_thread(canonicalize, gateway, request)
    else:
        canonicalize(gateway, request)


async def open_stream(gateway: Gateway, request: ChatRequest, path: str, started: float) -> OpenedStream:
    """Canonicalize ``request``, compute its prefix key, and open its backend stream up to the first event.

    Raises:
        ModelNotFoundError: unknown model (404).
        QuotaExceededError: the request's cost estimate does not fit its key's budget (429, ``BudgetHold``).
        APIError: whatever the backend raises before its first event (engine errors are mapped).
    """
    backend = gateway.registry.get(request.model)
    hold = BudgetHold.reserve(gateway, request)
    try:
        return await _open(gateway, request, backend, path, started, hold)
    except BaseException:
        hold.release()
        raise


async def _open(
    gateway: Gateway, request: ChatRequest, backend: Backend, path: str, started: float, hold: BudgetHold
) -> OpenedStream:
    """``open_stream`` once the model is known and the budget held."""
    await canonicalize_off_loop(gateway, request)
    if backend.wants_level_ends():
        request.level_ends = level_ends(request, backend)
    gateway.stats.record_rules(request.model, Canonicalizer.applied(request))
    prepared = PromptPreparation.schedule(gateway, request)
    epoch = gateway.cache.epoch() if gateway.cache is not None else None  # before the backend's cache lookup
    task = gateway.drain.track()  # a 503 once a shutdown's grace period is over
    iterator = backend.stream(request)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        raise APIError("The backend ended the response without an answer.") from None
    except EngineError as exc:
        await _aclose(iterator)
        raise from_engine_error(exc) from exc
    except asyncio.CancelledError:
        await _aclose(iterator)
        error = gateway.drain.shutting_down_error(task)
        if error is None:
            raise
        raise error from None
    except BaseException:
        await _aclose(iterator)
        raise
    finally:
        gateway.drain.untrack(task)
    return OpenedStream(gateway, request, iterator, first, path, started, prepared, epoch, hold)


class PromptPreparation:
    """The cache explanation's render of one request (``CacheExplanations.prepare``), computed at most once:
    ahead, on the event loop while the backend works on the request, or when the explanation needs it.

    ``schedule`` queues it two loop iterations ahead: the backend's ``stream`` runs up to its first wait in
    the iteration that schedules it, and what it queued then (aiohttp writes a request's body in a task of its
    own on Python < 3.12) runs in the next, so the request is on the wire before the render takes the loop.
    With a real upstream (tens of milliseconds or more before its first byte) the render is off the request's
    path; with a fast one, as much of it as the upstream's own time covers. Only prompts explained inline
    (``INLINE_EXPLAIN_CHARS``) of upstream models (``cl100k_base``) are prepared ahead: a long one is rendered
    in a worker thread, and an embedded model's with its engine's tokenizer once the engine answered, as before.
    """

    def __init__(self, gateway: Gateway, request: ChatRequest) -> None:
        self.gateway = gateway
        self.request = request
        self._done = False
        self._value: PreparedPrompt | None = None

    @classmethod
    def schedule(cls, gateway: Gateway, request: ChatRequest) -> PromptPreparation | None:
        """A preparation of ``request`` queued on the running loop, or None when it will not be explained
        inline (no explanations, not a canonical chat request, a long prompt) or its model has its own
        tokenizer (an embedded engine's)."""
        if gateway.cache is None or request.kind != "chat" or request.canonical is None:
            return None
        if prompt_chars(request) > INLINE_EXPLAIN_CHARS:
            return None
        if gateway.registry.get(request.model).prompt_tokenizer() is not None:
            return None  # an engine's own tokenizer is the engine's, busy with this very request now
        preparation = cls(gateway, request)
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, preparation.run)
        return preparation

    def run(self) -> None:
        """Render the request once (a failure leaves None: ``explain`` then tries again and counts it)."""
        if self._done:
            return
        self._done = True
        cache = self.gateway.cache
        try:
            backend = self.gateway.registry.get(self.request.model)
            self._value = cache.prepare(self.request, backend.prompt_tokenizer()) if cache else None
        except Exception:  # noqa: BLE001 - an explanation never fails a request; explain() counts it
            self._value = None

    def result(self) -> PreparedPrompt | None:
        """The render (computed now when it has not run yet), or None after a failure."""
        self.run()
        return self._value


class OpenedStream:
    """A backend stream whose first event has arrived; ``events()`` yields it and the rest.

    Records the request's outcome in the stats and the request log exactly once (see module docstring).
    """

    def __init__(
        self,
        gateway: Gateway,
        request: ChatRequest,
        iterator: AsyncIterator[BackendEvent],
        first: BackendEvent,
        path: str,
        started: float,
        prepared: PromptPreparation | None = None,
        epoch: Epoch | None = None,
        hold: BudgetHold | None = None,
    ) -> None:
        self.gateway = gateway
        self._hold = hold if hold is not None else BudgetHold(gateway, request)
        self._generated = GeneratedText()
        """The output handed out so far: what an unfinished request is charged for (``_charge_unfinished``)."""
        self._charged = False
        self._unfinished: BackendUsage | None = None
        self._prepared = prepared
        self._epoch = epoch
        self.request = request
        self._iterator = iterator
        self._first: BackendEvent | None = first
        self._path = path
        self._started = started
        self._ttft_s: float | None = None
        self._ends_in_broken_char = False
        """Whether the first choice's text so far ends in U+FFFD: a reply cut there by ``max_tokens`` ended
        inside a character, whose resent text spells its last tokens otherwise (``reply_cut``)."""
        self._done = False
        self._closed = False
        self._explained = False
        self._cache_header: str | None = None
        self._rendered: PreparedPrompt | None = None
        """The explained prompt (``CacheExplanations.prepare``), for recording the answer behind it."""
        self._finish_log: RequestRecord | None = None
        self._after_answer: list[Callable[[], None]] = []
        """Work that shapes nothing of the answer (recording the explained prompt), run by ``aclose``."""
        self.cost: RequestCost | None = None
        """The request's cache cost once it finished (None before, or when the model has no prices)."""

    def upstream_headers(self) -> dict[str, str]:
        """``{"x-prefixgate-upstream-request-id": id}`` when an upstream answered with an id (known once the
        stream opened), else ``{}``."""
        rid = self.request.upstream_request_id
        return {UPSTREAM_REQUEST_ID_HEADER: rid} if rid else {}

    def cost_headers(self) -> dict[str, str]:
        """``{COST_HEADER: RequestCost.header_value()}`` once the request finished with a priced model, else
        ``{}`` (a streamed answer's headers go out before its usage is known)."""
        return {COST_HEADER: self.cost.header_value()} if self.cost is not None else {}

    @property
    def first_event(self) -> BackendEvent | None:
        """The event that opened the stream, until ``events()`` hands it out."""
        return self._first

    def reported_cached_tokens(self, finish: Finish | None = None) -> int | None:
        """Prompt tokens the backend reported cached: ``finish``'s usage, else what the first event said (the
        embedded engine's first delta, whatever it holds: text, a tool call, logprobs; or a ``Finish`` that
        opened the stream, an answer with nothing to deliver), else None."""
        if finish is not None:
            return finish.usage.cached_tokens
        first = self._first
        if isinstance(first, Delta):
            return first.cached_tokens
        if isinstance(first, Finish):
            return first.usage.cached_tokens
        return None

    async def cache_header(self) -> dict[str, str]:
        """``{"x-prefixgate-cache": "cached=…; miss=…; at=…"}`` for the response's headers, or ``{}`` when the
        cached count is not known yet (a stream from an upstream that reports it only at the end) or the
        request cannot be explained (completions; a failure, counted). Computed once: inline for a prompt of
        at most ``INLINE_EXPLAIN_CHARS`` characters, in a worker thread for a longer one; never raises."""
        if not self._explained:
            cached = self.reported_cached_tokens()
            if cached is not None:
                await self._explain(cached)
        return {CACHE_HEADER: self._cache_header} if self._cache_header is not None else {}

    async def _explain(self, cached: int, provider_reason: str | None = None) -> None:
        """Explain the request's cache result once (``provider_reason``: the upstream's own miss reason, which
        takes precedence over the local cause, so the providers' diagnostics land in the same counters)."""
        self._explained = True
        cache = self.gateway.cache
        if cache is None:
            return
        try:
            backend = self.gateway.registry.get(self.request.model)
            tokenizer = backend.prompt_tokenizer()
            minimum, granularity = _cache_unit(self.gateway, self.request.model)
            provider_cause = provider_miss_cause(provider_reason)
            args = (self.request, cached, tokenizer, provider_cause, minimum, granularity)
            epoch = self._epoch
            if self._prepared is not None:  # rendered ahead (or now), inline; recorded once answered
                self._rendered = self._prepared.result()
                explanation = cache.explain(
                    *args, prepared=self._rendered, later=self._after_answer, epoch=epoch
                )
            elif prompt_chars(self.request) <= INLINE_EXPLAIN_CHARS:
                self._rendered = _prepare_if_chat(cache, self.request, tokenizer)
                explanation = cache.explain(*args, prepared=self._rendered, epoch=epoch)
            else:
                explain = functools.partial(_prepare_and_explain, cache, args, epoch)
                self._rendered, explanation = await asyncio.to_thread(explain)
        except Exception:  # noqa: BLE001 - an explanation never fails a request
            cache.errors += 1
            return
        if explanation is not None:
            self._cache_header = explanation.header_value()

    def _record_answer(self, finish: Finish) -> None:
        """Record the explained prompt followed by the answer as its engine cached it (``answer_token_ids``),
        before the answer's last event goes out: the explanation of the client's next request then knows the
        newest reply (an edit of it is ``history_rewritten``, docs/cache-explanations.md). Never raises."""
        cache = self.gateway.cache
        if cache is not None and self._rendered is not None and finish.answer_token_ids:
            cache.record_answer(
                self.request,
                self._rendered,
                finish.answer_token_ids,
                uncomputed=finish.answer_uncomputed,
                # only a reply cut inside a character comes back spelled otherwise at its end (a reply cut
                # between characters re-tokenizes to the ids served: engine.served_turns)
                cut=finish.finish_reason == "length" and self._ends_in_broken_char,
            )

    async def events(self) -> AsyncIterator[BackendEvent]:
        """Every event of the backend, ``Finish`` last. Closing this iterator closes the backend's.

        Raises:
            APIError: raised by the backend mid-stream (engine errors mapped).
        """
        drain = self.gateway.drain
        try:
            while True:
                task = drain.track()  # only while it waits on the backend: a 503 once the drain expired
                try:
                    event = await self._next_event()
                except asyncio.CancelledError:
                    error = drain.shutting_down_error(task)
                    if error is None:
                        raise
                    raise error from None  # the server ended it: logged 503 where it is reported, not 499
                finally:
                    drain.untrack(task)
                if isinstance(event, Delta):
                    self._generated.add(event)
                    if self._ttft_s is None and (event.text or event.tool_calls):
                        self._ttft_s = time.monotonic() - self._started
                    if event.text and event.index == 0:
                        self._ends_in_broken_char = event.text.endswith("\ufffd")
                if isinstance(event, Finish):
                    self._record_finish(event)
                    if not self._explained:
                        await self._explain(event.usage.cached_tokens, event.cache_miss_reason)
                    self._record_answer(event)
                    self.gateway.canonicalizer.learn(self.request)
                    yield event
                    return
                yield event
        except EngineError as exc:
            self._done = True
            self._charge_unfinished()
            raise from_engine_error(exc) from exc
        except Exception:
            self._done = True
            self._charge_unfinished()
            raise
        finally:
            await self.aclose()

    async def guarded_events(
        self, encode_error: Callable[[APIError], bytes]
    ) -> AsyncIterator[BackendEvent | bytes]:
        """``events()``, except that a failure after the response started (an API error, or a backend bug as a
        500 naming its class, traceback logged) is recorded with ``fail`` and becomes the last item:
        ``encode_error(error)``, the face's in-band error event (bytes). Never raises for a backend
        failure."""
        events = self.events()
        try:
            async for event in events:
                yield event
        except Exception as exc:  # noqa: BLE001 - the response has started: the client must hear of it in-band
            if not isinstance(exc, APIError):
                name = type(exc).__name__
                logger.error(
                    "backend of %s failed mid-stream with %s", self.request.model, name, exc_info=exc
                )
            error = as_api_error(exc)
            self.fail(error)
            yield encode_error(error)
        finally:
            await events.aclose()

    async def _next_event(self) -> BackendEvent:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        try:
            return await anext(self._iterator)
        except StopAsyncIteration:
            raise APIError("The backend ended the response without a finish.") from None

    async def aclose(self) -> None:
        """Close the backend stream (cancelling its work); count a client abort if it had not finished. Runs
        what was kept for after the answer (recording the explained prompt; the request's log line), which
        for a JSON answer is once it was sent (``gateway.http.openai``)."""
        if self._closed:
            return
        self._closed = True
        after, self._after_answer = self._after_answer, []
        for work in after:
            work()
        try:
            await _aclose(self._iterator)
        finally:
            record, self._finish_log = self._finish_log, None
            if record is not None:
                log_request(record)
        if not self._done:
            self._done = True
            usage = self._charge_unfinished()
            self.gateway.stats.record_abort(self.request.model)
            self._log(CLIENT_CLOSED, usage=usage)
        self._hold.release()  # in every case: a request that ended without a charge holds nothing either

    def fail(self, error: APIError) -> None:
        """Record and log an error that happened after the response started (it went out in the stream), with
        what the request consumed until then (charged once, ``_charge_unfinished``)."""
        self._done = True
        usage = self._charge_unfinished()
        self.gateway.stats.record_error(self.request.model, error.status_code)
        self._log(error.status_code, error.code, usage=usage)

    def _charge_unfinished(self) -> BackendUsage | None:
        """Charge a request that ended before its ``Finish`` was handed out (cancelled, or failed) what it
        consumed: its prompt and the tokens generated so far (``unfinished_usage``; a ``Finish`` still held
        as the first event is the backend's own count), to its key and tenant (usage, tpm, spend) and its
        model's cost, then release its budget hold. Once per request: a request already charged (finished,
        or by an earlier call) is not charged again; returns the usage charged (None when it was charged as
        finished). Never raises: a count that fails charges the prompt estimate alone (logged)."""
        if self._charged:
            return self._unfinished
        self._charged = True
        request = self.request
        try:
            tokenizer = self.gateway.registry.get(request.model).prompt_tokenizer()
            held = self._first  # generated, never handed out
            usage = unfinished_usage(request, self._generated, held, tokenizer, self._hold.prompt_tokens)
        except Exception:  # noqa: BLE001 - a charge never fails the request's end
            logger.exception("counting the tokens of an unfinished %s request failed", request.model)
            prompt = self._hold.prompt_tokens
            usage = BackendUsage(prompt_tokens=prompt or 0, completion_tokens=0, counted_by="estimate")
        cost = self.gateway.stats.record_unfinished(request.model, usage, request.prefix_key, request.tenant)
        spend = cost.spend if cost is not None else 0.0
        self.gateway.clients.record_finish(  # a salted sub-tenant counts under the tenant it narrows
            request.client_key,
            accounting_tenant(request.tenant, request.cache_salt),
            request.model,
            usage,
            spend,
            finished=False,
        )
        self._hold.release()
        self._unfinished = usage
        return usage

    def _record_finish(self, finish: Finish) -> None:
        self._done = True
        self._charged = True
        ttft = self._ttft_s if self._ttft_s is not None else finish.ttft_s
        self.cost = self.gateway.stats.record_finish(
            self.request.model,
            finish.usage,
            ttft,
            self.request.prefix_key,
            tenant=self.request.tenant,
            retention=finish.cache_retention,
            cache_miss_reason=finish.cache_miss_reason,
        )
        request = self.request
        spend = self.cost.spend if self.cost is not None else 0.0
        self.gateway.clients.record_finish(  # a salted sub-tenant counts under the tenant it narrows
            request.client_key,
            accounting_tenant(request.tenant, request.cache_salt),
            request.model,
            finish.usage,
            spend,
        )
        self._hold.release()
        # written when the stream closes (after a JSON answer went out); measured now
        self._finish_log = self._record(200, finish=finish, ttft_s=ttft)

    def _log(self, status: int, error_code: str | None = None, usage: BackendUsage | None = None) -> None:
        log_request(self._record(status, error_code=error_code, usage=usage))

    def _record(
        self,
        status: int,
        finish: Finish | None = None,
        ttft_s: float | None = None,
        error_code: str | None = None,
        usage: BackendUsage | None = None,
    ) -> RequestRecord:
        return request_record(
            self.request, self._path, self._started, status, finish, ttft_s, error_code, usage
        )


def request_record(
    request: ChatRequest,
    path: str,
    started: float,
    status: int,
    finish: Finish | None = None,
    ttft_s: float | None = None,
    error_code: str | None = None,
    usage: BackendUsage | None = None,
) -> RequestRecord:
    """The request log's record of ``request`` (served on ``path``, arrived at ``started``, monotonic seconds)
    ending now with HTTP ``status``; its token counts are ``finish``'s usage, else ``usage`` (what a request
    that ended before its ``Finish`` was charged), else none."""
    applied = Canonicalizer.applied(request)
    if finish is not None:
        usage = finish.usage
    return RequestRecord(
        request_id=request.request_id,
        path=path,
        status=status,
        model=request.model,
        key=request.client_key or None,
        tenant=request.tenant or None,
        stream=request.stream,
        prompt_tokens=usage.prompt_tokens if usage else None,
        cached_tokens=usage.cached_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        ttft_s=ttft_s,
        duration_s=time.monotonic() - started,
        finish_reason=finish.finish_reason if finish else None,
        error_code=error_code,
        upstream_request_id=request.upstream_request_id,
        prefix_key=request.prefix_key or None,
        rules_applied=sum(applied.values()) if request.kind == "chat" else None,
    )


def record_abandoned(gateway: Gateway, request: ChatRequest, path: str, started: float) -> None:
    """End the bookkeeping of a request whose client left while its stream was opening (``open_stream``
    cancelled, the backend's stream already closed by it): counted aborted and logged 499, as a stream closed
    before its ``Finish``."""
    gateway.stats.record_abort(request.model)
    log_request(request_record(request, path, started, CLIENT_CLOSED))


def _prepare_if_chat(
    cache: CacheExplanations, request: ChatRequest, tokenizer: PromptTokenizer | None
) -> PreparedPrompt | None:
    """``cache.prepare(request, tokenizer)``, or None for a request ``explain`` does not explain, or when it
    failed (``explain`` then tries again, and logs and counts the failure)."""
    if request.kind != "chat" or request.canonical is None:
        return None
    try:
        return cache.prepare(request, tokenizer)
    except Exception:  # noqa: BLE001 - counted by explain, which meets the same failure
        return None


def _prepare_and_explain(
    cache: CacheExplanations, args: tuple, epoch: Epoch | None
) -> tuple[PreparedPrompt | None, MissExplanation | None]:
    """(the render, the explanation) of ``cache.explain(*args)``, in one worker-thread hop."""
    prepared = _prepare_if_chat(cache, args[0], args[2])
    return prepared, cache.explain(*args, prepared=prepared, epoch=epoch)


def _cache_unit(gateway: Gateway, model: str) -> tuple[int | None, int | None]:
    """(minimum cacheable prompt length, cache granularity) in tokens of the model's cache: an Anthropic
    upstream's minimum; an embedded engine's block size; None where unknown."""
    entry = gateway.config.model(model)
    if isinstance(entry, AnthropicUpstream):
        return min_cacheable_tokens(
            entry.upstream_model or entry.name, dict(entry.min_cacheable_tokens)
        ), None
    if isinstance(entry, EmbeddedModel):
        return None, entry.engine.block_size
    return None, None


async def _aclose(iterator: AsyncIterator[BackendEvent]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
