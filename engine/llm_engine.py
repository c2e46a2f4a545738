"""The synchronous engine core: requests in, one step at a time, token and text deltas out.

``LLMEngine`` ties the scheduler (which requests run, how many tokens each), the KV cache manager (block tables,
prefix cache), the model runner (flattened forward + sampling) and per-request output processing
(detokenization, stop strings, EOS, ``max_tokens``). It is single-threaded; ``engine.async_engine`` drives it
from one background thread and splits ``step`` into its three phases (``schedule_step`` and
``finish_step`` under a lock, ``run_step`` without) so a cancel can free blocks while a forward runs.

A step, in order: plan (``Scheduler.schedule``), flatten + forward + sample (``ModelRunner``), then for each
scheduled request: advance ``num_computed_tokens``, register its newly full blocks in the prefix cache
(``KVCacheManager.cache_full_blocks``, so a request admitted next step hits them: in-flight sharing), append
the sampled token, detokenize, check stop conditions, and free the blocks of finished requests.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.api import EngineConfig, EngineStats, FinishReason, SamplingParams, Usage
from engine.block_hash import HashFn, hash_block, hash_request_blocks
from engine.detokenizer import Decoder, OutputText
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.kv_cache_manager import KVCacheManager
from engine.model import LlamaModel
from engine.model_runner import ModelInput, ModelRunner, SeqInput, StepResult
from engine.request import Request, RequestStatus
from engine.sampling import make_generator
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stats import EngineCounters


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (0 or 1).
        text: new text to emit (may be "" while a character or a stop string is pending).
        finished: True on the request's last output.
        finish_reason: set when finished.
        usage: set when finished.
        ttft_s: seconds from submit to the first token (None if none was generated).
        full_text: all text generated (stop-string trimmed), set when finished.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    full_text: str = ""


@dataclass
class StepPlan:
    """A scheduled step: the scheduler's plan and the flattened model input (None when nothing runs)."""

    sched: SchedulerOutput
    model_input: ModelInput | None


def validate_params(params: SamplingParams) -> None:
    """Check sampling parameters.

    Raises:
        InvalidRequestError: ``max_tokens`` < 1, ``temperature`` < 0, ``top_p`` not in (0, 1], ``top_k`` < 0,
            an empty stop string, or a negative stop token id (``param`` names the field).
    """
    if params.max_tokens is not None and (not isinstance(params.max_tokens, int) or params.max_tokens < 1):
        raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {params.max_tokens!r}", "max_tokens")
    if not params.temperature >= 0.0:
        raise InvalidRequestError(f"temperature must be >= 0, got {params.temperature!r}", "temperature")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {params.top_p!r}", "top_p")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0, got {params.top_k!r}", "top_k")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise InvalidRequestError("stop strings must be non-empty strings", "stop")
    if any(not isinstance(t, int) or t < 0 for t in params.stop_token_ids):
        raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """Check a prompt's token ids.

    Raises:
        InvalidRequestError: an empty prompt, or a token id that is not an int in ``[0, vocab_size)``.
    """
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    for t in prompt_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError(f"token id {t!r} is not in the vocabulary [0, {vocab_size})", "prompt")


def kv_dtype_of(name: str, model: LlamaModel) -> torch.dtype:
    """The KV cache dtype for ``EngineConfig.kv_dtype``; the model's own dtype when that is not fp32.

    Raises:
        ValueError: not ``float32`` / ``bfloat16``.
    """
    from engine.weight_format import KV_DTYPES

    if name not in KV_DTYPES:
        raise ValueError(f"engine.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name] if model.dtype == torch.float32 else model.dtype


class LLMEngine:
    """Synchronous engine: ``add_request``, ``step`` until ``has_unfinished()`` is False, ``abort_request``.

    Args:
        model: the decoder (on its device, in its dtype).
        config: engine settings (block pool, batch limits, policy).
        model_id: stable id of the weights; with the cache salt it forms every block hash's extra keys.
        tokenizer: decodes output text (and gives EOS ids); None = token ids only (no text, no stop strings).
        eos_token_ids: ids that end generation unless ``ignore_eos`` (default: the tokenizer's, else the
            model config's).
        clock: monotonic clock in seconds (tests pass a fake one).
        hash_fn: block hash function (tests swap in a weak one).
        record_logits: keep the float32 logits of every sampled row per request in ``logits_log`` (tests).

    Raises:
        ValueError: bad config values (policy, sizes, a ``max_model_len`` beyond the checkpoint's context).
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
    ) -> None:
        self.model = model
        self.config = config
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.clock = clock
        mc = model.config
        self.vocab_size = mc.vocab_size
        if config.max_model_len is not None and not 0 < config.max_model_len <= mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} is not in [1, {mc.max_position_embeddings}] "
                "(the checkpoint's context window)"
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", None) or mc.eos_token_ids
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching, hash_fn)
        self.counters = EngineCounters()
        self.scheduler = Scheduler(self.kv, config, self.counters, clock=clock)
        kv_dtype = kv_dtype_of(config.kv_dtype, model)
        self.runner = ModelRunner(
            model, config.num_blocks, config.block_size, kv_dtype, config.shared_prefix_attention
        )
        self.requests: dict[str, Request] = {}
        self.record_logits = record_logits
        self.logits_log: dict[str, list[torch.Tensor]] = {}
        self.num_steps = 0
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Validate a prompt and its parameters before anything is queued or allocated.

        Raises:
            InvalidRequestError: bad parameters or token ids; stop strings without a tokenizer.
            PromptTooLongError: ``what="context"`` when ``prompt + 1 > max_model_len``, or when an explicit
                ``max_tokens`` does not fit beside the prompt (``prompt + max_tokens > max_model_len``, as OpenAI
                and vLLM refuse it); ``what="pool"`` when ``prompt + 1`` tokens exceed the whole block pool.
        """
        validate_params(params)
        validate_prompt(prompt_token_ids, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", "stop")
        n = len(prompt_token_ids)
        if n + 1 > self.max_model_len:
            raise PromptTooLongError(n + 1, self.max_model_len, what="context")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(n, self.max_model_len, what="context", completion_tokens=params.max_tokens)
        self.kv.check_fits(n + 1)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> Request:
        """Validate and queue a request (it takes no block until the scheduler admits it).

        Args:
            prompt_token_ids: the rendered prompt.
            params: sampling parameters.
            request_id: unique id; made up when None or empty.
            cache_salt: tenant isolation of prefix-cache entries.

        Returns:
            The queued request.

        Raises:
            InvalidRequestError, PromptTooLongError: see ``check_prompt``; ValueError: duplicate request id.
        """
        prompt = list(prompt_token_ids)
        self.check_prompt(prompt, params)
        return self.add_checked_request(prompt, params, request_id=request_id, cache_salt=cache_salt)

    def add_checked_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> Request:
        """``add_request`` for a prompt that already passed ``check_prompt`` (which depends only on the config,
        so a check made before taking the engine lock stays valid): queue it without validating it again.

        Raises:
            ValueError: duplicate request id.
        """
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        req = Request(
            request_id=rid,
            prompt_token_ids=prompt_token_ids,
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_ids),
            extra_keys=(self.model_id, cache_salt),
            arrival_time=self.clock(),
            generator=make_generator(params.seed),
            output=OutputText(self.tokenizer, params.stop) if self.tokenizer is not None else None,
        )
        req.update_block_hashes(self.kv.block_size, self._hasher(req))
        self.requests[rid] = req
        self.scheduler.add_request(req)
        return req

    def _hasher(self, req: Request):
        extra = req.extra_keys
        bs = self.kv.block_size
        fn = self.kv.hash_fn
        return lambda tokens, parent: hash_request_blocks(tokens, bs, extra, fn, parent)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a waiting or running request and free its blocks at once.

        Returns:
            Its final output (``finish_reason="abort"``), or None when the id is unknown or already finished.
        """
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        return self._finish(req, "abort")

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
                    params=r.params,
                    generator=r.generator,
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
        outputs = [self._finish_output(r, r.finish_reason or "length") for r in plan.sched.finished]
        if result is None:
            return outputs
        self.num_steps += 1
        sched = plan.sched
        self.counters.record_step(sched.num_prefill_tokens, sched.num_tokens - sched.num_prefill_tokens, seconds)
        sampled = dict(zip(plan.model_input.sample_seqs, result.token_ids, strict=True))
        rows = {seq: k for k, seq in enumerate(plan.model_input.sample_seqs)}
        now = self.clock()
        for i, s in enumerate(sched.scheduled):
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the forward ran
            req.num_computed_tokens = s.end
            self.kv.cache_full_blocks(
                req.request_id, req.all_token_ids, req.num_computed_tokens, req.block_hashes, req.extra_keys
            )
            if i in sampled:
                if result.logits is not None:
                    self.logits_log.setdefault(req.request_id, []).append(result.logits[rows[i]].clone())
                outputs.append(self._on_token(req, sampled[i], now))
        return outputs

    # ---- output processing -------------------------------------------------------------------------------
    def _on_token(self, req: Request, token: int, now: float) -> RequestOutput:
        """Record a sampled token; detokenize; finish on EOS / stop token, stop string or max_tokens."""
        if req.first_token_time is None:
            req.first_token_time = now
            self.counters.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.counters.tpot.observe(now - req.last_token_time)
        req.last_token_time = now
        req.append_token(token)
        if req.num_tokens // self.kv.block_size > len(req.block_hashes):  # a block just filled up
            req.update_block_hashes(self.kv.block_size, self._hasher(req))
        self.counters.decode_tokens += 1
        text = ""
        reason: FinishReason | None = None
        if token in req.stop_token_ids:
            reason = "stop"
        elif req.output is not None:
            text = req.output.add(token)
            if req.output.stopped:
                reason = "stop"
        if reason is None and req.num_output_tokens >= req.max_tokens:
            reason = "length"
        if reason is None:
            return RequestOutput(req.request_id, [token], text)
        out = self._finish(req, reason)
        out.new_token_ids = [token]
        out.text = text + out.text
        return out

    def _finish(self, req: Request, reason: FinishReason) -> RequestOutput:
        """End a request (free its blocks at once) and build its final output."""
        req.finish_reason = reason
        self.scheduler.finish_request(req)
        return self._finish_output(req, reason)

    def _finish_output(self, req: Request, reason: FinishReason) -> RequestOutput:
        self.counters.requests += 1
        tail = req.output.finish() if req.output is not None else ""
        self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            text=tail,
            finished=True,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=req.num_prompt_tokens,
                cached_tokens=req.num_cached_tokens or 0,
                completion_tokens=req.num_output_tokens,
            ),
            ttft_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            full_text=req.output.text if req.output is not None else "",
        )

    # ---- stats and helpers ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the counters and gauges."""
        kv = self.kv
        return self.counters.snapshot(
            blocks_total=kv.blocks_total,
            blocks_used=kv.blocks_used,
            blocks_cached=kv.blocks_cached,
            blocks_free=kv.blocks_free,
            evictions=kv.evictions,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
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
            if not outs and self._last_step_idle():
                raise RuntimeError("the scheduler made no progress with requests waiting")
            for o in outs:
                if o.finished:
                    finals[o.request_id] = o
        return finals

    def _last_step_idle(self) -> bool:
        return self.scheduler.has_unfinished() and not self.scheduler.running

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Submit every prompt at once, run to completion, return each one's generated token ids (tests)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        tokens = {r.request_id: r.output_token_ids for r in reqs}
        self.run_to_completion()
        return [tokens[r.request_id] for r in reqs]
