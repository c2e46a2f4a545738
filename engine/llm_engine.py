"""The synchronous engine core: the step loop. Requests in, one step at a time, token and text deltas out.

``LLMEngine`` owns the live requests and ties together input processing (``engine.input_processor``:
checks, engine requests), the scheduler (which requests run, how many tokens each), the KV cache manager
(block tables, prefix cache), the model runner (flattened forward + sampling) and output processing
(``engine.output_processor``: detokenization, stop checks, final outputs). It is single-threaded;
``engine.async_engine`` drives it from one background thread and splits ``step`` into its three phases
(``schedule_step`` and ``finish_step`` under a lock, ``run_step`` without) so a cancel can free blocks while a
forward runs.

A step, in order: plan (``Scheduler.schedule``), flatten + forward + sample (``ModelRunner``), then for each
scheduled request: advance ``num_computed_tokens``, register its newly full blocks in the prefix cache
(``KVCacheManager.cache_full_blocks``, so a request admitted next step hits them: in-flight sharing), hand the
sampled token to output processing, and free the blocks of finished requests (a finished reply whose ids are not
its text's canonical encoding is remembered first, ``engine.served_turns``, so the conversation's next prompt
holds the same ids). A request with ``n > 1`` forks
when its prompt is computed: its ``n - 1`` forks share the prompt's blocks (``KVCacheManager.fork``; the
partial last block copied, ``ModelRunner.copy_block``) and take their first tokens from the same logits row.
A token-granular prefix hit copies the shared slots of a cached block into the request's own block at admission
(``KVCacheManager.allocate`` through ``ModelRunner.copy_slots``), before the step's forward.

Invariant: a request is in ``requests`` from ``add_request`` until its final output is built; a finished
request's blocks are freed in the same call that builds that output.

Failure isolation: when sampling one request's token raises (``SampledToken.error``) or taking the token does
(its constraint, its detokenizer), that request alone ends: its final output has finish reason ``"error"`` and
a ``SamplingError``, its blocks are freed in the same call. The other requests of the step are processed as
if it were not there; their tokens never depend on it (each row is sampled from its own state).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.api import EngineConfig, EngineStats, FinishReason, SamplingParams, TokenLogprob
from engine.attention_kernels import (
    decode_kernel_variant,
    prefill_kernel_variant,
    resolve_decode_kernel,
    resolve_prefill_kernel,
)
from engine.block_hash import HashFn, LayeredKeys, hash_block
from engine.constrained import ConstraintCompiler
from engine.detokenizer import Decoder
from engine.errors import InvalidRequestError, SamplingError
from engine.input_processor import InputProcessor
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers.catalog import PrefixCatalog
from engine.kv_tiers.config import check_tier_names, deployment_hash_fn
from engine.kv_tiers.engine_tiers import EngineTiers
from engine.kv_tiers.entry import KVLayout
from engine.kv_tiers.policy import level_of_blocks
from engine.model import LlamaModel, check_kv_cache_fits
from engine.model_runner import ModelInput, ModelRunner, SeqInput, StepResult
from engine.native_glue import glue_kernel_variant, resolve_glue_kernel
from engine.native_step import resolve_decode_step
from engine.openmp_threads import default_threads
from engine.output_processor import OutputProcessor, RequestOutput
from engine.prefix_admin import PrefixAdmin
from engine.request import Request, RequestStatus
from engine.sampling import SampledToken
from engine.scheduler import Scheduler, SchedulerOutput
from engine.served_turns import ServedTurns
from engine.stats import EngineCounters
from engine.step_threads import StepThreads
from engine.weight_format import kv_dtype_of

logger = logging.getLogger("prefixgate.engine")


def token_logprob(sample: SampledToken) -> TokenLogprob | None:
    """The API's logprob entry of a sampled token (None when its request asked for no logprobs)."""
    if sample.logprob is None:
        return None
    return TokenLogprob(sample.token_id, sample.logprob, sample.top_logprobs)


@dataclass
class StepPlan:
    """A scheduled step: the scheduler's plan and the flattened model input (None when nothing runs)."""

    sched: SchedulerOutput
    model_input: ModelInput | None


class LLMEngine(PrefixAdmin):
    """Synchronous engine: ``add_request``, ``step`` until ``has_unfinished()`` is False, ``abort_request``.

    Args:
        model: the decoder (on its device, in its dtype).
        config: engine settings (block pool, batch limits, policy).
        model_id: stable id of the weights; with the cache salt it forms every block hash's extra keys.
            Unless ``name_kernels`` is False, the decode, prefill and glue kernels' parts (``decode_kernel_variant``,
            ``prefill_kernel_variant``, ``engine.native_glue.glue_kernel_variant``) are appended.
        tokenizer: decodes output text (and gives EOS ids); None = token ids only (no text, no stop strings).
        eos_token_ids: ids that end generation unless ``ignore_eos`` (default: the tokenizer's, else the
            model config's).
        clock: monotonic clock in seconds (tests pass a fake one).
        hash_fn: block hash function (tests swap in a weak one). With tiers and the default, the block hash
            is keyed by the deployment secret (``engine.kv_tiers.keys``) so persisted entries outlive the
            process.
        record_logits: keep the float32 logits of every sampled row per request in ``logits_log`` (tests).
        tier_clock: wall-clock seconds of the tiers' TTLs (tests pass a fake one).

    Raises:
        ValueError: bad config values (policy, sizes, a ``max_model_len`` beyond the checkpoint's context,
            ``max_pinned_fraction`` outside [0, 1], ``num_threads`` < 1, a ``small_step_threads`` other than
            ``auto``, ``off`` or an integer >= 1).
        TierConfigError: a tier cannot start (key and reason).
    """

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        model_id: str,
        tokenizer: Decoder | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        hash_fn: HashFn = hash_block,
        record_logits: bool = False,
        tier_clock: Callable[[], float] = time.time,
        name_kernels: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        mc = model.config
        kv_dtype = kv_dtype_of(config.kv_dtype, model.dtype)
        decode_kernel = resolve_decode_kernel(
            config.decode_kernel, model.device, mc.num_heads // mc.num_kv_heads, mc.head_dim, kv_dtype
        )
        # torch's own count, not the live one: an earlier engine's steps set that step by step (one-row decodes
        # on 1 thread), and a kernel chosen by it (the AVX2 prefill needs 2) would differ from engine to engine
        threads = config.num_threads or default_threads()
        prefill_kernel = resolve_prefill_kernel(
            config.prefill_kernel,
            model.device,
            mc.num_heads // mc.num_kv_heads,
            mc.head_dim,
            threads=threads,
            kv_dtype=kv_dtype,
        )
        glue_kernel = resolve_glue_kernel(config.glue_kernel, model.device, model.dtype)
        # a token's K/V depends on the decode, prefill and glue kernels: blocks of another kernel never share a
        # key (a model id the operator named is kept as named, as the checkpoint's other kernel parts are)
        if name_kernels:
            model_id += decode_kernel_variant(decode_kernel) + prefill_kernel_variant(prefill_kernel)
            model_id += glue_kernel_variant(glue_kernel)
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.served: ServedTurns | None = getattr(tokenizer, "served", None)
        """The tokenizer's served turns (``engine.served_turns``): each finished reply is offered to it."""
        self.clock = clock
        if config.max_model_len is not None and not 0 < config.max_model_len <= mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} is not in [1, {mc.max_position_embeddings}] "
                "(the checkpoint's context window)"
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", None) or mc.eos_token_ids
        if not 0.0 <= config.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {config.max_pinned_fraction}")
        step_threads = StepThreads.from_setting(config.num_threads, config.small_step_threads, threads)
        if config.tiers:
            check_tier_names(tuple(config.tiers))
            if hash_fn is hash_block:
                hash_fn = deployment_hash_fn(tuple(config.tiers), config.deployment_secret, config.tier_disk)
        check_kv_cache_fits(mc, config.num_blocks, config.block_size, kv_dtype, model.device)
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            hash_fn,
            enable_partial_hits=config.enable_partial_prefix_hits,
        )
        self.kv.pins.max_blocks = int(config.max_pinned_fraction * config.num_blocks)
        self.counters = EngineCounters()
        backend = getattr(tokenizer, "backend", None)
        self.constraints = (
            ConstraintCompiler(backend.to_str(), mc.vocab_size, tuple(eos_token_ids))
            if backend is not None and eos_token_ids
            else None
        )
        self.input = InputProcessor(
            self.kv,
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            model_id=model_id,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            clock=clock,
            constraints=self.constraints,
        )
        self.output = OutputProcessor(self.counters, config.block_size, hash_fn)
        self.runner = ModelRunner(
            model,
            config.num_blocks,
            config.block_size,
            kv_dtype,
            config.shared_prefix_attention,
            step_threads,
            decode_kernel,
            prefill_kernel,
            glue_kernel,
            # the same bits as the layer loop, so nothing in model_id names it
            resolve_decode_step() if glue_kernel is not None and decode_kernel is not None else None,
        )
        self.kv.set_slot_copier(self.runner.copy_slots)
        self.tiers: EngineTiers | None = None
        if config.tiers:
            layout = KVLayout.of_model(model, model_id, config.block_size, self.runner.kv_cache.dtype)
            self.tiers = EngineTiers(config, self.kv, self.runner.kv_cache, layout, tier_clock)
        self.scheduler = Scheduler(
            self.kv,
            config,
            self.counters,
            clock=clock,
            admission_gate=self.tiers.ready if self.tiers else None,
        )
        self.tier_clock = tier_clock
        self.catalog = PrefixCatalog()
        """Prefixes warmed or named by a request's prefix key (listing and dropping); with tiers, those they
        kept from before a restart first (``engine.kv_tiers.catalog``)."""
        if self.tiers is not None:
            for rec in self.tiers.stack.load_records(self.model_id):
                for gone in self.catalog.record(rec):  # past the bound: the oldest forgotten down there too
                    self.tiers.stack.forget_record(gone.prefix_key)
        self.prefetch_wait_s = 1.0
        """Longest wait for a tier read in a step that has nothing else to run."""
        self._waited_for_tiers = False  # the last step waited for a tier read (``run_to_completion``)
        self._pin_ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.record_logits = record_logits
        self.logits_log: dict[str, list[torch.Tensor]] = {}
        self.num_steps = 0
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Validate a prompt and its parameters before anything is queued or allocated (see
        ``InputProcessor.check_prompt``).

        Raises:
            InvalidRequestError, PromptTooLongError: the prompt or its parameters cannot be served.
        """
        self.input.check_prompt(prompt_token_ids, params)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        level_ends: Sequence[tuple[int, str]] | None = None,
        prefix_key: str | None = None,
    ) -> Request:
        """Validate and queue a request (it takes no block until the scheduler admits it).

        Args:
            prompt_token_ids: the rendered prompt.
            params: sampling parameters.
            request_id: unique id; made up when None or empty.
            cache_salt: tenant isolation of prefix-cache entries.
            level_ends: ``(end token, level)`` pairs: where the prompt's levels (``system``, ``documents``,
                ``history``) end; they choose its blocks' TTL and budget share in the tiers.
            prefix_key: the gateway's prefix key of the prompt's stable head (up to the last level end):
                the prefix is listed under it (``list_cached``) and can be dropped by it.

        Returns:
            The queued request.

        Raises:
            InvalidRequestError, PromptTooLongError: see ``check_prompt``; ValueError: duplicate request id.
        """
        prompt = list(prompt_token_ids)
        self.check_prompt(prompt, params)
        self.check_level_ends(level_ends)
        return self.add_checked_request(
            prompt,
            params,
            request_id=request_id,
            cache_salt=cache_salt,
            level_ends=level_ends,
            prefix_key=prefix_key,
        )

    def check_level_ends(self, level_ends: Sequence[tuple[int, str]] | None) -> None:
        """Raise ``InvalidRequestError`` (param ``level_ends``) for unknown levels or ends that decrease."""
        try:
            level_of_blocks(0, self.kv.block_size, level_ends, "history")
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e), "level_ends") from None

    def add_checked_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        level_ends: Sequence[tuple[int, str]] | None = None,
        prefix_key: str | None = None,
        shared_prefix_tokens: int = 0,
        shared_salt: str = "",
        idle: bool = False,
    ) -> Request:
        """``add_request`` for a prompt that already passed ``check_prompt`` (which depends only on the config,
        so a check made before taking the engine lock stays valid): queue it without validating it again.
        ``idle``: an idle prefill (``Request.idle``): it ends, finish reason ``"stop"`` and no token, once its
        whole prompt is computed.

        Raises:
            ValueError: duplicate request id.
        """
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = self.input.make_request(
            rid, prompt_token_ids, params, cache_salt, shared_prefix_tokens, shared_salt
        )
        if level_ends is not None:
            req.level_ends = tuple((int(e), str(lv)) for e, lv in level_ends)
        req.idle = idle
        req.idle_seq = self.kv.pool.release_seq
        self.requests[rid] = req
        self.scheduler.add_request(req)
        if self.tiers is not None:
            self.tiers.on_submit(req)
        if prefix_key:
            self._record_prefix(
                prefix_key, req.block_hashes, req.extra_keys, req.level_ends, len(prompt_token_ids)
            )
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a waiting or running request and free its blocks at once.

        Returns:
            Its final output (``finish_reason="abort"``), or None when the id is unknown or already finished.
        """
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        return self._finish(req, "abort")

    def abort_family(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request and every live fork of it (``n > 1``); return their final outputs."""
        ids = [request_id] + [r.request_id for r in self.requests.values() if r.parent_id == request_id]
        return [o for rid in ids if (o := self.abort_request(rid)) is not None]

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step (schedule, forward, sample, process outputs) and return what it produced."""
        plan = self.schedule_step()
        result = self.run_step(plan)
        return self.finish_step(plan, result)

    def schedule_step(self) -> StepPlan:
        """Phase 1: plan the step and flatten its input (mutates queues and block tables)."""
        sched = self.scheduler.schedule()
        self._waited_for_tiers = False
        if (
            sched.is_empty
            and self.tiers is not None
            and self.tiers.has_pending()
            and not self.scheduler.running
        ):
            # Nothing runs but a prefix is being read back: wait for it here (no decode is delayed).
            self._waited_for_tiers = True
            self.tiers.wait_pending(self.prefetch_wait_s)
            again = self.scheduler.schedule()
            again.finished[:0] = sched.finished
            again.preempted[:0] = sched.preempted
            sched = again
        if sched.is_empty:
            return StepPlan(sched, None)
        seqs = []
        for s in sched.scheduled:
            r = s.request
            seqs.append(
                SeqInput(
                    token_ids=r.all_token_ids[s.start : s.end],
                    start=s.start,
                    block_table=self.kv.block_table(r.request_id),
                    needs_token=s.needs_token,
                    sampler=r.sampler,
                    prompt_len=r.num_prompt_tokens,
                )
            )
        return StepPlan(sched, self.runner.prepare(seqs))

    def run_step(self, plan: StepPlan) -> tuple[StepResult | None, float]:
        """Phase 2: the forward pass and sampling (touches no engine state). Returns (result, seconds)."""
        if plan.model_input is None:
            return None, 0.0
        t0 = time.perf_counter()
        result = self.runner.execute(plan.model_input, return_logits=self.record_logits)
        return result, time.perf_counter() - t0

    def finish_step(self, plan: StepPlan, run: tuple[StepResult | None, float]) -> list[RequestOutput]:
        """Phase 3: advance computed tokens, cache full blocks, append tokens, detokenize, finish requests."""
        result, seconds = run
        outputs = [self._finish(r, r.finish_reason or "length") for r in plan.sched.finished]
        if result is None:
            return outputs
        self.num_steps += 1
        sched = plan.sched
        self.counters.record_step(
            sched.num_prefill_tokens, sched.num_tokens - sched.num_prefill_tokens, seconds
        )
        sampled = dict(zip(plan.model_input.sample_seqs, result.samples, strict=True))
        rows = {seq: k for k, seq in enumerate(plan.model_input.sample_seqs)}
        now = self.clock()
        for i, s in enumerate(sched.scheduled):
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the forward ran
            req.num_computed_tokens = s.end
            self.kv.cache_full_blocks(
                req.request_id,
                req.all_token_ids,
                self.scheduler.cacheable_tokens(req),
                req.block_hashes,
                req.extra_keys,
            )
            if req.idle:
                self.counters.idle_prefill_tokens += s.num_new_tokens
                if req.num_computed_tokens >= req.num_tokens:  # its whole prompt is cached: done
                    self.counters.idle_prefills += 1
                    outputs.append(self._finish(req, "stop"))
                continue
            if i in sampled:
                sample = sampled[i]
                if result.logits is not None:
                    self.logits_log.setdefault(req.request_id, []).append(result.logits[rows[i]].clone())
                if sample.error is not None:  # its sampler raised: it alone ends, the batch runs on
                    outputs.append(self._fail(req, sample.error))
                    continue
                if sample.forks:
                    outputs.extend(self._fork(req, sample, now))
                outputs.append(self._process_token(req, sample, now))
        return outputs

    def _process_token(self, req: Request, sample: SampledToken, now: float) -> RequestOutput:
        """Hand a sampled token to output processing; free the request's blocks when it finished. When taking
        the token raises (the request's own state: its constraint cannot advance, its detokenizer), the
        request alone fails (``_fail``)."""
        try:
            out = self.output.process_token(req, sample.token_id, now, token_logprob(sample))
        except Exception as exc:  # noqa: BLE001 - this request ends with it, the batch runs on
            logger.warning("request %s failed taking its sampled token", req.request_id, exc_info=exc)
            return self._fail(req, f"{type(exc).__name__}: {exc}")
        if out.finished:
            self._release(req)
        return out

    def _fail(self, req: Request, cause: str) -> RequestOutput:
        """End a request whose sampling failed: its final output carries a ``SamplingError`` (finish reason
        ``"error"``), its blocks are freed at once and it is forgotten, like any finished request."""
        logger.warning("request %s failed in sampling: %s", req.request_id, cause)
        out = self.output.fail(req, SamplingError(req.request_id, cause))
        self._release(req)
        return out

    def _fork(self, parent: Request, sample: SampledToken, now: float) -> list[RequestOutput]:
        """Create the parent's pending forks (``n > 1``), its prompt just computed: each shares the prompt's
        blocks (the partial last one copied) and takes its first token from ``sample.forks``. A fork that gets
        no block for the copy now waits in the queue like a preempted request (recomputing what it must)."""
        outputs = []
        forks, parent.sampler.pending_forks = parent.sampler.pending_forks, []
        n_prompt = parent.num_prompt_tokens
        for sampler, first in zip(forks, sample.forks, strict=True):
            child = self.input.make_fork(parent, sampler)
            self.requests[child.request_id] = child
            copy = self.kv.fork(parent.request_id, child.request_id, n_prompt)
            if copy is False:
                child.num_computed_tokens = 0
                self.scheduler.add_request(child)
            else:
                if copy is not True:
                    self.runner.copy_block(*copy)
                self.scheduler.add_forked(child)
                self.counters.forked_prefill_tokens_saved += n_prompt
            self.counters.forks += 1
            outputs.append(self._process_token(child, first, now))
        return outputs

    def _finish(self, req: Request, reason: FinishReason) -> RequestOutput:
        """End a request: build its final output (its error, for one the scheduler ended unserved:
        ``Request.failure``), then free its blocks at once and forget it."""
        if req.failure is not None:
            logger.warning("request %s ended unserved: %s", req.request_id, req.failure)
            out = self.output.fail(req, req.failure)
        else:
            out = self.output.finish(req, reason)
        self._release(req)
        return out

    def _release(self, req: Request) -> None:
        """Free a finished request's blocks (unless the scheduler already did) and drop it from ``requests``;
        remember its reply's served ids when they are not its text's canonical encoding (``_remember_served``)."""
        self._remember_served(req)
        if not req.is_finished:
            if self.tiers is not None:
                self.tiers.on_finish(req)  # its levels go to its blocks before they are freed
            self.scheduler.finish_request(req)
        self.requests.pop(req.request_id, None)

    def _remember_served(self, req: Request) -> None:
        """Offer a reply that ended by itself or by length to the served turns, under the request's tenant salt:
        its generated ids less the stop token that ended them. Not an aborted or failed one, nor one a stop
        string cut (the client never got its tail). Only with ``cache_generated_kv``: otherwise the reply's KV is
        not cached, and served ids would make the next prompt depend on this process's history (cache on == off)."""
        if self.served is None or not self.config.cache_generated_kv:
            return
        if req.finish_reason not in ("stop", "length"):
            return
        if req.output is not None and req.output.stop_string is not None:
            return
        out = req.output_token_ids
        if out and out[-1] in req.stop_token_ids:
            out = out[:-1]
        keys = req.extra_keys.private if isinstance(req.extra_keys, LayeredKeys) else req.extra_keys
        # a repeated tool call dropped: the reply the client got is a prefix of the ids' text
        returned = req.output.text if req.output is not None and req.output.repeated_call else None
        self.served.record(keys[1], req.prompt_token_ids, out, returned)  # keys: (model_id, cache_salt)

    # ---- stats and helpers ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the counters and gauges."""
        kv = self.kv
        snap = self.counters.snapshot(
            blocks_total=kv.blocks_total,
            blocks_used=kv.blocks_used,
            blocks_cached=kv.blocks_cached,
            blocks_free=kv.blocks_free,
            evictions=kv.evictions,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
        )
        if self.tiers is None:
            return dataclasses.replace(snap, pinned_blocks=kv.pins.blocks_held)
        return dataclasses.replace(
            snap,
            tier_counters=self.tiers.stats(),
            tier_load_seconds=self.tiers.counters.load_histogram(),
            pinned_blocks=kv.pins.blocks_held,
        )

    def run_to_completion(self, max_steps: int | None = None) -> dict[str, RequestOutput]:
        """Step until no request is left (tests, benchmarks); return each request's final output by id.

        Raises:
            RuntimeError: more than ``max_steps`` steps, or a step that scheduled nothing while requests wait
                (a scheduler bug would otherwise loop forever).
        """
        finals: dict[str, RequestOutput] = {}
        steps = 0
        while self.has_unfinished():
            outs = self.step()
            steps += 1
            if max_steps is not None and steps > max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
            # a step that waited for a tier read made progress even when the read finished after the
            # scheduler looked again (a loaded machine): its request is scheduled next step
            if not outs and not self._waited_for_tiers and self._last_step_idle():
                raise RuntimeError("the scheduler made no progress with requests waiting")
            for o in outs:
                if o.finished:
                    finals[o.request_id] = o
        return finals

    def _last_step_idle(self) -> bool:
        pending = self.tiers is not None and self.tiers.has_pending()
        return self.scheduler.has_unfinished() and not self.scheduler.running and not pending

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Submit every prompt at once, run to completion, return each one's generated token ids (tests)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        tokens = {r.request_id: r.output_token_ids for r in reqs}
        self.run_to_completion()
        return [tokens[r.request_id] for r in reqs]
