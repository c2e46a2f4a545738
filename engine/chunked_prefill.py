"""Chunk-invariant prefill attention on CPU over a bf16 cache: keys cut at the decode chunks' fixed positions.

A prompt's K/V must not depend on how it was cut into prefill chunks (the token budget, what else was in the
step, a prefix-cache hit or not: issue 12 item 5). Torch's CPU flash kernel gives a query row the same bits at
any row count from ``engine.chunked_decode.MIN_QUERY_ROWS`` up and wherever the row sits among them (measured:
``docs/engine-step.md``), but a row's log-sum-exp and output change with the key range the call covers. So,
as decode does (``engine.chunked_decode``), a prefill chunk of ``L`` rows (positions ``s .. e - 1``) attends its
context ``[0, e)`` in key chunks ``[jC, (j + 1) C)`` at fixed positions: for chunk ``j`` one flash call over
exactly ``C`` keys read from the cache (this step's K/V are written first), with the rows at positions
``>= jC`` (padded to ``MIN_QUERY_ROWS``) and an additive mask that is causal in absolute positions; then each
row's chunks are merged by log-sum-exp in fp32, chunk 0 first, absent chunks as exact zeros, exactly as decode
merges them. Row ``p``'s result depends only on its query, the cached K/V of ``[0, p]`` and ``C``: the same
whether its prompt came in one chunk or many, cached or not, and the same as its decode would be.

Invariant: the cache is only read. Cost: one flash call per key chunk and sequence, masks built once per step,
the merge (``docs/engine-step.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_gather import BlockGather, block_gather
from engine.chunked_decode import MIN_QUERY_ROWS, chunk_blocks, pad_rows


@dataclass
class ChunkedPrefill:
    """One prefill chunk's key chunks (``plan_chunked_prefill``), read by every layer.

    Attributes:
        blocks: the blocks of every key chunk, chunk after chunk (``chunk_blocks`` each, block 0 past the end).
        first_rows: per key chunk ``j``, the first of the chunk's rows (0-based) at a position ``>= jC``.
        masks: per key chunk, bf16 ``[1, 1, max(rows, MIN_QUERY_ROWS), C]``: 0 where a row attends a key, ``-inf``
            elsewhere (causal in absolute positions, nothing at or past the context's end).
        chunk_tokens: ``C``.
        buffer: the copy of one layer's key chunks, made once per step.
    """

    blocks: BlockGather
    first_rows: list[int]
    masks: list[torch.Tensor]
    chunk_tokens: int
    buffer: torch.Tensor | None = None


def plan_chunked_prefill(
    table: list[int], seq_len: int, query_len: int, block_size: int, pool_blocks: int, device: torch.device
) -> ChunkedPrefill:
    """The ``ChunkedPrefill`` of rows at positions ``seq_len - query_len .. seq_len - 1`` of a sequence whose
    blocks are ``table`` (at least its used ones)."""
    cb = chunk_blocks(block_size)
    c = cb * block_size
    start = seq_len - query_len
    used = -(-seq_len // block_size)
    ids: list[int] = []
    first_rows: list[int] = []
    masks: list[torch.Tensor] = []
    positions = torch.arange(start, seq_len, device=device)
    for j in range(-(-seq_len // c)):
        part = table[j * cb : min((j + 1) * cb, used)]
        ids.extend(part + [0] * (cb - len(part)))
        first = max(start, j * c) - start
        rows = positions[first:]
        if rows.shape[0] < MIN_QUERY_ROWS:  # padding rows: copies of the last, dropped after the call
            rows = torch.cat([rows, rows[-1:].expand(MIN_QUERY_ROWS - rows.shape[0])])
        keys = torch.arange(j * c, (j + 1) * c, device=device)
        allowed = (keys[None, :] <= rows[:, None]) & (keys[None, :] < seq_len)
        mask = torch.zeros(allowed.shape, dtype=torch.bfloat16, device=device).masked_fill_(
            ~allowed, float("-inf")
        )
        first_rows.append(first)
        masks.append(mask[None, None])
    return ChunkedPrefill(block_gather(ids, pool_blocks, device), first_rows, masks, c)


def chunked_prefill_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, plan: ChunkedPrefill, scale: float
) -> torch.Tensor:
    """Attention of one prefill chunk (module docstring) over a bf16 cache that already holds its K/V.

    Args:
        q: ``[L, H, D]`` the chunk's queries (RoPE applied), any float dtype (rounded to bf16).
        layer_cache: this layer's bf16 cache ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        plan: from ``plan_chunked_prefill``. scale: softmax scale.

    Returns:
        ``[L, H, D]`` fp32.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    rows, heads, head_dim = q.shape
    kvh = layer_cache.shape[-2]
    c = plan.chunk_tokens
    n = len(plan.first_rows)
    if plan.buffer is None:
        plan.buffer = layer_cache.new_empty(2 * plan.blocks.num_blocks, layer_cache[0, 0].numel())
    kv = plan.blocks.read_into(layer_cache, plan.buffer).view(2, n, c, kvh, head_dim).transpose(2, 3)
    qh = q.to(torch.bfloat16).transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    o_all = q.new_zeros(n, rows, heads, head_dim, dtype=torch.float32)
    lse_all = q.new_full((n, rows, heads), float("-inf"), dtype=torch.float32)
    for j, first in enumerate(plan.first_rows):
        m = rows - first
        o, lse = flash(
            pad_rows(qh[:, :, first:]),
            kv[0, j : j + 1],
            kv[1, j : j + 1],
            0.0,
            False,
            attn_mask=plan.masks[j],
            scale=scale,
        )  # [1, H, max(m, 4), D], [1, H, max(m, 4)]
        o_all[j, first:] = o[0, :, :m].transpose(0, 1)
        lse_all[j, first:] = lse[0, :, :m].transpose(0, 1)
    if n == 1:
        return o_all[0]
    d = lse_all.sub_(lse_all.amax(0)).unsqueeze(-1)
    w = d.expand(n, rows, heads, head_dim).exp()  # innermost dim head_dim, as decode's merge
    return o_all.mul_(w).sum(0).div_(w.sum(0))
