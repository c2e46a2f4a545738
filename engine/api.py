"""The engine's public request/response types: what the gateway submits and what streams back.

Contract (implemented by ``engine.async_engine.AsyncEngine``)::

    engine = AsyncEngine.from_config(model_id, path, EngineConfig(...))   # loads weights, tokenizer
    await engine.start()                                                   # background step loop
    prompt_ids = engine.render_chat(messages, tools)                       # list[int], chat template
    async for event in engine.generate(GenerationRequest(...)):
        TextDelta -> event.index (choice), event.text, event.token_ids, event.logprobs
        Finished  -> event.index, event.finish_reason, event.usage (the last event of its choice; the
                     stream ends after the Finished of all ``params.n`` choices)
    engine.stats()  -> EngineStats  (counters; see below)
    await engine.shutdown()

Closing the async iterator early (client disconnect: ``aclose()``, task cancellation) aborts the request and
frees its blocks at once. ``generate`` raises ``engine.errors.PromptTooLongError`` before any block is taken
when the prompt cannot fit; a request that merely cannot get blocks *now* waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.kv_tiers.policy import TierPolicies
from engine.kv_tiers.settings import DiskTierConfig, RedisTierConfig

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a request ended; ``"error"`` only on the synchronous engine's ``RequestOutput`` of a request whose
sampling failed (``engine.errors.SamplingError``): the async stream raises that error instead of a ``Finished``."""


ConstraintKind = Literal["json_object", "json_schema", "tool_calls"]
ToolChoice = Literal["auto", "required", "function"]


@dataclass(frozen=True)
class Constraint:
    """What a request's output must be: constrained decoding (``engine.constrained``, llguidance).

    Attributes:
        kind: ``"json_object"`` (any JSON object: OpenAI ``response_format: {"type": "json_object"}``),
            ``"json_schema"`` (an instance of ``json_schema``: ``response_format: {"type": "json_schema"}``, strict
            or not, the schema is enforced as given), or ``"tool_calls"`` (the generic tool-call format of
            ``engine.tool_calls``, arguments valid for each tool's ``parameters``).
        json_schema: the JSON Schema of ``"json_schema"`` (a dict). On a ``"tool_calls"`` constraint with
            ``tool_choice="auto"``, the answer's format when the request has a response format as well as tools
            (OpenAI ``response_format`` / Responses ``text.format`` / Anthropic ``output_config.format``, with
            ``json_object`` as ``{"type": "object"}``): the output is then calls, or instead of free text an
            instance of this schema; None (the default) keeps free text. Ignored for ``"required"`` and
            ``"function"``, which allow calls only.
        tools: the tools of ``"tool_calls"``: OpenAI ``{"type": "function", "function": {...}}`` objects or the
            bare function objects ``{"name", "description", "parameters"}``.
        tool_choice: ``"auto"`` (text, or calls of these tools), ``"required"`` (one or more calls), or
            ``"function"`` (one call of ``tool_name``). OpenAI's ``"none"`` is no constraint at all.
        tool_name: the function of ``tool_choice="function"``.
        parallel_tool_calls: allow several calls in one answer (else at most one); a named ``tool_choice``
            ("function") always gives exactly one.

        prefix: text the output continues (an assistant prefill, ``engine.constrained.prefilled``): the grammar
            consumes it before the first generated token, so the format holds for prefix + output; a prefix no
            output of the format starts with is refused (``InvalidRequestError``, param ``messages``). "" for
            none.

    A finished constrained output is complete and valid (``finish_reason="stop"``); ``"length"`` means it was cut
    by ``max_tokens`` and may be a valid prefix only.
    """

    kind: ConstraintKind
    json_schema: dict | None = None
    tools: tuple[dict, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    prefix: str = ""


MAX_N = 16
"""Most sequences one request may ask for (``n``; checked by ``engine.input_processor.validate_params``)."""


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
        n: sequences to generate for the prompt (>= 1). They share the prompt's blocks: one prefill, then
            ``n`` forks (``engine.llm_engine``); choice ``i`` is seeded ``seed + i``. Events carry ``index``.
        logprobs: None for no logprobs; ``k`` in [0, 20] for each token's logprob plus its ``k`` most likely
            alternatives (OpenAI chat's ``logprobs: true, top_logprobs: k``; completions' ``logprobs: k``).
            Values are the log-softmax of the logits after bias, penalties and constraint, before temperature,
            top-k and top-p (``engine.sampling``).
        presence_penalty / frequency_penalty: OpenAI's, in [-2, 2], over the tokens generated so far.
        repetition_penalty: Hugging Face's (CTRL), > 0, over prompt and output tokens; 1 disables it.
        logit_bias: ``(token_id, bias)`` pairs added to the logits; bias clamped to [-100, 100] (OpenAI).
        constraint: what the output must be (JSON, a schema's instance, tool calls), or None.
    """

    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None


@dataclass
class GenerationRequest:
    """One generation job. Give either ``prompt_token_ids`` or ``messages`` (+ ``tools``), or ``prompt``.

    Attributes:
        prompt_token_ids: the prompt as token ids (already rendered).
        messages: OpenAI-style chat messages ``{"role": str, "content": str}``; rendered with the checkpoint's
            chat template and ``add_generation_prompt=True``.
        tools: OpenAI-style tool schemas passed to the chat template.
        continue_final_message: the last message (an assistant prefill) is continued: rendered without its
            end-of-turn and without a generation prompt.
        prompt: a raw text prompt (``/v1/completions``); tokenized with the checkpoint's BOS rule.
        params: sampling parameters.
        cache_salt: isolates prefix-cache entries (tenant); part of every block hash's extra keys.
        request_id: caller's id, for logs; the engine makes one when empty.
        level_ends: ``(end token, level)`` pairs: where the prompt's levels (``system``, ``documents``,
            ``history``) end in its tokens; they choose its blocks' TTL and budget share in the tiers.
        prefix_key: the gateway's prefix key of the prompt's stable head (listed by ``list_cached``).
        shared_prefix_messages: the first this many ``messages`` (with ``tools``) are a declared public prefix:
            its full blocks are keyed by ``shared_salt`` instead of ``cache_salt`` (``block_hash.LayeredKeys``),
            so every tenant hits them; every later block keeps ``cache_salt``. 0 = none.
        shared_salt: the public prefix's salt (kept apart from every tenant's salt).
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    continue_final_message: bool = False
    prompt: str | None = None
    cache_salt: str = ""
    request_id: str = ""
    level_ends: list[tuple[int, str]] | None = None
    prefix_key: str | None = None
    shared_prefix_messages: int = 0
    shared_salt: str = ""


@dataclass(frozen=True)
class Usage:
    """Token counts of one finished request.

    Attributes:
        prompt_tokens: tokens in the rendered prompt.
        cached_tokens: prompt tokens served from the prefix cache: whole blocks plus, with token-granular hits,
            the slots copied from a partly matching block (recomputation after a preemption never counts).
        completion_tokens: tokens generated.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one generated token and its most likely alternatives (``SamplingParams.logprobs``).

    Attributes:
        token_id: the generated token.
        logprob: its natural-log probability (processed logits, see ``engine.sampling``).
        top_logprobs: up to ``logprobs`` ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """New text (possibly empty while a stop string or a UTF-8 sequence is pending) and its token ids.

    Attributes:
        text: the new text.
        token_ids: the tokens generated since the previous event of this choice.
        index: the choice (0 .. n-1).
        logprobs: one entry per token of ``token_ids`` when ``SamplingParams.logprobs`` is set, else ``()``; a
            stop token (EOS, ``stop_token_ids``) has none: it is not part of the text.
        cached_tokens: prompt tokens served from the prefix cache at the request's first admission (known
            once its prefill ran, so the first delta already has it; the same number as ``Usage.cached_tokens``),
            or None.
        prompt_tokens: the request's prompt length in tokens (``Usage.prompt_tokens``), known from the first
            delta on.
    """

    text: str
    token_ids: tuple[int, ...]
    cached_tokens: int | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class Finished:
    """The last event of a choice; a stream ends after the ``Finished`` of every one of its ``n`` choices.

    Attributes:
        finish_reason: ``"stop"`` (EOS, stop string or stop token), ``"length"`` (max_tokens or context),
            ``"abort"`` (cancelled / engine shut down).
        usage: the request's token counts.
        ttft_s: seconds from submit to the first generated token (None when none was generated).
        text: the text generated in total (after stop-string trimming).
        index: the choice (0 .. n-1). Every choice's ``usage`` has the shared prompt's ``prompt_tokens`` and
            ``cached_tokens`` and its own ``completion_tokens``.
        stop_string: the stop string (``SamplingParams.stop``) that ended generation, None when it ended
            otherwise (EOS, a stop token, a length).
    """

    finish_reason: FinishReason
    usage: Usage
    ttft_s: float | None
    text: str
    index: int = 0
    stop_string: str | None = None


StreamEvent = TextDelta | Finished


@dataclass(frozen=True)
class WarmResult:
    """What warming a prompt did (``LLMEngine.warm`` / ``AsyncEngine.warm``).

    Attributes:
        prefix_key: the prefix key it is listed under (the caller's, or the hex chain hash of its last full
            block).
        prompt_tokens: tokens in the prompt.
        cached_tokens: tokens of its full blocks now in the prefix cache (``prompt_tokens`` rounded down to
            whole blocks): what a pin holds and what the KV tiers store.
        pinned_blocks: blocks the prefix's pin holds (0 when it has none). A prefix key holds one pin: warming it
            again, with ``pin`` or without, keeps its pin when the same blocks are cached, and with ``pin``
            replaces it when they differ (without ``pin`` the old pin is released then).
        pin_id: the pin to ``unpin`` later, or None.
        reusable_tokens: tokens a following request that continues the warmed prompt reuses now, token-granular
            (docs/prefix-cache.md): its whole blocks and the kept partial block, up to where the continuation
            departs from the warmed prompt (for messages, the next turn; see ``AsyncEngine.warm``). The
            partial block is not pinned: eviction can take it, leaving ``cached_tokens``.
        computed_tokens: prompt tokens this warm prefilled: 0 when the prompt was already cached, its whole
            length when nothing of it was (what was found cached when it was admitted is the rest); None where
            the engine did not report it.
    """

    prefix_key: str
    prompt_tokens: int
    cached_tokens: int
    pinned_blocks: int
    pin_id: str | None
    reusable_tokens: int = 0
    computed_tokens: int | None = None


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
        long_prefill_token_threshold: a prefill with more tokens than this left to compute (after its prefix hit)
            is *long*. While a long prefill runs, short prompts still go in every step: their chunks are sized
            first and take together at most this many tokens, the long prefill's chunk takes the rest of the
            budget (at least ``max_num_batched_tokens`` minus this minus the step's decodes; all of it when no
            short prompt is there). So a short prompt behind a long one gets its first token after about one
            chunk, not after the whole long prefill (head-of-line blocking). Long prefills go oldest first, a
            younger one taking only what the older ones leave, so several long prompts are prefilled one after
            the other: the lowest mean time to first token for prompts of similar length (``engine.scheduler``). ``None`` (default) = half of
            ``max_num_batched_tokens``; 0 = off (a running prefill takes the budget first, waiting prompts get
            what is left); else in [1, ``max_num_batched_tokens`` - 1] (a ``ValueError`` otherwise).
        max_model_len: context window in tokens; ``None`` = the checkpoint's.
        enable_prefix_caching: share full blocks between requests by prefix.
        enable_inflight_sharing: a request whose next prefix block another request is prefilling right now
            waits for it instead of computing it again (grouping by prefix; needs prefix caching).
        scheduling: ``"fcfs"`` or ``"lpm"`` (longest cached prefix first, grouped by prefix).
        max_wait_s: starvation bound of ``lpm``: a request waiting longer is scheduled first.
        device: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``.
        num_threads: torch intra-op threads; ``None``: torch's default, lowered where served
            (``AsyncEngine.from_config``) to the CPUs the process may use (``engine.cpu_quota``: its affinity mask
            and cgroup CPU quota).
        small_step_threads: torch threads of decode-only steps of at most ``SMALL_STEP_MAX_ROWS`` (2) rows (one or
            two streams decoding), where OpenMP's fork and join cost more than a second core gives back:
            ``"auto"`` (1 when ``num_threads`` is at most 2, measured on a 2-core Zen 5: docs/engine-step.md;
            with more threads as ``"off"``), an integer >= 1, or ``"off"`` (every step runs with ``num_threads``). Speed only: the step's plan never depends on it; torch's bf16
            flash kernel may round attention 1 ulp differently on another count (``engine.step_threads``). The
            native weight GEMVs and the one-call decode step's attention use ``num_threads`` in every step.
        tiers: tiers below the RAM pool, any of ``"disk"``, ``"redis"`` (looked up in that order); none by
            default (``engine.kv_tiers.settings`` says why).
        tier_disk / tier_redis: settings of each tier (directory, URL, key prefix, byte budgets, timeouts).
        tier_policies: TTL and byte-budget share per level (system, documents, history) per tier.
        tier_writeback_capacity: blocks the write-back queue holds; more are dropped (counted), never waited
            for.
        tier_flush_on_close: ``close()`` writes every cached block down, so a restart finds them.
        max_pinned_fraction: most of the pool pinned prefixes may hold (pins are never evicted from RAM).
        deployment_secret: keys the block hash when tiers are on, so persisted and shared entries are found
            by every process of the deployment and by no one outside it (>= 16 bytes; required with Redis;
            a disk tier alone keeps one of its own in its directory when unset).
        weights: weight format of the linear layers, ``auto | native | int8 | int4 | bf16 | float32``
            (``engine.weight_format``: ``auto`` runs the checkpoint's own format, e.g. Q4_1 as int4, where the
            hardware has the kernels, else float32).
        kv_dtype: dtype of the KV cache, ``bfloat16`` (the default: half the memory and attention bandwidth of
            ``float32``, and the AMX / AVX512-BF16 prompt-attention builds; llama.cpp's default cache is f16) or
            ``float32`` (the cache of the fp32 reference). Top-1 agreement of SmolLM2 with the fp32 reference:
            1,993-1,996 / 2,000 with a bf16 cache (docs/engine-step.md, session 29).
        dense_min_rows: int4/int8 linears keep a dense copy of their weights for prompt rows (bf16 where the CPU
            has fast bf16 GEMMs: AMX, or AVX512-BF16 on AMD; else fp32): ``auto`` (default) = a copy except on CPUs
            without fast bf16 GEMMs whose linears run on the native kernel (on the AVX2 build's panel path: a third
            of the memory, faster prefix-hit tails, ~15% slower cold prefills; on an AVX-512 Intel CPU without AMX:
            0.6x the cold prefill's time and 0.8x the memory; ``engine.weight_format.auto_dense_min_rows``), an
            integer >= 1 = a copy, ``None`` = no copy (less memory; prefill slower with torch's int4 kernel). The engine runs prompt tokens' rows on the copy and generated tokens' rows on the
            int4 kernel, whatever the step's row count (``engine.row_kernels``: batch invariance); the number
            itself is the row count from which a direct ``forward`` call without row kinds uses the copy. Part of
            ``model_id`` (a prompt's K/V differs).
        shared_prefix_attention: decode sequences that share cached leading blocks (one system prompt, many
            users) read those blocks once per step (cascade attention: on CPU the shared chunks of
            ``engine.chunked_decode``, over a bf16 cache; elsewhere ``engine.decode_attention.SharedPrefix``);
            false = each sequence gathers its whole context (for comparison). Tokens are the same either way.
        enable_partial_prefix_hits: token-granular prefix hits (needs prefix caching): a prompt that shares
            only part of a block with a cached one (a question that differs in its last tokens) copies the
            shared slots' KV into its own block instead of recomputing from the block boundary, and a finished
            request's last partly filled block is kept as a cache entry for that (RAM only, never a tier);
            false = hits stop at the last whole block (``engine.kv_cache_manager``, invariants 8-9).
        cache_generated_kv: also keep the KV of generated tokens in the prefix cache (the blocks a reply fills),
            so a conversation's next turn reuses its previous reply's KV. Off (the default), only prompt tokens'
            KV is cached: a generated token's KV comes from the decode path (the int4/int8 kernels), a prompt
            token's from the prompt path (the bf16 dense copy), so a next turn served from the reply's cached KV
            could answer otherwise than the same request computed cold (a burst trial: 3 of 24 greedy turns);
            off, each reply is computed once more as part of the next turn's prompt, and cache on == cache off
            holds across turns. On: vLLM's behaviour (faster next turns, greedy tokens may differ).
        idle_reply_prefill: with ``cache_generated_kv`` off and prefix caching on, once a chat reply is out,
            prefill the conversation as its next turn will begin (the prompt, the reply as the client resends it,
            and the next turn's header) while the engine has nothing else to do, on the prompt path
            (``AsyncEngine.prefill_next_turn``). The next turn then computes only its new message, and its tokens
            are still those of the same request computed cold. Such an idle prefill runs only when no other
            request waits or runs and steps aside as soon as one arrives, so it never delays a request by more
            than one of its chunks; false = the next turn computes the reply itself.
        idle_prefill_chunk_tokens: the most tokens a step of idle prefills computes (>= 1): a request that
            arrives during it waits at most one such step. 64: SmolLM2's steps at ~1,000 tokens of context took
            47 / 63 / 110 / 193 ms for 32 / 64 / 128 / 256 tokens on a 2-core EPYC without AMX (session 34), so 64
            keeps ~90 % of 128's rate at about half the wait.
        idle_prefill_min_residency_s: an idle prefill runs only where the pool would keep its blocks at least
            this many seconds (>= 0, finite; 0 = no such bound): the free and cached blocks ahead of them, at the
            rate the pool handed blocks out over the last 30 s (``engine.pool_turnover``). In a pool that turns
            over faster, its blocks would be evicted before most next turns came; it is dropped
            (``idle_prefills_dropped``). 5.0: in a 64-block pool under six conversations (``python -m
            bench.idle_tight_pool``) idle prefills run without it evicted entries released 0.5-2 s before, and
            the clients' mean TTFT was higher with them in 4 of 4 pairs while they were served fewer cached
            tokens; a default pool under the same load keeps a block far longer.
        decode_kernel: attention of generated tokens, ``auto | native | avx512-bf16 | torch``: ``native`` = the
            C kernel over the paged cache (``engine.native_decode``: built once per machine and model shape with
            the system C compiler; x86-64 CPUs with AVX-512; each sequence alone, blocks the step's sequences share
            read once), ``avx512-bf16`` = its AVX512-BF16 build's bf16 decode (x86-64 CPUs with AVX512-BF16, a bf16
            cache, head_dim a multiple of 32 up to 128: the arithmetic of ``prefill_kernel: avx512-bf16``, so a
            generated token's K/V and output are the bits a prompt row at its position gets there; the shared
            blocks' K tiles and V pairs laid out once for every sequence of a run), ``torch`` = torch's chunked
            kernels (``engine.chunked_decode``), ``auto`` = avx512-bf16 where ``prefill_kernel: auto`` takes the
            AVX512-BF16 prefill (an AMD CPU with AVX512-BF16, a bf16 cache and a shape it takes), else native
            where it builds, else torch. Prompt tokens always take the prefill path. Each keeps batched == alone.
            ``native`` or ``avx512-bf16`` where it cannot be built or does not fit is a start-up error naming the
            reason.
        prefill_kernel: attention of prompt tokens, ``auto | native | amx | avx512-bf16 | torch``: ``native`` =
            the C kernel of ``decode_kernel`` run over a whole prefill chunk (``NativeDecodeKernel.prefill``: each
            prompt row with exactly the arithmetic of decoding that position alone, K/V read in place, OpenMP over
            row tiles), ``amx`` = the same kernel's AMX build (x86-64 CPUs with AMX and AVX512-BF16, a bf16 cache,
            head_dim 64: scores and values on AMX tiles, queries and softmax numerators each split into two bf16
            parts, ~16 bits kept; within ~3e-6 relative of float64 attention), ``avx512-bf16`` = its AVX512-BF16
            build (x86-64 CPUs with AVX512-BF16, a bf16 cache, head_dim a multiple of 32 up to 128: scores and
            values on ``VDPBF16PS``, queries and softmax numerators rounded to bf16, half the instructions of
            native's fp32 arithmetic), ``torch`` = torch's chunked prefill (``engine.chunked_prefill``), ``auto``
            = amx where it builds and fits, else avx512-bf16 where it builds and fits, else native where it was
            measured faster (the AVX-512 build; the AVX2 build, on CPUs without AVX-512, at 2 or more
            ``num_threads``), else torch (``engine.attention_kernels.resolve_prefill_kernel``,
            ``docs/engine-step.md``). Each keeps a prompt row's result independent of chunking and caching. Part
            of ``model_id`` unless torch (a prompt's K/V differs); ``native``, ``amx`` or ``avx512-bf16`` where it
            cannot be built (or, amx and avx512-bf16, does not fit the cache or shape) is a start-up error naming
            the reason.
        linear_kernel: the weight-only kernel of int4/int8 linears (generated tokens' rows, the LM head),
            ``auto | native | int8-activations | torch``: ``native`` = the C kernel on the GGUF's own codes with
            fp32 activations, exact scales and fp32 output (``engine.native_linear``: built once per machine with
            the system C compiler; x86-64 CPUs with AVX-512 and F16C), ``torch`` = torch's int4 kernel (bf16
            activations, scales and output); ``int8-activations`` = the native kernel with each row's activations
            cut into two int8 planes per group of 32 (about 15 bits kept; top-1 agreement with the fp32 reference
            2,000 / 2,000 on SmolLM2) and integer dot products (``engine.native_linear.Int8ActivationKernel``:
            x86-64 CPUs with AVX-512 VNNI and VBMI, ~1.2x the fp32 kernel's speed at 8 rows, ~1.05x at one; or
            AVX2, the same bits, int4 weights only, ~1.3x at 8 rows and ~1.2x at one on a Zen 3;
            docs/engine-step.md, "int8 activations"); ``auto`` = int8-activations where it builds for the CPU's
            best instruction set, else native where it builds, else torch. Applied when the checkpoint is loaded,
            like ``weights`` and ``dense_min_rows``; prompt tokens keep the dense prefill copy (without one, on
            AVX2, the kernel's fp32 path). Each keeps batched == alone. ``native`` or ``int8-activations`` where it
            cannot be built is a start-up error naming the reason.
        glue_kernel: a decoder layer's elementwise work between its linears and its attention (RMSNorm with the
            residual add, RoPE with the K/V store, SiLU(gate) * up), ``auto | native | torch``: ``native`` = one
            C call each (``engine.native_glue``: built once per machine with the system C compiler; x86-64 CPUs
            with AVX-512 or AVX2; a float32 model), ``torch`` = torch's ops (``engine.model``), ``auto`` = native
            where it builds and was measured faster (``engine.native_glue.resolve_glue_kernel``,
            ``docs/engine-step.md``), else torch. Every row of every step (prompt and generated tokens) takes the
            same path, so either keeps batched == alone and cache on == off. Part of ``model_id`` when native
            (the RMSNorm's sum and SiLU's exponential round a few ulp apart from torch's); ``native`` where it
            cannot be used is a start-up error naming the reason.
        dense_gemm: the GEMM of prompt rows on the bf16 dense copy of int4/int8 linears, ``auto | amx | onednn``:
            ``amx`` = the engine's own AMX kernel (``engine.amx_gemm``: built once per machine with the system C
            compiler; x86-64 CPUs with AVX512-BF16 and AMX; fp32 activations rounded to bf16 inside, fp32 output;
            each row's result independent of the call's other rows by construction, so whole calls), ``onednn`` =
            oneDNN's bf16 GEMM (``engine.bf16_gemm``: 32-row calls on CPUs with AMX, where its whole calls are not
            row-invariant), ``auto`` = amx where it builds, else onednn. Applied when the checkpoint is loaded.
            Part of ``model_id`` when amx (a prompt token's K/V differs); ``amx`` where it cannot be built, or
            with no bf16 dense copy to run, is a start-up error naming the reason.
    """

    block_size: int = 16
    num_blocks: int = 1024
    dtype: str = "float32"
    max_batch: int = 16
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_inflight_sharing: bool = True
    scheduling: str = "lpm"
    max_wait_s: float = 2.0
    device: str = "auto"
    num_threads: int | None = None
    small_step_threads: int | str = "auto"
    tiers: tuple[str, ...] = ()
    tier_disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    tier_redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    tier_policies: TierPolicies = field(default_factory=TierPolicies)
    tier_writeback_capacity: int = 256
    tier_flush_on_close: bool = True
    max_pinned_fraction: float = 0.25
    deployment_secret: str | None = None
    weights: str = "auto"
    kv_dtype: str = "bfloat16"
    dense_min_rows: int | None | str = "auto"
    shared_prefix_attention: bool = True
    enable_partial_prefix_hits: bool = True
    cache_generated_kv: bool = False
    idle_reply_prefill: bool = True
    idle_prefill_chunk_tokens: int = 64
    idle_prefill_min_residency_s: float = 5.0
    decode_kernel: str = "auto"
    prefill_kernel: str = "auto"
    linear_kernel: str = "auto"
    glue_kernel: str = "auto"
    dense_gemm: str = "auto"


DECODE_KERNELS = ("auto", "native", "avx512-bf16", "torch")
"""``EngineConfig.decode_kernel``'s values (``engine.native_decode``)."""

PREFILL_KERNELS = ("auto", "native", "amx", "avx512-bf16", "torch")
"""``EngineConfig.prefill_kernel``'s values (``engine.attention_kernels.resolve_prefill_kernel``)."""

LINEAR_KERNELS = ("auto", "native", "int8-activations", "torch")
"""``EngineConfig.linear_kernel``'s values (``engine.native_linear``)."""

GLUE_KERNELS = ("auto", "native", "torch")
"""``EngineConfig.glue_kernel``'s values (``engine.native_glue``)."""

DENSE_GEMMS = ("auto", "amx", "onednn")
"""``EngineConfig.dense_gemm``'s values (``engine.amx_gemm``)."""


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
        prefix_hit_tokens: of those, tokens served from cached blocks, the slots copied by token-granular hits
            included (once per request; never recompute).
        prefill_tokens: prompt tokens actually computed (includes recomputation after preemption).
        prefill_seconds: wall time spent in forward passes of prefill tokens.
        prefill_seconds_saved: prefill time the prefix cache saved, summed per request at its admission: its
            ``prefix_hit_tokens`` at the mean prefill rate (``prefill_seconds / prefill_tokens``) measured then
            (monotonic: a later change of the rate does not revise it; 0 for hits before any prefill).
        inflight_shared_tokens: prefill tokens saved because a request waited for blocks another request was
            computing at the same time (in-flight sharing); a subset of ``prefix_hit_tokens``.
        decode_tokens / decode_seconds: generated tokens and time spent in decode steps.
        blocks_total / blocks_used / blocks_cached / blocks_free: gauges; used = referenced by a request,
            cached = unreferenced but holding a reusable hashed block; used + cached + free == total.
        evictions: cached blocks evicted to make room.
        preemptions: running requests preempted (freed, later recomputed).
        running / waiting: gauges.
        ttft / tpot: histograms of time to first token and time per output token.
        forks: sequences forked from a request's computed prompt (``n > 1``: ``n - 1`` per request).
        forked_prefill_tokens_saved: prompt tokens the forks did not prefill (the prompt's length per fork
            that shared the parent's blocks).
        tier_counters: counters of the tiers below the pool (``engine.kv_tiers.counters``: hits and misses
            per tier in tokens, bytes per tier, writes dropped, entries rejected by cause, expirations per
            level, ...); empty without tiers.
        tier_load_seconds: load-back latency histogram (None without tiers).
        pinned_blocks: blocks held by pins (gauge).
        idle_prefills: idle prefills that computed their whole prompt (``AsyncEngine.prefill_next_turn``: a
            conversation's next-turn prefix, its reply included, prefilled while the engine had nothing else to
            do); they are not in ``requests``, ``prompt_tokens``, the prefix counters or the histograms.
        idle_prefill_tokens: tokens idle prefills computed (also in ``prefill_tokens``).
        idle_prefills_yielded: times an idle prefill stepped aside for another request (its computed blocks
            stay cached; it resumes at the next idle step).
        idle_prefills_dropped: idle prefills dropped unrun because they would have evicted cached blocks that
            requests released after they were queued (a pool that turns over faster than the conversations
            return).
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
    forks: int = 0
    forked_prefill_tokens_saved: int = 0
    tier_counters: dict[str, int] = field(default_factory=dict)
    tier_load_seconds: Histogram | None = None
    pinned_blocks: int = 0
    prefill_seconds_saved: float = 0.0
    idle_prefills: int = 0
    idle_prefill_tokens: int = 0
    idle_prefills_yielded: int = 0
    idle_prefills_dropped: int = 0
