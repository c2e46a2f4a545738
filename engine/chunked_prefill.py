"""Chunk-invariant prefill attention on CPU: keys cut at the decode chunks' fixed positions.

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
        allowed: per key chunk, bool ``[1, 1, max(rows, MIN_QUERY_ROWS), C]``: True where a row attends a key
            (causal in absolute positions, nothing at or past the context's end).
        chunk_tokens: ``C``.
        buffer: the copy of one layer's key chunks, made once per step.
    """

    blocks: BlockGather
    first_rows: list[int]
    allowed: list[torch.Tensor]
    chunk_tokens: int
    buffer: torch.Tensor | None = None
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] | None = None

    def mask(self, j: int, dtype: torch.dtype) -> torch.Tensor:
        """Key chunk ``j``'s ``allowed`` as an additive mask of ``dtype`` (0 / ``-inf``), made once per step."""
        if self._masks is None:
            self._masks = {}
        key = (j, dtype)
        if key not in self._masks:
            allowed = self.allowed[j]
            zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self._masks[key] = zeros.masked_fill_(~allowed, float("-inf"))
        return self._masks[key]


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
    allowed: list[torch.Tensor] = []
    positions = torch.arange(start, seq_len, device=device)
    for j in range(-(-seq_len // c)):
        part = table[j * cb : min((j + 1) * cb, used)]
        ids.extend(part + [0] * (cb - len(part)))
        first = max(start, j * c) - start
        rows = positions[first:]
        if rows.shape[0] < MIN_QUERY_ROWS:  # padding rows: copies of the last, dropped after the call
            rows = torch.cat([rows, rows[-1:].expand(MIN_QUERY_ROWS - rows.shape[0])])
        keys = torch.arange(j * c, (j + 1) * c, device=device)
        first_rows.append(first)
        allowed.append(((keys[None, :] <= rows[:, None]) & (keys[None, :] < seq_len))[None, None])
    return ChunkedPrefill(block_gather(ids, pool_blocks, device), first_rows, allowed, c)


def _attend_fp32_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention with log-sum-exp for the fp32 cache: ``q`` ``[1, H, M, D]`` (``M >= MIN_QUERY_ROWS``),
    ``k``/``v`` ``[1, kv_heads, C, D]``, ``mask`` ``[1, 1, M, C]`` -> (``[1, H, M, D]``, ``[1, H, M]``). Each KV head's
    query heads are stacked as rows of one matmul (fp32 GEMMs round a row alike at any row count from 4 up,
    measured; torch's fp32 flash kernel rounds by thread instead: ``engine.chunked_decode``)."""
    _, heads, m, d = q.shape
    kvh = k.shape[1]
    qg = q.view(kvh, heads // kvh * m, d)
    s = torch.matmul(qg, k[0].transpose(-1, -2).contiguous()).mul_(scale)
    s = s.view(kvh, heads // kvh, m, -1).add_(mask[0]).view(kvh, heads // kvh * m, -1)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v[0].contiguous())
    return o.view(1, heads, m, d), lse.view(1, heads, m)


def chunked_prefill_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, plan: ChunkedPrefill, scale: float, adt: torch.dtype
) -> torch.Tensor:
    """Attention of one prefill chunk (module docstring) over a cache that already holds its K/V, computed in
    ``adt``: bf16 (a bf16 cache on a CPU with bf16 kernels) on the flash kernel, fp32 with fp32 matmuls.

    Args:
        q: ``[L, H, D]`` the chunk's queries (RoPE applied), any float dtype (rounded to ``adt``).
        layer_cache: this layer's cache ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        plan: from ``plan_chunked_prefill``. scale: softmax scale. adt: bf16 or fp32.

    Returns:
        ``[L, H, D]`` fp32.

    Raises:
        ValueError: ``adt`` neither bf16 nor fp32.
    """
    if adt not in (torch.bfloat16, torch.float32):
        raise ValueError(f"chunked prefill attention computes in bf16 or fp32, not {adt}")
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    rows, heads, head_dim = q.shape
    kvh = layer_cache.shape[-2]
    c = plan.chunk_tokens
    n = len(plan.first_rows)
    if plan.buffer is None:
        plan.buffer = layer_cache.new_empty(2 * plan.blocks.num_blocks, layer_cache[0, 0].numel())
    kv = plan.blocks.read_into(layer_cache, plan.buffer).view(2, n, c, kvh, head_dim).transpose(2, 3)
    if kv.dtype != adt:
        kv = kv.to(adt)
    qh = q.to(adt).transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    o_all = q.new_zeros(n, rows, heads, head_dim, dtype=torch.float32)
    lse_all = q.new_full((n, rows, heads), float("-inf"), dtype=torch.float32)
    for j, first in enumerate(plan.first_rows):
        m = rows - first
        qj, k, v, mask = pad_rows(qh[:, :, first:]), kv[0, j : j + 1], kv[1, j : j + 1], plan.mask(j, adt)
        if adt == torch.bfloat16:
            o, lse = flash(qj, k, v, 0.0, False, attn_mask=mask, scale=scale)
        else:
            o, lse = _attend_fp32_rows(qj.contiguous(), k, v, mask, scale)
        # o: [1, H, max(m, 4), D], lse: [1, H, max(m, 4)]
        o_all[j, first:] = o[0, :, :m].transpose(0, 1)
        lse_all[j, first:] = lse[0, :, :m].transpose(0, 1)
    if n == 1:
        return o_all[0]
    d = lse_all.sub_(lse_all.amax(0)).unsqueeze(-1)
    w = d.expand(n, rows, heads, head_dim).exp()  # innermost dim head_dim, as decode's merge
    return o_all.mul_(w).sum(0).div_(w.sum(0))
