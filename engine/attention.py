"""Attention over a paged KV cache: the step's plan, prefill, and the per-layer dispatch.

Layout (one layer): ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``; token
``t`` of a step writes its K/V at flat slot ``slot_mapping[t] = block_id * block_size + offset``. A sequence's
context ``[0, seq_len)`` lives in the blocks its block table lists, in order, so its token at position ``p`` is
at ``block_table[p // block_size] * block_size + p % block_size``. Blocks may be shared between sequences
(prefix caching): this module only reads them, it never assumes who wrote them.

One forward step runs a batch of ``B`` sequences flattened to ``T = sum(query_lens)`` rows. Sequence ``i``'s
new tokens are its positions ``seq_len - query_len .. seq_len - 1``; each attends causally to its whole context.
``plan_attention`` turns the metadata into index tensors once per step; ``paged_attention`` then runs per layer:

- on CPU with the native prefill kernel (``AttentionMetadata.prefill_kernel``, ``engine.prefill_kernel: native``)
  every prefill chunk, and every one-token query that is still a prompt token, is attended by
  ``NativeDecodeKernel.prefill`` (``NativePrefill``): each row with exactly the arithmetic of the native decode
  kernel at that position, K/V read in place, so a prompt row's result does not depend on chunking, caching,
  the batch or the thread count; decode rows as below;
- on CPU, when the cache dtype is given (``cache_dtype``, the engine always gives it), every sequence's keys
  are cut at fixed positions: prefill rows (``query_len > 1``) go to ``engine.chunked_prefill`` and decode rows
  to ``engine.chunked_decode`` (through ``engine.decode_attention``), merged in a fixed order, so a row's
  result depends only on its query, its context and the chunk size: not on the rest of the batch, how its
  prompt was chunked, or a prefix-cache hit (issue 12 item 5, ``docs/engine-step.md``);
- otherwise (CUDA, or no ``cache_dtype``) prefill rows go one sequence at a time through
  ``F.scaled_dot_product_attention``; a sequence with nothing cached (``query_len == seq_len``) attends to its
  fresh K/V directly (``is_causal``), otherwise, on CPU, the cached prefix and the chunk's own K/V (causal) are
  attended separately and merged by their log-sum-exp (``prefix_split_attention``), elsewhere its context is
  gathered block-wise with one ``index_select`` and a bottom-right causal mask is used; decode rows
  (``query_len == 1``) go to ``engine.decode_attention`` (``DecodePlan``): one sequence over a view of its
  blocks, several one by one, and cascade attention (``SharedPrefix``) for those whose block tables start with
  the same blocks (at least ``SHARED_PREFIX_MIN_TOKENS`` positions); these paths are not batch-invariant.
  ``plan_attention(..., shared_prefix=False)`` switches the cascade (on CPU: shared chunks) off.

Over a bf16 cache on a CPU with bf16 kernels (AVX512-BF16 / AMX) prefill and decode attention are computed in
bf16 as the cache stores them (``attention_dtype``).

Invariants: the plan is built once per step and read by every layer; the cache is written only by
``write_kv`` at the step's slots, before any of the step's attention reads it. Masked padding contributes exact
zeros. Formulas: scaled dot-product attention (Vaswani et al. 2017),
grouped-query attention (Ainslie et al. 2023), paged KV cache (Kwon et al. 2023, vLLM).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.block_gather import BlockGather, block_gather, length_mask
from engine.chunked_decode import plan_chunked_decode
from engine.chunked_prefill import ChunkedPrefill, chunked_prefill_attention, plan_chunked_prefill
from engine.decode_attention import (
    SHARED_PREFIX_MIN_TOKENS,
    DecodePlan,
    NativeDecode,
    SharedPrefix,
    decode_attention,
    shared_prefix_blocks,
)
from engine.native_decode import NativeDecodeKernel


@dataclass
class AttentionMetadata:
    """One forward step over B sequences, flattened to T = sum(query_lens) tokens.

    Attributes:
        slot_mapping: int64 ``[T]``; flat slot ``block_id * block_size + offset`` where token t's K/V is written.
        query_start_loc: length B+1; tokens of seq i are rows ``query_start_loc[i]:query_start_loc[i+1]``.
        seq_lens: length B; context length of seq i AFTER this step (cached + new tokens).
        block_tables: int64 ``[B, max_blocks]``; physical block ids of each seq's logical blocks. Entries past
            a sequence's last block are padding and never read (any value, e.g. 0 or -1).
        block_size: tokens per block.
        decode_kernel: the native decode-attention kernel (``engine.native_decode``): on CPU the step's generated
            tokens (one new token past the prompt) are attended by it; None = torch's paths.
        prefill_kernel: the native kernel for prompt tokens (``NativeDecodeKernel.prefill``), or None: torch's
            prefill paths.
        prompt_lens: each sequence's prompt length, or None (unknown): with ``decode_kernel`` or
            ``prefill_kernel``, a one-token query that is still a prompt token (the last of a prompt whose rest
            was cached) takes the prefill path, so every prompt token is attended by the same code however the
            prompt was chunked or cached. (With the native builds of both kernels the two paths give the same
            bits anyway, the prefill kernel computing each row as the decode kernel does; the AMX and
            AVX512-BF16 prefill builds round otherwise.)
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    block_size: int
    decode_kernel: NativeDecodeKernel | None = None
    prompt_lens: list[int] | None = None
    prefill_kernel: NativeDecodeKernel | None = None


@dataclass
class NativePrefill:
    """One prefill chunk attended by the native kernel (``NativeDecodeKernel.prefill``): the sequence's block
    table as the kernel takes it, the chunk's first position, and a scratch buffer reused by every layer."""

    kernel: NativeDecodeKernel
    table: torch.Tensor  # int32 [blocks of the context]
    start: int  # position of the chunk's first row (tokens before it are cached)
    scratch: torch.Tensor | None = None  # fp32, made by the first layer

    def attend(self, q: torch.Tensor, layer_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """``q`` ``[L, H, D]`` -> fp32 ``[L, H, D]`` (``NativeDecodeKernel.prefill``)."""
        rows, heads, head_dim = q.shape
        threads = torch.get_num_threads()
        need = self.kernel.prefill_scratch_size(
            rows, heads, layer_cache.shape[-2], head_dim, self.start + rows, threads
        )
        if self.scratch is None or self.scratch.numel() < need:
            self.scratch = torch.empty(max(need, 1), dtype=torch.float32)
        return self.kernel.prefill(
            q.contiguous(), layer_cache, self.table, self.start, scale, self.scratch, threads
        )


@dataclass
class PrefillPlan:
    """One sequence with more than one new token: rows ``start:end`` of the step, context ``seq_len``."""

    start: int
    end: int
    seq_len: int
    blocks: BlockGather | None  # where its context lives; None when nothing is cached (fresh K/V used)
    mask: torch.Tensor | None  # bool [query_len, seq_len], True = attend; None when nothing is cached
    prefix: BlockGather | None = (
        None  # split path (``prefix_split_available``): blocks of [0, seq_len - qlen)
    )
    chunked: ChunkedPrefill | None = None  # the chunk-invariant CPU path (``engine.chunked_prefill``)
    native: NativePrefill | None = None  # the native kernel (``engine.prefill_kernel: native``)


@dataclass
class AttentionPlan:
    """Index tensors of one step, built once by ``plan_attention`` and shared by every layer."""

    slot_mapping: torch.Tensor
    num_tokens: int
    prefills: list[PrefillPlan]
    decode: DecodePlan | None


def plan_attention(
    meta: AttentionMetadata,
    device: torch.device,
    pool_blocks: int,
    shared_prefix: bool = True,
    cache_dtype: torch.dtype | None = None,
) -> AttentionPlan:
    """Validate ``meta`` and precompute the gathers and masks of one step (see the module docstring).

    Args:
        meta: the step's metadata.
        device: where the model runs.
        pool_blocks: blocks in the KV cache (``kv_cache.shape[2]``).
        shared_prefix: allow cascade attention for decode sequences sharing at least
            ``SHARED_PREFIX_MIN_TOKENS`` positions of leading blocks (``SharedPrefix``; on CPU the shared
            chunks of ``engine.chunked_decode``, over a bf16 cache only).
        cache_dtype: the KV cache's dtype (None: unknown, no shared chunks on CPU).

    Raises:
        ValueError: inconsistent metadata (lengths, a query longer than its context, a block table too short,
            a block id outside the pool).
    """
    qsl = meta.query_start_loc
    num_seqs = len(meta.seq_lens)
    if len(qsl) != num_seqs + 1 or qsl[0] != 0:
        raise ValueError(f"query_start_loc {qsl} does not match {num_seqs} sequences")
    num_tokens = qsl[-1]
    if meta.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(meta.slot_mapping.shape)}, expected ({num_tokens},)")
    bs = meta.block_size
    max_blocks = meta.block_tables.shape[1] if meta.block_tables.dim() == 2 else 0
    tables = meta.block_tables.tolist()  # block tables are small; planning happens once per step on the CPU
    prefills: list[PrefillPlan] = []
    decode_seqs: list[int] = []
    # on CPU, keys cut at fixed positions, prefill and decode alike (``engine.chunked_prefill``,
    # ``engine.chunked_decode``), when the compute dtype is known to be bf16 or fp32; shared decode chunks: bf16
    adt = None if cache_dtype is None else attention_dtype(cache_dtype, torch.float32, device)
    chunked_prefill = prefix_split_available(device) and adt in (torch.bfloat16, torch.float32)
    bf16 = adt == torch.bfloat16
    native_prefill = meta.prefill_kernel is not None and device.type == "cpu"
    prompt_path = native_prefill or (meta.decode_kernel is not None and chunked_prefill)
    for i, seq_len in enumerate(meta.seq_lens):
        qlen = qsl[i + 1] - qsl[i]
        if qlen <= 0 or qlen > seq_len:
            raise ValueError(f"sequence {i}: query_len {qlen} is not in [1, seq_len={seq_len}]")
        nb = -(-seq_len // bs)
        if nb > max_blocks:
            raise ValueError(
                f"sequence {i}: seq_len {seq_len} needs more than the {max_blocks} blocks of its table"
            )
        if not all(0 <= b < pool_blocks for b in tables[i][:nb]):
            raise ValueError(
                f"sequence {i}: block table {tables[i][:nb]} has ids outside the pool of {pool_blocks}"
            )
        prompt_token = meta.prompt_lens is not None and seq_len <= meta.prompt_lens[i]
        if qlen == 1 and not (prompt_path and prompt_token):
            decode_seqs.append(i)
        elif native_prefill:
            table = torch.tensor(tables[i][:nb], dtype=torch.int32)
            native = NativePrefill(meta.prefill_kernel, table, seq_len - qlen)
            prefills.append(PrefillPlan(qsl[i], qsl[i + 1], seq_len, None, None, native=native))
        elif chunked_prefill:
            chunked = plan_chunked_prefill(tables[i], seq_len, qlen, bs, pool_blocks, device)
            prefills.append(PrefillPlan(qsl[i], qsl[i + 1], seq_len, None, None, chunked=chunked))
        elif qlen == seq_len:
            prefills.append(PrefillPlan(qsl[i], qsl[i + 1], seq_len, None, None))
        elif prefix_split_available(device):
            cached = seq_len - qlen
            prefix = block_gather(tables[i][: -(-cached // bs)], pool_blocks, device)
            prefills.append(PrefillPlan(qsl[i], qsl[i + 1], seq_len, None, None, prefix))
        else:
            mask = torch.ones(qlen, seq_len, dtype=torch.bool, device=device).tril_(seq_len - qlen)
            prefills.append(
                PrefillPlan(
                    qsl[i], qsl[i + 1], seq_len, block_gather(tables[i][:nb], pool_blocks, device), mask
                )
            )
    decode = None
    if decode_seqs:
        lens = [meta.seq_lens[i] for i in decode_seqs]
        max_len = max(lens)
        nb = -(-max_len // bs)
        rows = None
        if not (len(decode_seqs) == num_seqs and num_tokens == num_seqs):
            rows = torch.tensor([qsl[i] for i in decode_seqs], dtype=torch.long, device=device)
        dec_tables = [tables[i] for i in decode_seqs]
        p = shared_prefix_blocks(dec_tables, lens, bs) if shared_prefix and len(decode_seqs) > 1 else 0
        if meta.decode_kernel is not None and device.type == "cpu":
            # every sequence alone, so batched == alone; blocks all share walked across them (read once)
            native = NativeDecode(
                meta.decode_kernel,
                torch.tensor([t[:nb] for t in dec_tables], dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32),
                max_len,
                shared_len=p * bs // 16 * 16,
            )
            decode = DecodePlan(rows, None, None, max_len, len(decode_seqs), native=native)
            return AttentionPlan(
                meta.slot_mapping.to(device=device, dtype=torch.long), num_tokens, prefills, decode
            )
        if p * bs < SHARED_PREFIX_MIN_TOKENS:
            p = 0
        if prefix_split_available(device):
            # batch-invariant: fixed chunks, merged in a fixed order (``engine.chunked_decode``); shared chunks
            # only where they are attended in bf16 (fp32 matmuls over a stride-0 batch round differently)
            chunked = plan_chunked_decode(dec_tables, lens, p if bf16 else 0, bs, pool_blocks, device)
            decode = DecodePlan(rows, None, None, max_len, len(decode_seqs), chunked=chunked)
        elif p:
            priv_lens = [n - p * bs for n in lens]
            priv_len = max(priv_lens)
            ids = [b if 0 <= b < pool_blocks else 0 for t in dec_tables for b in t[p:nb]]
            shared = SharedPrefix(
                block_gather(dec_tables[0][:p], pool_blocks, device),
                p * bs,
                block_gather(ids, pool_blocks, device),
                priv_len,
                length_mask(priv_lens, device),
            )
            decode = DecodePlan(rows, None, None, max_len, len(decode_seqs), shared)
        elif len(decode_seqs) > 1:
            per_seq = [
                (block_gather(t[: -(-n // bs)], pool_blocks, device), n)
                for t, n in zip(dec_tables, lens, strict=True)
            ]
            decode = DecodePlan(rows, None, None, max_len, len(decode_seqs), per_seq=per_seq)
        else:
            decode = DecodePlan(rows, block_gather(dec_tables[0][:nb], pool_blocks, device), None, max_len, 1)
    slots = meta.slot_mapping.to(device=device, dtype=torch.long)
    return AttentionPlan(slots, num_tokens, prefills, decode)


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the step's keys/values ``[T, kv_heads, head_dim]`` at flat ``slots`` ``[T]`` of one layer's cache
    ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
    kvh, hd = layer_cache.shape[-2:]
    dt = layer_cache.dtype
    # one copy for K and V together: [2, T, kvh, hd] into the cache viewed as [2, slots, kvh, hd]
    layer_cache.view(2, -1, kvh, hd).index_copy_(1, slots, torch.stack((k.to(dt), v.to(dt))))


@functools.cache
def _bf16_fast(device: torch.device) -> bool:
    from engine.weight_format import bf16_kernels_available

    return bf16_kernels_available(device)


def attention_dtype(cache_dtype: torch.dtype, query_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Dtype attention is computed in (prefill and plain decode; the cascade merge stays fp32): the cache's
    bf16 where the CPU has bf16 kernels (AVX512-BF16 / AMX, or CUDA), so the cached context is read as
    stored instead of widened to fp32 every layer of every step, else the query's dtype.

    Measured on a 2-core Xeon with AMX (one thread, thread time, SmolLM2 shapes: 9 query heads, 3 KV heads,
    head_dim 64): causal prefill of 1,070 tokens 29 ms fp32 against 12 ms bf16 per layer; one decode query
    over 1,072 cached bf16 positions 0.56 ms (widen to fp32, fp32 attention) against 0.26 ms (bf16 as stored)
    per layer. Inputs are already bf16 (the cache holds bf16 K/V); q and the probabilities are rounded to bf16
    too (softmax statistics and accumulation stay fp32 inside ``scaled_dot_product_attention``): a relative
    difference of ~3e-3 in the attention output against fp32 compute of the same cache.
    """
    if cache_dtype == torch.bfloat16 and _bf16_fast(device):
        return torch.bfloat16
    return query_dtype


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out_dtype: torch.dtype | None = None,
    kv_stored: bool = False,
) -> torch.Tensor:
    """Causal attention of one layer for one step, after writing the step's K/V into the cache.

    Args:
        q: ``[T, num_heads, head_dim]`` queries, RoPE applied.
        k, v: ``[T, num_kv_heads, head_dim]`` this step's keys (RoPE applied) and values.
        layer_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` of this layer (0 = K, 1 = V).
        plan: from ``plan_attention``.
        scale: softmax scale (``head_dim ** -0.5``).
        out_dtype: dtype of the output (default q's): bf16 when the next linear rounds its input to bf16
            anyway (``engine.linear.bf16_in_out``), so bf16 attention output is not widened and narrowed again.
        kv_stored: the step's K/V are in the cache already (the glue kernel stored them: ``engine.native_glue``).

    Returns:
        ``[T, num_heads * head_dim]`` attention output in ``out_dtype``.
    """
    if not kv_stored:
        write_kv(layer_cache, k, v, plan.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    dec = plan.decode
    adt = attention_dtype(layer_cache.dtype, q.dtype, q.device)
    out_dtype = out_dtype or q.dtype
    if dec is not None and not plan.prefills and dec.rows is None:
        return decode_attention(q, layer_cache, dec, scale, group, adt, out_dtype).reshape(
            num_tokens, num_heads * head_dim
        )
    out = q.new_empty(num_tokens, num_heads, head_dim, dtype=out_dtype)
    for p in plan.prefills:
        if p.native is not None:
            out[p.start : p.end] = p.native.attend(q[p.start : p.end], layer_cache, scale)
            continue
        if p.chunked is not None:
            out[p.start : p.end] = chunked_prefill_attention(
                q[p.start : p.end],
                layer_cache,
                p.chunked,
                scale,
                adt if adt == torch.bfloat16 else torch.float32,
            )
            continue
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0).to(adt)  # [1, H, L, D]
        if p.prefix is not None:
            o = prefix_split_attention(qs, k[p.start : p.end], v[p.start : p.end], layer_cache, p, scale)
            out[p.start : p.end] = o
            continue
        if p.blocks is None:  # fresh K/V, rounded as the cache stores them
            ks, vs = k[p.start : p.end].to(layer_cache.dtype), v[p.start : p.end].to(layer_cache.dtype)
        else:
            kv = p.blocks.read(layer_cache)[:, : p.seq_len]
            ks, vs = kv[0], kv[1]
        ks, vs = ks.to(adt), vs.to(adt)
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[p.start : p.end] = o[0].transpose(0, 1)
    if dec is not None:
        qd = q if dec.rows is None else q.index_select(0, dec.rows)
        od = decode_attention(qd, layer_cache, dec, scale, group, adt, out_dtype)
        if dec.rows is None:
            out.copy_(od.view_as(out))
        else:
            out.index_copy_(0, dec.rows, od.view(-1, num_heads, head_dim))
    return out.view(num_tokens, num_heads * head_dim)


@functools.cache
def prefix_split_available(device: torch.device) -> bool:
    """Whether prefill over a cached prefix runs split (``prefix_split_attention``): on CPU, where torch's
    flash-attention kernel returns the log-sum-exp the merge needs."""
    return torch.device(device).type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    )


def prefix_split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    p: PrefillPlan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one prefill chunk over a cached prefix, without gathering the prefix or a mask.

    Every new row sees all ``c = seq_len - query_len`` cached positions and, causally, the chunk's own keys.
    So the two parts are attended separately with torch's CPU flash-attention kernel, which returns each
    row's log-sum-exp: the prefix read in place (a view of the cache when its blocks are consecutive, the
    usual case, else one ``index_select``), no mask; the fresh K/V (rounded to the cache dtype, as the cache
    holds them) with a square causal mask (``is_causal``). The partial softmaxes are merged exactly by their
    log-sum-exp in fp32 (FlashAttention's online softmax, Dao et al. 2022): ``o = (o_1 e^{l_1} + o_2 e^{l_2})
    / (e^{l_1} + e^{l_2})``. Against one masked pass over the gathered ``[0, seq_len)`` this copies no cached
    K/V, builds no ``[query_len, seq_len]`` mask, and skips the masked scores.

    Args:
        q: ``[1, H, L, D]`` queries in the attention dtype. k, v: ``[L, kv_heads, D]`` the chunk's keys/values.
        layer_cache: this layer's cache. p: the chunk's plan (``p.prefix`` set). scale: softmax scale.

    Returns:
        ``[L, H, D]`` fp32 attention output.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    adt = q.dtype
    cached = p.seq_len - (p.end - p.start)
    kv = p.prefix.read(layer_cache)[:, :cached]  # [2, c, kvh, D]
    kp = kv[0].transpose(0, 1).unsqueeze(0)
    vp = kv[1].transpose(0, 1).unsqueeze(0)
    if kp.dtype != adt:
        kp, vp = kp.to(adt), vp.to(adt)
    dt = layer_cache.dtype
    kn = k.to(dt).to(adt).transpose(0, 1).unsqueeze(0)
    vn = v.to(dt).to(adt).transpose(0, 1).unsqueeze(0)
    o1, l1 = flash(q, kp, vp, 0.0, False, scale=scale)  # [1, H, L, D], lse [1, H, L]
    o2, l2 = flash(q, kn, vn, 0.0, True, scale=scale)
    m = torch.maximum(l1, l2)
    w1 = l1.sub_(m).exp_().unsqueeze(-1)
    w2 = l2.sub_(m).exp_().unsqueeze(-1)
    o = o1.float().mul_(w1).add_(o2.float().mul_(w2)).div_(w1.add_(w2))
    return o[0].transpose(0, 1)
