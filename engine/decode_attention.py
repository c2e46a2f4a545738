"""Decode attention over a paged KV cache: every sequence of a step with exactly one new token.

Owns the decode part of a step's plan (``DecodePlan``, ``SharedPrefix``, ``SplitDecode``; built by
``engine.attention.plan_attention`` with ``shared_prefix_blocks`` and ``plan_split_decode``) and the decode
paths ``decode_attention`` picks from (``engine.attention.paged_attention`` calls it per layer):

- one sequence attends over a view of its blocks (or one ``index_select`` when they are not consecutive) with
  ``F.scaled_dot_product_attention``; several attend one by one (``per_sequence_decode``), each over a view of
  its own blocks, so no padded context is copied. Query heads are folded into their KV group
  (``[B, kv_heads, group, head_dim]``) so grouped-query attention needs no copy.
- sequences whose block tables start with the same blocks (at least ``SHARED_PREFIX_MIN_TOKENS`` positions:
  one cached system prompt, many users) use cascade attention (``SharedPrefix``,
  ``cascade_decode_attention``): the shared blocks are read once and attended by every query of each KV group
  in one matmul, the private rest per sequence, and the two softmaxes merged by their log-sum-exp.

Over a bf16 cache on a CPU with bf16 kernels (AVX512-BF16 / AMX) decode attends a copy of the context, never
the cache in place: in a step ~66 MB of weights stream between two reads of a layer's context, so it is read
from memory, and the flash kernel's per-head reads (128 of every 384 bytes per position) go slower from memory
than one sequential copy followed by the kernel on the copy (``docs/engine-step.md``). One sequence, and the
cascade, take ``SplitDecode`` (``split_decode_attention``): each layer copies the blocks into one buffer made
once per step (one ``index_select``, or one copy when they are consecutive); the cascade's shared blocks are
attended once for all queries, the other blocks of all sequences in one masked call, the two merged by
log-sum-exp in fp32; one long sequence is cut into parts (``decode_chunks``) so every thread has work. Several
sequences without a shared prefix go one by one (``per_sequence_decode``), each context copied.

Invariants: the cache is only read here, never written. A sequence's result depends only on its own blocks
(beyond fp32 rounding): padding, in a batch or in the last part of a cut context, is masked to exact zeros.
Formulas: scaled dot-product attention (Vaswani et al. 2017), grouped-query attention (Ainslie et al. 2023),
cascade inference (Ye et al. 2024, FlashInfer), online-softmax merge (FlashAttention, Dao et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.block_gather import BlockGather, block_gather, length_mask
from engine.native_decode import NativeDecodeKernel, scratch_size


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
class NativeDecode:
    """Decode attention by the native kernel (``engine.native_decode``): the step's decode sequences' block
    tables and lengths as the kernel takes them, and one scratch buffer reused by every layer."""

    kernel: NativeDecodeKernel
    tables: torch.Tensor  # int32 [B_dec, blocks of the longest context]
    lens: torch.Tensor  # int32 [B_dec]
    max_len: int
    shared_len: int = 0  # leading positions all sequences share, read once for all (a multiple of 16)
    scratch: torch.Tensor | None = None  # fp32, made by the first layer

    def attend(self, q: torch.Tensor, layer_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """``q`` ``[B, H, D]`` -> fp32 ``[B, H, D]`` (``NativeDecodeKernel.attend``)."""
        if self.scratch is None:
            size = scratch_size(q.shape[0], q.shape[1], q.shape[2], self.max_len)
            self.scratch = torch.empty(size, dtype=torch.float32)
        return self.kernel.attend(
            q.contiguous(),
            layer_cache,
            self.tables,
            self.lens,
            self.max_len,
            scale,
            self.scratch,
            self.shared_len,
        )


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
    native: NativeDecode | None = (
        None  # the native kernel (``engine.native_decode``): every other path unused
    )


SHARED_PREFIX_MIN_TOKENS = 64  # cascade attention only when at least this many context positions are shared


def shared_prefix_blocks(tables: list[list[int]], lens: list[int], block_size: int) -> int:
    """How many leading blocks every table in ``tables`` has in common (same physical ids), limited to blocks
    that lie wholly before each sequence's last position (its own new token stays in its private part)."""
    limit = min((n - 1) // block_size for n in lens)
    first = tables[0]
    p = 0
    while p < limit and all(t[p] == first[p] for t in tables):
        p += 1
    return p


def plan_split_decode(
    tables: list[list[int]],
    lens: list[int],
    shared_blocks: int,
    block_size: int,
    pool_blocks: int,
    device: torch.device,
    threads: int | None = None,
) -> SplitDecode:
    """The ``SplitDecode`` of decode sequences with block tables ``tables`` (at least their used blocks) and
    context lengths ``lens`` whose first ``shared_blocks`` blocks are common (0: no cascade); ``threads`` as
    ``decode_chunks``' (the engine passes its configured count, ``AttentionMetadata.split_threads``)."""
    bs = block_size
    rests = [t[shared_blocks : -(-n // bs)] for t, n in zip(tables, lens, strict=True)]
    rest_lens = [n - shared_blocks * bs for n in lens]
    width = max(len(r) for r in rests)
    chunks = decode_chunks(width, threads) if len(tables) == 1 and not shared_blocks else 1
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
    if dec.native is not None:
        return dec.native.attend(q, layer_cache, scale).to(out_dtype)
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
