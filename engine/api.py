"""The engine's public request/response types: what the gateway submits and what streams back.

Contract (implemented by ``engine.async_engine.AsyncEngine``)::

    engine = AsyncEngine.from_config(model_id, path, EngineConfig(...))   # loads weights, tokenizer
    await engine.start()                                                   # background step loop
    prompt_ids = engine.render_chat(messages, tools)                       # list[int], chat template
    async for event in engine.generate(GenerationRequest(...)):
        TextDelta -> append event.text ...
        Finished  -> event.finish_reason, event.usage (always the last event)
    engine.stats()  -> EngineStats  (counters; see below)
    await engine.shutdown()

Closing the async iterator early (client disconnect: ``aclose()``, task cancellation) aborts the request and
frees its blocks at once. ``generate`` raises ``engine.errors.PromptTooLongError`` before any block is taken
when the prompt cannot fit; a request that merely cannot get blocks *now* waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request.

    Attributes:
        max_tokens: most tokens to generate (>= 1). ``None`` means up to the context window.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: seeds this request's own ``torch.Generator`` so sampling is reproducible whatever the batch.
        stop: stop strings; generation ends before the first occurrence, which is not returned.
        stop_token_ids: extra token ids that end generation (the checkpoint's EOS ids always do unless
            ``ignore_eos``).
        ignore_eos: keep generating past EOS (benchmarks).
    """

    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class GenerationRequest:
    """One generation job. Give either ``prompt_token_ids`` or ``messages`` (+ ``tools``), or ``prompt``.

    Attributes:
        prompt_token_ids: the prompt as token ids (already rendered).
        messages: OpenAI-style chat messages ``{"role": str, "content": str}``; rendered with the checkpoint's
            chat template and ``add_generation_prompt=True``.
        tools: OpenAI-style tool schemas passed to the chat template.
        prompt: a raw text prompt (``/v1/completions``); tokenized with the checkpoint's BOS rule.
        params: sampling parameters.
        cache_salt: isolates prefix-cache entries (tenant); part of every block hash's extra keys.
        request_id: caller's id, for logs; the engine makes one when empty.
        shared_prefix_messages: the first this many ``messages`` (with ``tools``) are a declared public prefix:
            its full blocks are keyed by ``shared_salt`` instead of ``cache_salt`` (``block_hash.LayeredKeys``),
            so every tenant hits them; every later block keeps ``cache_salt``. 0 = none.
        shared_salt: the public prefix's salt (kept apart from every tenant's salt).
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt: str | None = None
    cache_salt: str = ""
    request_id: str = ""
    shared_prefix_messages: int = 0
    shared_salt: str = ""


@dataclass(frozen=True)
class Usage:
    """Token counts of one finished request.

    Attributes:
        prompt_tokens: tokens in the rendered prompt.
        cached_tokens: prompt tokens served from the prefix cache (block-aligned; recomputation after a
            preemption never counts).
        completion_tokens: tokens generated.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TextDelta:
    """New text (possibly empty while a stop string or a UTF-8 sequence is pending) and its token ids."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    """Always the last event of a stream.

    Attributes:
        finish_reason: ``"stop"`` (EOS, stop string or stop token), ``"length"`` (max_tokens or context),
            ``"abort"`` (cancelled / engine shut down).
        usage: the request's token counts.
        ttft_s: seconds from submit to the first generated token (None when none was generated).
        text: the text generated in total (after stop-string trimming).
    """

    finish_reason: FinishReason
    usage: Usage
    ttft_s: float | None
    text: str


StreamEvent = TextDelta | Finished


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (the ``engine:`` mapping of a model in the gateway's YAML config).

    Attributes:
        block_size: tokens per KV block (16).
        num_blocks: blocks in the preallocated pool; memory = num_blocks * block_size * layers * 2 * kv_heads
            * head_dim * dtype bytes.
        dtype: ``"float32"`` (CPU default) or ``"bfloat16"`` / ``"float16"``.
        max_batch: most sequences in one step (continuous batching).
        max_num_batched_tokens: token budget of one step; a longer prompt is prefilled in chunks of at most
            this many tokens (chunked prefill), so running decodes are not stalled.
        max_model_len: context window in tokens; ``None`` = the checkpoint's.
        enable_prefix_caching: share full blocks between requests by prefix.
        enable_inflight_sharing: a request whose next prefix block another request is prefilling right now
            waits for it instead of computing it again (grouping by prefix; needs prefix caching).
        scheduling: ``"fcfs"`` or ``"lpm"`` (longest cached prefix first, grouped by prefix).
        max_wait_s: starvation bound of ``lpm``: a request waiting longer is scheduled first.
        device: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``.
        num_threads: torch intra-op threads; ``None`` leaves torch's default.
    """

    block_size: int = 16
    num_blocks: int = 1024
    dtype: str = "float32"
    max_batch: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_inflight_sharing: bool = True
    scheduling: str = "lpm"
    max_wait_s: float = 2.0
    device: str = "auto"
    num_threads: int | None = None


@dataclass(frozen=True)
class Histogram:
    """Cumulative histogram in seconds, Prometheus style: ``counts[i]`` observations <= ``buckets[i]``."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


@dataclass(frozen=True)
class EngineStats:
    """Counters the engine keeps itself (monotonic unless noted). Token counts are tokens, times seconds.

    Attributes:
        requests: requests finished (any reason).
        prompt_tokens: prompt tokens of finished-or-admitted requests, counted once per request.
        prefix_query_tokens: prompt tokens looked up in the prefix cache (once per request).
        prefix_hit_tokens: of those, tokens served from cached blocks (once per request; never recompute).
        prefill_tokens: prompt tokens actually computed (includes recomputation after preemption).
        prefill_seconds: wall time spent in forward passes of prefill tokens.
        inflight_shared_tokens: prefill tokens saved because a request waited for blocks another request was
            computing at the same time (in-flight sharing); a subset of ``prefix_hit_tokens``.
        decode_tokens / decode_seconds: generated tokens and time spent in decode steps.
        blocks_total / blocks_used / blocks_cached / blocks_free: gauges; used = referenced by a request,
            cached = unreferenced but holding a reusable hashed block; used + cached + free == total.
        evictions: cached blocks evicted to make room.
        preemptions: running requests preempted (freed, later recomputed).
        running / waiting: gauges.
        ttft / tpot: histograms of time to first token and time per output token.
    """

    requests: int
    prompt_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefill_tokens: int
    prefill_seconds: float
    inflight_shared_tokens: int
    decode_tokens: int
    decode_seconds: float
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    evictions: int
    preemptions: int
    running: int
    waiting: int
    ttft: Histogram
    tpot: Histogram
