"""Decode attention over a paged KV cache: every sequence of a step with exactly one new token.

Owns the decode part of a step's plan (``DecodePlan``, ``SharedPrefix``; built by
``engine.attention.plan_attention`` with ``shared_prefix_blocks``) and the decode paths ``decode_attention``
picks from (``engine.attention.paged_attention`` calls it per layer):

- on CPU (where torch's flash kernel returns the log-sum-exp), every decode step, one sequence or many, with or
  without a shared prefix, takes ``engine.chunked_decode``: contexts cut at fixed positions, the parts merged
  in a fixed order, so a sequence's result does not depend on the rest of its batch (issue 12 item 5,
  ``docs/engine-step.md``);
- elsewhere (CUDA): one sequence attends over a view of its blocks (or one ``index_select``) with
  ``F.scaled_dot_product_attention``; several attend one by one (``per_sequence_decode``); sequences whose
  block tables start with the same blocks (at least ``SHARED_PREFIX_MIN_TOKENS`` positions) use cascade
  attention (``SharedPrefix``, ``cascade_decode_attention``): the shared blocks read once and attended by every
  query of each KV group in one matmul, the private rest per sequence, the two softmaxes merged by their
  log-sum-exp. These paths are not batch-invariant. Query heads are folded into their KV group
  (``[B, kv_heads, group, head_dim]``) so grouped-query attention needs no copy.

Invariants: the cache is only read here, never written. A sequence's result depends only on its own blocks:
padding is masked to exact zeros (and, on CPU, bit for bit on nothing else). Formulas: scaled dot-product
attention (Vaswani et al. 2017), grouped-query attention (Ainslie et al. 2023), cascade inference (Ye et al.
2024, FlashInfer), online-softmax merge (FlashAttention, Dao et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.block_gather import BlockGather
from engine.chunked_decode import ChunkedDecode, chunked_decode_attention
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
    chunked: ChunkedDecode | None = None  # the batch-invariant CPU path (``engine.chunked_decode``)
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
    if dec.chunked is not None:  # another compute dtype (an fp16 model over an fp32 cache) runs in fp32
        cdt = adt if adt in (torch.bfloat16, torch.float32) else torch.float32
        return chunked_decode_attention(q, layer_cache, dec.chunked, scale, group, cdt, out_dtype)
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
        # than in place from memory (docs/engine-step.md)
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
