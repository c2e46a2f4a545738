"""The engine's asyncio face (the contract in ``engine.api``): one background step thread, async streams.

``AsyncEngine`` owns an ``LLMEngine`` and runs its step loop in ONE background thread (torch releases the GIL
during the forward pass, so the event loop stays responsive). Engine state is guarded by one lock, held only
while a step is planned (``schedule_step``) and while its outputs are processed (``finish_step``), never
during the forward pass (``run_step``). Events reach each request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe`` on the event loop that consumes that stream (so streams may live on different
loops, e.g. one per test): one call per loop per step, carrying every event of that step for that loop's
streams, so a step wakes each loop once however many streams it serves (docs/serving-path.md).

A request whose sampling fails (``engine.errors.SamplingError``, see ``engine.llm_engine``) ends alone: its
stream raises that error (the family's other choices are aborted), its blocks are already free, and the step
loop and every other stream run on.

Cancellation: when a consumer closes its stream early (``aclose()``, ``GeneratorExit``, ``CancelledError``) the
stream's ``finally`` takes the lock and aborts the request, so its blocks are free before ``aclose()``
returns, even while a forward pass that includes it is running (its results are then dropped). A request
aborted in the middle of a chunked prefill therefore computes at most the chunk already running (at most
``max_num_batched_tokens`` tokens) and no later one; that chunk's blocks are never registered in the prefix cache
(``finish_step`` skips a request that is no longer running), so only its fully computed earlier chunks stay
cached (tests/engine/test_prefill_abort.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from engine.api import (
    EngineConfig,
    EngineStats,
    Finished,
    GenerationRequest,
    SamplingParams,
    StreamEvent,
    TextDelta,
    WarmResult,
)
from engine.constrained import prefilled
from engine.errors import EngineClosedError, EngineError, InvalidRequestError
from engine.kv_tiers.catalog import CachedPrefix
from engine.llm_engine import LLMEngine
from engine.next_turn import next_turn_prefix
from engine.openmp_threads import default_threads, in_passing_thread
from engine.output_processor import RequestOutput
from engine.partial_hits import common_prefix_len
from engine.step_threads import StepThreads

logger = logging.getLogger("prefixgate.engine")

MAX_IDLE_PREFILLS = 32
"""Idle prefills queued at once (``AsyncEngine.prefill_next_turn``); a newer one drops the oldest, whose
conversation is the least likely to come back soon."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _EngineFailure:
    """An exception of the step thread, delivered to every open stream."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _RequestFailure:
    """The named error one request (or one choice of it) failed with; its stream raises it."""

    def __init__(self, error: EngineError) -> None:
        self.error = error


def _put_all(batch: list[tuple[asyncio.Queue, StreamEvent]]) -> None:
    """Put each event on its stream's queue (on the queues' own event loop)."""
    for queue, event in batch:
        queue.put_nowait(event)


class AsyncEngine:
    """Async generation API over an ``LLMEngine`` (see ``engine.api`` for the contract).

    Args:
        core: the synchronous engine (model, tokenizer, scheduler, block pool).
        tokenizer: the checkpoint's ``engine.tokenizer.Tokenizer`` (chat template, BOS rule, decode).
    """

    def __init__(self, core: LLMEngine, tokenizer) -> None:
        self.core = core
        self._tokenizer = tokenizer
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._idle: list[str] = []  # request ids of the queued idle prefills, oldest first
        core.prefetch_wait_s = 0.0  # never wait for a tier read under the lock; the loop polls instead

    # ---- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, model_id: str | None, path: str, config: EngineConfig) -> AsyncEngine:
        """Load a checkpoint (``engine.checkpoint.load_checkpoint``) and build the engine on it, both in a
        passing thread (``engine.openmp_threads.in_passing_thread``: no OpenMP team outlives the load).

        Args:
            model_id: the id to serve and hash under; None = the checkpoint's own stable id.
            path: a ``.gguf`` file, a Hugging Face folder, or ``"default"`` (SmolLM2-135M-Instruct).
            config: engine settings (``dtype``, ``device``, ``num_threads``, pool and batch sizes, policy).

        Raises:
            UnsupportedModelError: the checkpoint cannot be loaded (see ``load_checkpoint``).
            ValueError: an unknown ``dtype``, ``weights``, ``kv_dtype`` or scheduling policy, a bad ``num_threads``
                or ``small_step_threads``.
            UnsupportedHardwareError: ``weights`` needs kernels this device lacks (names the setting).
        """
        from engine.amx_gemm import check_dense_gemm
        from engine.checkpoint import load_checkpoint, resolve_device
        from engine.cpu_quota import available_cpus, engine_threads
        from engine.weight_format import check_dense_min_rows, check_supported

        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        # bad thread settings fail before anything loads
        StepThreads.from_setting(config.num_threads, config.small_step_threads, default_threads())
        # no more threads than the CPUs the process may use (its affinity and cgroup quota) unless asked for;
        # torch's own count, not the live one an earlier engine's steps left (``default_threads``)
        threads = engine_threads(config.num_threads, default_threads(), available_cpus())
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        device = resolve_device(config.device)
        check_supported(config.weights, config.kv_dtype, device)
        check_dense_min_rows(config.dense_min_rows)
        check_dense_gemm(config.dense_gemm)

        def load() -> tuple[LLMEngine, object]:
            torch.set_num_threads(threads)  # this thread's count, which the engine's steps start from
            ckpt = load_checkpoint(
                path,
                DTYPES[config.dtype],
                device,
                config.weights,
                config.dense_min_rows,
                config.linear_kernel,
                config.dense_gemm,
            )
            core = LLMEngine(
                ckpt.model,
                replace(config, num_threads=threads),  # the count chosen above, the CPU quota included
                model_id or ckpt.model_id,
                ckpt.tokenizer,
                name_kernels=model_id is None,
            )
            return core, ckpt.tokenizer

        # loaded in a thread that ends here: its OpenMP workers end with it, so the step thread's team is the
        # process's only one (engine.openmp_threads)
        core, tokenizer = in_passing_thread(load)
        return cls(core, tokenizer)

    # ---- properties --------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (``engine.tokenizer.Tokenizer``)."""
        return self._tokenizer

    @property
    def model_id(self) -> str:
        """The served model id (part of every prefix-cache key)."""
        return self.core.model_id

    @property
    def max_model_len(self) -> int:
        """Context window in tokens."""
        return self.core.max_model_len

    @property
    def caches_generated_kv(self) -> bool:
        """Whether generated tokens' KV enters the prefix cache (``EngineConfig.cache_generated_kv``)."""
        return self.core.config.cache_generated_kv

    @property
    def tool_format(self) -> str:
        """``"generic"`` when tools are rendered in ``engine.tool_calls``' format (parse the output with its
        ``ToolCallParser``, constrain it with a ``"tool_calls"`` ``Constraint``), ``"template"`` when the chat
        template renders them itself (docs/tools.md)."""
        return self._tokenizer.tool_format

    def render_chat(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        continue_final_message: bool = False,
        scope: str = "",
    ) -> list[int]:
        """Token ids of ``messages`` (+ ``tools``) rendered by the checkpoint's chat template (tools, tool calls
        and tool results in the generic format of ``engine.tool_calls`` when the template has no tool section;
        the final message left open when ``continue_final_message``, see ``Tokenizer.apply_chat_template``).
        ``scope``: the tokenizer memo's partition (the tenant: ``engine.piece_memo``); a reply the engine served
        in ``scope`` keeps its served ids (``engine.served_turns``), otherwise the ids never depend on it.

        Raises:
            InvalidRequestError: no chat template, or messages the template rejects.
        """
        return self._tokenizer.render_chat(messages, tools, continue_final_message, scope)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and gauges."""
        with self._cond:
            return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached block (admin, tests). True when the prefix cache is now empty; blocks
        held by running requests stay until they end."""
        with self._cond:
            return self.core.kv.reset_prefix_cache()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the background step loop (idempotent; the first ``generate`` also starts it)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine has been shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prefixgate-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step loop; every open stream ends with ``Finished(finish_reason="abort")``."""
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        with self._cond:
            outs = [o for rid in list(self.core.requests) if (o := self.core.abort_request(rid)) is not None]
        self._post(outs)
        await asyncio.to_thread(self.core.close)  # tiers: cached blocks written down, threads stopped

    # ---- the step thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._step_once():
                pass
        except BaseException as e:  # a model or engine failure: every stream gets it, nothing leaks
            self._fail(e)

    def _step_once(self) -> bool:
        """One step of the background loop; False once the engine is stopping."""
        core = self.core
        with self._cond:
            while not self._stopping and not core.has_unfinished():
                self._cond.wait()
            if self._stopping:
                return False
            plan = core.schedule_step()
        result = core.run_step(plan)  # the forward pass, without the lock
        with self._cond:
            outs = core.finish_step(plan, result)
            if plan.model_input is None and not outs:
                self._cond.wait(0.01)  # nothing could run (e.g. waiting on blocks held elsewhere)
        if outs:
            self._post(outs)
        return True

    def _post(self, outs: list[RequestOutput]) -> None:
        """Hand each output's events to its stream, on the event loop that stream lives on: one
        ``call_soon_threadsafe`` per loop for the whole step (one wake-up of that loop, however many streams
        and events), the events of each stream in order."""
        batches: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamEvent | _RequestFailure]]
        ] = {}
        for o in outs:
            events: list[StreamEvent | _RequestFailure] = []
            if o.error is not None:
                events.append(_RequestFailure(o.error))
            elif o.new_token_ids or o.text:
                events.append(
                    TextDelta(
                        o.text,
                        tuple(o.new_token_ids),
                        cached_tokens=o.cached_tokens,
                        index=o.index,
                        logprobs=tuple(o.logprobs),
                        prompt_tokens=o.prompt_tokens,
                    )
                )
            if o.finished and o.error is None:
                events.append(
                    Finished(o.finish_reason, o.usage, o.ttft_s, o.full_text, o.index, o.stop_string)
                )
                no_tokens = replace(o.usage, completion_tokens=0)
                events.extend(Finished(o.finish_reason, no_tokens, None, "", i) for i in o.unforked)
            stream = self._streams.get(o.parent_id or o.request_id)
            if stream is None:
                continue
            loop, queue = stream
            batch = batches.setdefault(loop, [])
            batch.extend((queue, event) for event in events)
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass

    def _deliver(self, rid: str, event: StreamEvent | _EngineFailure) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # that loop is closed: nobody is listening
            pass

    def _fail(self, error: BaseException) -> None:
        logger.error("the engine's step loop failed; every request is aborted", exc_info=error)
        with self._cond:
            self._error = error
            self._closed = True
            for rid in list(self.core.requests):
                self.core.abort_request(rid)
        for rid in list(self._streams):
            self._deliver(rid, _EngineFailure(error))

    # ---- generation --------------------------------------------------------------------------------------
    def prompt_token_ids(self, req: GenerationRequest) -> list[int]:
        """The prompt of ``req`` as token ids: given ids, rendered ``messages`` (+ ``tools``), or ``prompt`` text
        tokenized with the checkpoint's BOS rule.

        Raises:
            InvalidRequestError: none or several of ``prompt_token_ids`` / ``messages`` / ``prompt`` given, an
                empty text prompt, ``tools`` without ``messages``, or a template failure.
        """
        given = [
            name for name in ("prompt_token_ids", "messages", "prompt") if getattr(req, name) is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                f"give exactly one of prompt_token_ids, messages or prompt (got {given or 'none'})", "prompt"
            )
        if req.tools is not None and req.messages is None:
            raise InvalidRequestError("tools need messages", "tools")
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            return self.render_chat(req.messages, req.tools, req.continue_final_message, req.cache_salt)
        if not isinstance(req.prompt, str) or not req.prompt:
            raise InvalidRequestError("prompt must be a non-empty string", "prompt")
        return self._tokenizer.encode(req.prompt, add_special_tokens=True)

    def shared_prefix_tokens(self, req: GenerationRequest, prompt: list[int]) -> int:
        """Leading tokens of ``prompt`` that render ``req``'s declared public messages (the first
        ``shared_prefix_messages``, with the tools): the common prefix of ``prompt`` and those messages rendered
        without a generation prompt. 0 when none are declared or they cannot be rendered alone."""
        count = req.shared_prefix_messages
        if count <= 0 or not req.messages:
            return 0
        try:
            shared = self._tokenizer.render_chat(
                req.messages[:count], req.tools, add_generation_prompt=False, scope=None
            )
        except InvalidRequestError:
            return 0
        return common_prefix_len(shared, prompt)

    def generate(self, req: GenerationRequest, prompt: list[int] | None = None) -> AsyncIterator[StreamEvent]:
        """Validate ``req`` now and return its event stream: ``TextDelta``s, then ``Finished`` (always last).

        ``prompt``, when given, is ``prompt_token_ids(req)`` as the caller computed it (in a worker thread, for a
        long prompt: tokenizing it on the event loop would stall every other request).

        Raises (at call time, before any block is taken):
            InvalidRequestError: bad parameters or prompt (see ``engine.input_processor.validate_params``).
            PromptTooLongError: the prompt + 1 token exceeds the context window or the whole block pool.
            EngineClosedError: the engine was shut down (or its step loop failed).

        Raises (from the stream): ``SamplingError`` when sampling this request's tokens failed (it alone ends);
        ``PromptTooLongError`` when the prompt, or the blocks pins leave of the pool, cannot hold it (at its first
        event: before it is queued, or when pins made while it waited leave too few blocks).
        """
        if self._closed:
            raise EngineClosedError("the engine has been shut down")
        if prompt is None:
            prompt = self.prompt_token_ids(req)
        constraint = req.params.constraint
        if constraint is not None and req.continue_final_message and req.messages:
            # the format covers the prefill and its continuation together (engine.constrained.prefilled)
            text = self._tokenizer.continued_text(req.messages, req.tools)
            req = replace(req, params=replace(req.params, constraint=prefilled(constraint, text)))
        with self._cond:
            self.core.check_prompt(prompt, req.params)
            self.core.check_level_ends(req.level_ends)
        rid = f"{req.request_id or 'req'}#{next(self._ids)}"
        return self._stream(rid, prompt, req)

    # ---- cache administration ----------------------------------------------------------------------------
    async def warm(
        self, req: GenerationRequest, *, pin: bool = False, prompt: list[int] | None = None
    ) -> WarmResult:
        """Prefill ``req``'s prompt (token ids, messages or text; its ``params`` are ignored) and keep its
        blocks cached, pinned in RAM with ``pin``; listed under ``req.prefix_key`` (or its chain hash).
        ``prompt``: ``prompt_token_ids(req)`` when the caller computed it already (``generate``).

        Returns:
            The prefix key, tokens now cached (whole blocks), blocks pinned, the pin id, the tokens this warm
            prefilled (``computed_tokens``), and ``reusable_tokens``: what a following request reuses now,
            token-granular. For ``messages`` that request continues the conversation with its next turn (``next_turn_tokens``): the warmed prompt
            ends with the generation prompt, which the next turn shares only in part (ChatML: ``<|im_start|>``,
            not ``assistant``); for token ids or text, it starts with the whole prompt.

        Raises:
            InvalidRequestError, PromptTooLongError: the prompt cannot be served (nothing is queued).
            PinCapError: ``pin`` and the prompt's blocks would exceed the pin cap.
            EngineClosedError: the engine was shut down.
        """
        if self._closed:
            raise EngineClosedError("the engine has been shut down")
        if prompt is None:
            prompt = self.prompt_token_ids(req)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        with self._cond:
            self.core.check_prompt(prompt, params)
            self.core.check_level_ends(req.level_ends)
            if pin:
                self.core.check_pin_room(len(prompt) // self.core.kv.block_size, req.prefix_key)
        rid = f"{req.request_id or 'warm'}#{next(self._ids)}"
        found = None  # prompt tokens found cached when the warm was admitted
        async for event in self._stream(rid, prompt, dataclasses.replace(req, params=params)):
            if isinstance(event, Finished):
                found = event.usage.cached_tokens
        shared = self.next_turn_tokens(req, prompt)
        # the keys the warm's blocks were cached under (a declared public prefix's blocks are keyed apart)
        keys = self.core.input.extra_keys(
            len(prompt), req.cache_salt, self.shared_prefix_tokens(req, prompt), req.shared_salt
        )
        with self._cond:
            result = self.core.finish_warm(prompt, keys, pin, req.prefix_key, req.level_ends, shared)
        return dataclasses.replace(result, computed_tokens=None if found is None else len(prompt) - found)

    def next_turn_tokens(self, req: GenerationRequest, prompt: list[int]) -> int | None:
        """Leading tokens of ``prompt`` (``req``'s messages rendered with the generation prompt) that a request
        continuing the conversation shares: the common prefix of ``prompt`` and the messages followed by the
        next turn (a user turn after a system, assistant or tool message; the assistant's reply after a user
        message), rendered. None (all of ``prompt``) for token ids or text, or when the template cannot render
        that turn. The next turn's content never counts: it is past where the turns part."""
        if req.messages is None or req.continue_final_message or not req.messages:
            return None
        role = "assistant" if req.messages[-1].get("role") == "user" else "user"
        turn = [*req.messages, {"role": role, "content": "?"}]
        try:
            ids = self._tokenizer.render_chat(
                turn, req.tools, add_generation_prompt=False, scope=req.cache_salt
            )
        except InvalidRequestError:
            return None
        return common_prefix_len(prompt, ids)

    @property
    def prefills_next_turns(self) -> bool:
        """Whether ``prefill_next_turn`` can do anything: ``idle_reply_prefill`` on, with prefix caching and
        without ``cache_generated_kv`` (whose replies' blocks are cached as generated)."""
        config = self.core.config
        return config.idle_reply_prefill and config.enable_prefix_caching and not config.cache_generated_kv

    async def prefill_next_turn(self, req: GenerationRequest) -> int | None:
        """Prefill, while the engine has nothing else to do, what the conversation's next turn will begin with:
        ``req.messages`` end with the assistant's reply as the client will resend it, and the prefix is their
        rendering followed by the next message's head (``engine.next_turn.next_turn_prefix``), in ``req``'s
        tenant (``cache_salt``), public prefix and levels. The KV comes from the prompt path, as the next turn
        computed cold would write it, so the next turn only computes its new message and its tokens stay those
        of a cold run (``EngineConfig.idle_reply_prefill``). The request is idle (``Request.idle``: admitted
        only when no other request waits or runs, stepping aside when one arrives); at most
        ``MAX_IDLE_PREFILLS`` are queued, a newer one dropping the oldest.

        Returns:
            The prefix tokens the cache did not hold at its admission (0 when it held all but the last), or None
            when nothing was prefilled: the option is off (or prefix caching off, or ``cache_generated_kv`` on:
            the reply's KV is cached as it is generated), the newest message is not a reply, the prefix does not
            fit what the context window and the pins leave (now, or when its turn came), or it was dropped for a
            newer one or aborted.

        Raises:
            EngineClosedError: the engine was shut down.
        """
        if self._closed:
            raise EngineClosedError("the engine has been shut down")
        if not self.prefills_next_turns or req.messages is None:
            return None
        prefix = next_turn_prefix(self._tokenizer, req.messages, req.tools, req.cache_salt)
        if not prefix:
            return None
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            with self._cond:
                self.core.check_prompt(prefix, params)
                self.core.check_level_ends(req.level_ends)
        except EngineError:  # it would not fit (the next turn will be refused or cut the same way)
            return None
        rid = f"{req.request_id or 'turn'}#idle{next(self._ids)}"
        self._idle.append(rid)
        if len(self._idle) > MAX_IDLE_PREFILLS:
            oldest = self._idle.pop(0)
            with self._cond:
                dropped = self.core.abort_family(oldest)
            self._post(dropped)
        computed = None
        try:
            idle = dataclasses.replace(req, params=params, prefix_key=None)
            async for event in self._stream(rid, prefix, idle, idle=True):
                if isinstance(event, Finished) and event.finish_reason == "stop":
                    computed = len(prefix) - event.usage.cached_tokens
        except EngineClosedError:
            raise
        except EngineError:  # ended unserved: pins made meanwhile leave it too few blocks
            return None
        finally:
            if rid in self._idle:
                self._idle.remove(rid)
        return computed

    def unpin(self, pin_id: str) -> bool:
        """Release a pin made by ``warm(pin=True)``. False when unknown."""
        with self._cond:
            return self.core.unpin(pin_id)

    def list_cached(
        self, *, prefix_key: str | None = None, tenant: str | None = None, model_id: str | None = None
    ) -> list[CachedPrefix]:
        """``LLMEngine.list_cached`` under the engine lock."""
        with self._cond:
            return self.core.list_cached(prefix_key=prefix_key, tenant=tenant, model_id=model_id)

    def drop_cached(
        self, *, prefix_key: str | None = None, tenant: str | None = None, model_id: str | None = None
    ) -> dict[str, Any]:
        """``LLMEngine.drop_cached`` under the engine lock (counts, and ``skipped_tiers`` when a tier failed)."""
        with self._cond:
            return self.core.drop_cached(prefix_key=prefix_key, tenant=tenant, model_id=model_id)

    async def _stream(
        self, rid: str, prompt: list[int], req: GenerationRequest, *, idle: bool = False
    ) -> AsyncIterator[StreamEvent]:
        self._ensure_started()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), queue)
        done = False
        choices_left = req.params.n
        shared = self.shared_prefix_tokens(req, prompt)
        try:
            with self._cond:
                self.core.add_checked_request(
                    prompt,
                    req.params,
                    request_id=rid,
                    cache_salt=req.cache_salt,
                    level_ends=req.level_ends,
                    prefix_key=req.prefix_key,
                    shared_prefix_tokens=shared,
                    shared_salt=req.shared_salt,
                    idle=idle,
                )
                self._cond.notify()
            while True:
                event = await queue.get()
                if isinstance(event, _EngineFailure):
                    done = True
                    raise EngineClosedError(
                        f"the engine's step loop failed: {event.error!r}"
                    ) from event.error
                if isinstance(event, _RequestFailure):
                    raise event.error  # not done: the finally aborts the family's other choices
                if isinstance(event, Finished):
                    choices_left -= 1
                    done = choices_left == 0
                yield event
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            if not done:
                with self._cond:
                    self.core.abort_family(rid)
