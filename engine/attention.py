"""Attention over a paged KV cache.

Layout (one layer): ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``; token
``t`` of a step writes its K/V at flat slot ``slot_mapping[t] = block_id * block_size + offset``. A sequence's
context ``[0, seq_len)`` lives in the blocks its block table lists, in order, so its token at position ``p`` is
at ``block_table[p // block_size] * block_size + p % block_size``. Blocks may be shared between sequences
(prefix caching): this module only reads them, it never assumes who wrote them.

One forward step runs a batch of ``B`` sequences flattened to ``T = sum(query_lens)`` rows. Sequence ``i``'s
new tokens are its positions ``seq_len - query_len .. seq_len - 1``; each attends causally to its whole context.
``plan_attention`` turns the metadata into index tensors once per step; ``paged_attention`` then runs per layer:

- prefill rows (``query_len > 1``) go one sequence at a time through ``F.scaled_dot_product_attention``; a
  sequence with nothing cached (``query_len == seq_len``) attends to its fresh K/V directly (``is_causal``),
  otherwise, on CPU, the cached prefix (read in place: a view of consecutive blocks) and the chunk's own K/V
  (causal) are attended separately and merged by their log-sum-exp (``prefix_split_attention``), elsewhere its
  context is gathered block-wise with one ``index_select`` and a bottom-right causal mask is used;
- decode rows (``query_len == 1``): one sequence attends over a view of its blocks (or one ``index_select``
  when they are not consecutive) with ``F.scaled_dot_product_attention``; several attend one by one
  (``per_sequence_decode``), each over a view of its own blocks, so no padded context is copied. Query heads are
  folded into their KV group (``[B, kv_heads, group, head_dim]``) so grouped-query attention needs no copy.
- decode rows whose block tables start with the same blocks (at least ``SHARED_PREFIX_MIN_TOKENS`` positions:
  one cached system prompt, many users) use cascade attention (``SharedPrefix``): the shared blocks are read
  once and attended by every query of each KV group in one matmul, the private rest per sequence, and the two
  softmaxes merged by their log-sum-exp. ``plan_attention(..., shared_prefix=False)`` switches it off.

Over a bf16 cache on a CPU with bf16 kernels (AVX512-BF16 / AMX) prefill and decode attention are computed in
bf16 as the cache stores them (``attention_dtype``), and decode attends a copy of the context, never the cache
in place: in a step ~66 MB of weights stream between two reads of a layer's context, so it is read from memory,
and the flash kernel's per-head reads (128 of every 384 bytes per position) go slower from memory than one
sequential copy followed by the kernel on the copy (``docs/engine-step.md``). One sequence, and the cascade,
take ``SplitDecode`` (``split_decode_attention``): each layer copies the blocks into one buffer made once per
step (one ``index_select``, or one copy when they are consecutive); the cascade's shared blocks are attended
once for all queries, the other blocks of all sequences in one masked call, the two merged by log-sum-exp in
fp32. Several sequences without a shared prefix go one by one (``per_sequence_decode``), each context copied.

Results do not depend on the batch a sequence runs in beyond fp32 rounding: masked padding contributes exact
zeros. Formulas: scaled dot-product attention (Vaswani et al. 2017), grouped-query attention (Ainslie et al.
2023), paged KV cache (Kwon et al. 2023, vLLM).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.block_gather import BlockGather, block_gather, length_mask


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
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    block_size: int


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


@dataclass
class SharedPrefix:
    """Decode sequences whose block tables start with the same ``num_tokens / block_size`` blocks (one cached
    system prompt, many users): those blocks are read once for all of them (cascade attention), the rest of each
    context (``private``) per sequence, and the two softmaxes merged by their log-sum-exp."""

    blocks: BlockGather  # the shared blocks, once
    num_tokens: int  # shared context positions (whole blocks)
    private: BlockGather  # each sequence's blocks after the shared ones, padded to the longest, concatenated
    private_len: int  # longest private part (tokens)
    private_mask: torch.Tensor | None  # bool [B_dec, 1, 1, private_len]; None when all are equally long


@dataclass
class SplitDecode:
    """Decode attention of ``B`` sequences over a bf16 cache on CPU (``split_decode_attention``): their context
    is copied, every layer, into one buffer made once per step (ONE ``index_select``, or one copy when the
    blocks are consecutive), and attended there by torch's CPU flash kernel:

    - ``num_shared`` blocks every sequence starts with (cascade attention, ``SharedPrefix``; 0 if none), copied
      once and attended once by all ``B * group`` queries of each KV head;
    - each sequence's other blocks (``rest``: its last, partial block last), padded with block 0 to the
      longest, attended by one call with an additive mask; merged with the shared part by log-sum-exp.

    Why copy: the flash kernel reads K/V per head (128 of every 384 bytes of a SmolLM2 position), which from
    memory (a decode step streams ~66 MB of weights between two reads of a layer's context, so the context is
    never in cache) is slower than one sequential copy plus the kernel on the copy (``docs/engine-step.md``).
    A sequence's result depends only on its own blocks: the padding is masked to exact zeros."""

    blocks: BlockGather  # the shared blocks, then B x rest_blocks blocks, sequence-major
    num_shared: int  # shared blocks (0: no cascade)
    rest_len: int  # longest rest (tokens)
    rest_mask: torch.Tensor | None  # bool [B, 1, 1, rest_len]; None when all rests are equally long
    rest_bias: torch.Tensor | None = None  # ``rest_mask`` as an additive bf16 mask, made once per step
    buffer: torch.Tensor | None = None  # the copy of one layer's blocks, made once per step
    chunks: int = (
        1  # one sequence's context cut into this many equal parts, attended as a batch (``decode_chunks``)
    )
    chunk_bias: torch.Tensor | None = (
        None  # additive bf16 ``[chunks, 1, 1, chunk_len]``: -inf past the context
    )

    def additive_rest_mask(self) -> torch.Tensor | None:
        """``rest_mask`` as the CPU flash kernel takes it: bf16 ``[B, 1, 1, rest_len]``, 0 where a position is
        attended and ``-inf`` elsewhere; None when all rests are equally long. Built once per step."""
        if self.rest_mask is not None and self.rest_bias is None:
            bias = torch.zeros(self.rest_mask.shape, dtype=torch.bfloat16, device=self.rest_mask.device)
            self.rest_bias = bias.masked_fill_(~self.rest_mask, float("-inf"))
        return self.rest_bias

    def read(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """This layer's blocks, copied into ``buffer``: ``[2, n, block_size, kv_heads, head_dim]``."""
        if self.buffer is None:
            row = layer_cache[0, 0].numel()
            self.buffer = layer_cache.new_empty(2 * self.blocks.num_blocks, row)
        return self.blocks.read_into(layer_cache, self.buffer)


@dataclass
class DecodePlan:
    """All sequences with exactly one new token, batched."""

    rows: torch.Tensor | None  # int64 [B_dec] rows of the step; None when the rows are exactly 0..T-1
    blocks: BlockGather | None  # the one decode sequence's blocks (None: shared or per_seq)
    mask: (
        torch.Tensor | None
    )  # bool [B_dec, 1, 1, max_len], True = a real context position; None if all equal
    max_len: int  # longest context among them (tokens)
    num_seqs: int
    shared: SharedPrefix | None = None  # set when cascade attention applies (``plan_attention``)
    per_seq: list[tuple[BlockGather, int]] | None = None  # (blocks, seq_len) each: ``per_sequence_decode``
    split: SplitDecode | None = None  # the bf16 CPU path when it applies (``split_decode_attention``)


@dataclass
class AttentionPlan:
    """Index tensors of one step, built once by ``plan_attention`` and shared by every layer."""

    slot_mapping: torch.Tensor
    num_tokens: int
    prefills: list[PrefillPlan]
    decode: DecodePlan | None


SHARED_PREFIX_MIN_TOKENS = 64  # cascade attention only when at least this many context positions are shared


def plan_split_decode(
    tables: list[list[int]],
    lens: list[int],
    shared_blocks: int,
    block_size: int,
    pool_blocks: int,
    device: torch.device,
) -> SplitDecode:
    """The ``SplitDecode`` of decode sequences with block tables ``tables`` (at least their used blocks) and
    context lengths ``lens`` whose first ``shared_blocks`` blocks are common (0: no cascade)."""
    bs = block_size
    rests = [t[shared_blocks : -(-n // bs)] for t, n in zip(tables, lens, strict=True)]
    rest_lens = [n - shared_blocks * bs for n in lens]
    width = max(len(r) for r in rests)
    chunks = decode_chunks(width) if len(tables) == 1 and not shared_blocks else 1
    if chunks > 1:  # one sequence: its blocks in ``chunks`` equal parts, the last padded with block 0
        per = -(-width // chunks)
        ids = rests[0] + [0] * (per * chunks - width)
        split = SplitDecode(block_gather(ids, pool_blocks, device), 0, rest_lens[0], None, chunks=chunks)
        pos = torch.arange(per * chunks * bs, device=device).view(chunks, 1, 1, per * bs)
        bias = torch.zeros(pos.shape, dtype=torch.bfloat16, device=device)
        split.chunk_bias = bias.masked_fill_(pos >= rest_lens[0], float("-inf"))
        return split
    ids = tables[0][:shared_blocks] + [b for r in rests for b in r + [0] * (width - len(r))]
    return SplitDecode(
        block_gather(ids, pool_blocks, device), shared_blocks, max(rest_lens), length_mask(rest_lens, device)
    )


DECODE_CHUNK_MIN_BLOCKS = 8
"""Shortest context (blocks) one decode sequence is cut into parts for (``decode_chunks``)."""


def decode_chunks(num_blocks: int, threads: int | None = None) -> int:
    """Parts to cut one decode sequence's ``num_blocks``-block context into so torch's CPU flash kernel, which
    runs one task per (batch row, KV head) for a one-token query, keeps every thread busy: with 3 KV heads on 2
    threads one call has 3 tasks and one thread idles a third of it; as 2 parts, 6 tasks. The parts are merged
    by log-sum-exp (``split_decode_attention``). ``threads``: default ``torch.get_num_threads()``; 1 part when
    it is 1 or the context is shorter than ``DECODE_CHUNK_MIN_BLOCKS`` blocks (never a part of padding only:
    each part starts before the context's last block)."""
    threads = torch.get_num_threads() if threads is None else threads
    if threads <= 1 or num_blocks < max(DECODE_CHUNK_MIN_BLOCKS, threads):
        return 1
    return threads


def shared_prefix_blocks(tables: list[list[int]], lens: list[int], block_size: int) -> int:
    """How many leading blocks every table in ``tables`` has in common (same physical ids), limited to blocks
    that lie wholly before each sequence's last position (its own new token stays in its private part)."""
    limit = min((n - 1) // block_size for n in lens)
    first = tables[0]
    p = 0
    while p < limit and all(t[p] == first[p] for t in tables):
        p += 1
    return p


def plan_attention(
    meta: AttentionMetadata,
    device: torch.device,
    pool_blocks: int,
    shared_prefix: bool = True,
) -> AttentionPlan:
    """Validate ``meta`` and precompute the gathers and masks of one step (see the module docstring).

    Args:
        meta: the step's metadata.
        device: where the model runs.
        pool_blocks: blocks in the KV cache (``kv_cache.shape[2]``).
        shared_prefix: allow cascade attention for decode sequences sharing at least
            ``SHARED_PREFIX_MIN_TOKENS`` positions of leading blocks (``SharedPrefix``).

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
        if qlen == 1:
            decode_seqs.append(i)
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
        split_ok = prefix_split_available(device)
        if p * bs >= SHARED_PREFIX_MIN_TOKENS:
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
            if split_ok:
                decode.split = plan_split_decode(dec_tables, lens, p, bs, pool_blocks, device)
        elif len(decode_seqs) > 1:
            per_seq = [
                (block_gather(t[: -(-n // bs)], pool_blocks, device), n)
                for t, n in zip(dec_tables, lens, strict=True)
            ]
            # no split: one buffer for B contexts outgrows the L2 cache the kernel should read it from (8 x
            # 1,071 SmolLM2 positions: 6.6 MB), so each context is copied and attended in turn
            decode = DecodePlan(rows, None, None, max_len, len(decode_seqs), per_seq=per_seq)
        else:
            ids = dec_tables[0][:nb]
            decode = DecodePlan(rows, block_gather(ids, pool_blocks, device), None, max_len, 1)
            if split_ok:
                decode.split = plan_split_decode(dec_tables, lens, 0, bs, pool_blocks, device)
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

    Returns:
        ``[T, num_heads * head_dim]`` attention output in ``out_dtype``.
    """
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


def decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    dec: DecodePlan,
    scale: float,
    group: int,
    adt: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Batched one-token attention: ``q`` ``[B, H, D]`` -> ``[B, H, D]`` in ``out_dtype`` (default q's dtype),
    computed in ``adt`` (``attention_dtype``; default q's dtype) except the cascade, which merges in fp32.

    K/V of all B sequences come from one ``index_select`` (or a view when their blocks are consecutive); query heads are folded into their KV group
    (``[B, kv_heads, group, D]``), so each KV head is read once and no K/V is repeated.
    """
    adt = adt or q.dtype
    out_dtype = out_dtype or q.dtype
    if dec.split is not None and adt == torch.bfloat16 and layer_cache.dtype == torch.bfloat16:
        return split_decode_attention(q, layer_cache, dec.split, scale, group, out_dtype)
    if dec.shared is not None:
        return cascade_decode_attention(q, layer_cache, dec.shared, scale, group).to(out_dtype)
    if dec.per_seq is not None:
        return per_sequence_decode(q, layer_cache, dec.per_seq, scale, group, adt).to(out_dtype)
    b, num_heads, head_dim = q.shape
    kvh = layer_cache.shape[-2]
    kv = dec.blocks.read(layer_cache).view(2, b, -1, kvh, head_dim)[:, :, : dec.max_len]
    kv = kv.transpose(2, 3).to(adt)  # [2, B, kv_heads, L, D]
    o = F.scaled_dot_product_attention(
        q.view(b, kvh, group, head_dim).to(adt), kv[0], kv[1], attn_mask=dec.mask, scale=scale
    )
    return o.reshape(b, num_heads, head_dim).to(out_dtype)


def _copied(blocks: BlockGather, layer_cache: torch.Tensor) -> torch.Tensor:
    """``blocks.read(layer_cache)``, copied when it is a view of the cache (consecutive blocks; a gather is a
    copy already): ``[2, n * block_size, kv_heads, head_dim]``."""
    kv = blocks.read(layer_cache)
    return kv if blocks.first is None else kv.clone()


def per_sequence_decode(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    seqs: list[tuple[BlockGather, int]],
    scale: float,
    group: int,
    adt: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode attention of ``B > 1`` sequences one by one: ``q`` ``[B, H, D]`` -> ``[B, H, D]``.

    Each sequence reads its own blocks (a view of the cache when they are consecutive, else one
    ``index_select``) and attends with two matmuls and a softmax, its query heads folded into their KV group.
    Against gathering all B contexts into one padded tensor and one masked ``scaled_dot_product_attention``:
    at 8 x 1,080 tokens of SmolLM2 context, 30 layers, one thread, 127 ms against 176 ms on an AVX2 EPYC
    (``bench/model_forward.py --step-profile`` shows the whole step). In bf16 (``adt``) each context is
    attended by the flash kernel on a copy (a view is cloned), which reads it faster than the cache in place
    (module docstring).
    """
    b, num_heads, head_dim = q.shape
    kvh = layer_cache.shape[-2]
    if adt is not None and adt != q.dtype:  # bf16 as the cache stores it (``attention_dtype``)
        qg = q.view(b, kvh, group, head_dim).to(adt)
        # 4-D inputs ([1, kvh, group, D] over [1, kvh, n, D]): torch's CPU flash kernel takes only 4-D inputs; a
        # 3-D call falls back to the unfused math path, 4.3x slower per call (0.37 vs 0.085 ms thread time at
        # 1,070 bf16 positions, SmolLM2 shapes, Xeon with AMX)
        # each context copied first (a view of consecutive blocks too): the kernel reads it faster from cache
        # than in place from memory (``SplitDecode``; docs/engine-step.md)
        out = torch.cat(
            [
                F.scaled_dot_product_attention(qg[i : i + 1], kv[0:1], kv[1:2], scale=scale)
                for i, (blocks, n) in enumerate(seqs)
                for kv in (_copied(blocks, layer_cache)[:, :n].transpose(1, 2),)
            ]
        )
        return out.view(b, num_heads, head_dim).to(q.dtype)
    out = q.new_empty(b, kvh, group, head_dim)
    qg = q.view(b, kvh, group, head_dim)
    for i, (blocks, n) in enumerate(seqs):
        kv = blocks.read(layer_cache)[:, :n].transpose(1, 2)  # [2, kvh, n, D]
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        s = torch.matmul(qg[i], kv[0].transpose(-1, -2)).mul_(scale)  # [kvh, group, n]
        torch.matmul(torch.softmax(s, dim=-1), kv[1], out=out[i])
    return out.view(b, num_heads, head_dim)


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """Softmax attention with its log-sum-exp: ``q`` ``[..., M, D]``, ``k``/``v`` ``[..., L, D]``, ``mask`` bool
    broadcastable to ``[..., M, L]`` (True = attend) -> (``[..., M, D]``, lse ``[..., M, 1]``), fp32."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s = s.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(s.sub_(lse).exp_(), v), lse


def cascade_decode_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, shared: SharedPrefix, scale: float, group: int
) -> torch.Tensor:
    """Decode attention for ``B`` sequences sharing leading blocks: ``q`` ``[B, H, D]`` -> ``[B, H, D]``.

    The shared blocks are read once and attended by all ``B * group`` queries of each KV head in one matmul
    (``[kv_heads, B * group, L_shared]``); each sequence's private blocks are attended as in
    ``decode_attention``; the two partial softmaxes are merged exactly by their log-sum-exp
    (``o = (o_s e^{lse_s} + o_p e^{lse_p}) / (e^{lse_s} + e^{lse_p})``; cascade inference, Ye et al. 2024,
    FlashInfer; the merge is FlashAttention's online softmax, Dao et al. 2022).
    """
    b, num_heads, head_dim = q.shape
    kvh = layer_cache.shape[-2]
    qf = q.float().view(b, kvh, group, head_dim)
    ks = shared.blocks.read(layer_cache).float().transpose(1, 2)  # [2, kvh, Ls, D]
    q_shared = qf.permute(1, 0, 2, 3).reshape(kvh, b * group, head_dim)
    o_s, lse_s = _attend_lse(q_shared, ks[0], ks[1], scale, None)  # [kvh, B*g, D], [kvh, B*g, 1]
    o_s = o_s.view(kvh, b, group, head_dim).permute(1, 0, 2, 3)
    lse_s = lse_s.view(kvh, b, group, 1).permute(1, 0, 2, 3)
    kv = shared.private.read(layer_cache).view(2, b, -1, kvh, head_dim)[:, :, : shared.private_len]
    kv = kv.transpose(2, 3).float()  # [2, B, kvh, Lp, D]
    o_p, lse_p = _attend_lse(qf, kv[0], kv[1], scale, shared.private_mask)  # [B, kvh, g, D], [B, kvh, g, 1]
    m = torch.maximum(lse_s, lse_p)
    w_s, w_p = (lse_s - m).exp_(), (lse_p - m).exp_()
    o = (o_s * w_s).add_(o_p * w_p).div_(w_s + w_p)
    return o.reshape(b, num_heads, head_dim).to(q.dtype)


def split_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    split: SplitDecode,
    scale: float,
    group: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode attention of ``B`` sequences over a bf16 cache (``SplitDecode``): the blocks copied into the
    step's buffer, then torch's CPU flash kernel on the copy, on the cache's bf16 as stored (it returns each
    row's log-sum-exp): the shared part once for all queries, the rest of every sequence in one masked call,
    the two merged in fp32, ``o = (o_s e^{l_s - m} + o_r e^{l_r - m}) / (e^{l_s - m} + e^{l_r - m})``,
    ``m = max(l_s, l_r)`` (FlashAttention's online softmax, Dao et al. 2022; cascade inference, Ye et al.
    2024). Without a shared part: one call, no merge.

    Rounding: that of ``decode_attention`` over a bf16 cache (``attention_dtype``: q and the probabilities in
    bf16, statistics and accumulation fp32); with a shared part, each partial output is rounded to bf16 before
    the fp32 merge as well.

    Args:
        q: ``[B, H, D]`` queries. layer_cache: this layer's bf16 cache. split: from ``plan_split_decode``.
        scale: softmax scale. group: query heads per KV head. out_dtype: result dtype (default q's).

    Returns:
        ``[B, H, D]`` in ``out_dtype``.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, num_heads, head_dim = q.shape
    kvh = layer_cache.shape[-2]
    out_dtype = out_dtype or q.dtype
    qg = q.view(b, kvh, group, head_dim).to(torch.bfloat16)
    kv = split.read(layer_cache)  # [2, n, bs, kvh, D]
    if (
        split.chunks > 1
    ):  # one sequence in ``c`` parts: a batch of c rows, each part's result merged by its lse
        c = split.chunks
        parts = kv.reshape(2, c, -1, kvh, head_dim).transpose(2, 3)  # [2, c, kvh, Lc, D]
        o, lse = flash(
            qg.expand(c, -1, -1, -1).contiguous(),
            parts[0],
            parts[1],
            0.0,
            False,
            attn_mask=split.chunk_bias,
            scale=scale,
        )  # [c, kvh, g, D], [c, kvh, g]
        w = lse.sub_(lse.amax(0)).exp_().unsqueeze(-1)  # [c, kvh, g, 1]
        o = (o.float() * w).sum(0).div_(w.sum(0))
        return o.reshape(b, num_heads, head_dim).to(out_dtype)
    ns = split.num_shared
    rest = kv[:, ns:].reshape(2, b, -1, kvh, head_dim)[:, :, : split.rest_len].transpose(2, 3)
    o_r, lse_r = flash(qg, rest[0], rest[1], 0.0, False, attn_mask=split.additive_rest_mask(), scale=scale)
    if not ns:
        return o_r.reshape(b, num_heads, head_dim).to(out_dtype)
    shared = kv[:, :ns].reshape(2, 1, -1, kvh, head_dim).transpose(2, 3)  # [2, 1, kvh, Ls, D]
    q_shared = qg.permute(1, 0, 2, 3).reshape(1, kvh, b * group, head_dim)
    o_s, lse_s = flash(
        q_shared, shared[0], shared[1], 0.0, False, scale=scale
    )  # [1, kvh, B*g, D], [1, kvh, B*g]
    o_s = o_s.view(kvh, b, group, head_dim).transpose(0, 1).float()
    lse_s = lse_s.view(kvh, b, group, 1).transpose(0, 1)
    lse_r = lse_r.unsqueeze(-1)
    m = torch.maximum(lse_s, lse_r)
    w_s, w_r = lse_s.sub(m).exp_(), lse_r.sub_(m).exp_()
    o = o_s.mul_(w_s).add_(o_r.float().mul_(w_r)).div_(w_s.add_(w_r))
    return o.reshape(b, num_heads, head_dim).to(out_dtype)
