"""Batch-invariant decode attention on CPU: every context cut at FIXED positions, merged in a fixed order.

Issue 12 item 5: a sequence's logits must not depend on what else is in its step. Measured on torch 2.13's CPU
kernels (``docs/engine-step.md``, "Batch invariance"): the flash-attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) gives a query row the same bits at any row count from
``MIN_QUERY_ROWS`` = 4 up and wherever the row sits among them, but otherwise at 1-3 rows; another log-sum-exp
when the same keys come padded to another length; and bit-identical rows whatever the BATCH dimension holds
(other entries, their number, a stride-0 batch of one K/V or one query, the thread count). Its fp32 version
rounds differently on thread 0 and thread 1 (each thread's scratch buffer has its own alignment), while fp32
``torch.matmul`` over contiguous batches is batch- and thread-invariant from 4 rows up. So a decode step here:

- cuts each decode sequence's context into chunks of ``chunk_tokens`` (``DECODE_CHUNK_TOKENS`` rounded to whole
  blocks) at positions ``0, C, 2C, ...``: chunk ``j`` of a sequence is the same computation whether the
  sequence runs alone or with others, and whether its blocks are shared or not;
- attends every chunk over exactly ``C`` keys (the last chunk padded with block 0 and masked with an additive
  ``-inf``) with at least 4 query rows per call (a KV head's ``group`` query heads, zero rows appended when
  fewer: ``pad_rows``), chunks of all sequences stacked on the batch dimension: bf16 on the flash kernel, fp32
  with fp32 matmuls;
- merges each sequence's chunks by their log-sum-exp in fp32, chunk 0 first, with a fixed number of terms per
  sequence (absent chunks contribute exact zeros): ``o = sum_j o_j e^{l_j - m} / sum_j e^{l_j - m}``,
  ``m = max_j l_j`` (FlashAttention's online softmax, Dao et al. 2022; split-KV decoding, "flash-decoding").
  The exponentials are taken on a tensor whose innermost dimension is ``head_dim``, so an element never moves
  between the vectorized and the scalar tail path of ``exp`` when the batch grows.

``engine.chunked_prefill`` cuts prefill keys at the same positions, so a token's attention is the same bits as
a one-token decode and in any prefill chunk.

Cascade attention (Ye et al. 2024) survives as far as invariance allows: over a bf16 cache, the chunks that
lie wholly inside the blocks every decode sequence shares are copied once and attended in one call, all the
batch's queries of a KV head as its rows (allowed: from 4 rows up the row count changes no row), the shared
chunks as its batch. A partly shared chunk is attended per sequence. An fp32 cache shares no chunk (fp32
matmul over a stride-0 batch takes another path: not invariant).

Invariants: a sequence's output depends only on its query, its context and ``chunk_tokens``; the cache is only
read. Timings: ``docs/engine-step.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_gather import BlockGather, block_gather

MIN_QUERY_ROWS = 4
"""Fewest query rows per flash call: from 4 rows up a row's result does not depend on the row count or its place
among the rows (measured, 4-1,100 rows, with masks, 1 and 2 threads); at 1-3 rows the kernel rounds otherwise."""

DECODE_CHUNK_TOKENS = 256
"""Context positions per decode chunk (rounded down to whole blocks, at least one block): 1,070 positions are
5 chunks, 15 flash tasks with 3 KV heads, enough to keep 2 threads busy (``docs/engine-step.md``)."""


def chunk_blocks(block_size: int) -> int:
    """Blocks per decode chunk for ``block_size``-token blocks (``DECODE_CHUNK_TOKENS`` in whole blocks)."""
    return max(1, DECODE_CHUNK_TOKENS // block_size)


@dataclass
class ChunkedDecode:
    """The decode attention plan of one step (``plan_chunked_decode``), read by every layer.

    Attributes:
        num_seqs: ``B`` decode sequences. chunk_tokens: ``C``, positions per chunk.
        shared_chunks: ``S`` leading chunks every sequence has in the same blocks (bf16 cascade; else 0).
        shared: their blocks (``S * C / block_size``), or None.
        private: every other chunk's blocks, chunk after chunk (``P`` chunks), sequence-major.
        private_seq: int64 ``[P]``, the sequence of each private chunk.
        private_valid: bool ``[P, 1, 1, C]``, the real positions of each private chunk.
        max_chunks: most chunks of any sequence (``nmax``).
        merge_index: int64 ``[B * nmax]``: for chunk ``j`` of sequence ``b``, its row among the stacked partial
            results (shared chunk ``s`` of sequence ``b`` at ``s * B + b``, then the private chunks, then one
            empty row for absent chunks); None when the private chunks are exactly ``[B, nmax]`` in order.
    """

    num_seqs: int
    chunk_tokens: int
    shared_chunks: int
    shared: BlockGather | None
    private: BlockGather
    private_seq: torch.Tensor
    private_valid: torch.Tensor
    max_chunks: int
    merge_index: torch.Tensor | None
    _bias: dict[torch.dtype, torch.Tensor] | None = None
    _buffers: dict[str, torch.Tensor] | None = None

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """``private_valid`` as an additive mask of ``dtype``: 0 where attended, ``-inf`` elsewhere (once per
        step and dtype)."""
        if self._bias is None:
            self._bias = {}
        if dtype not in self._bias:
            b = torch.zeros(self.private_valid.shape, dtype=dtype, device=self.private_valid.device)
            self._bias[dtype] = b.masked_fill_(~self.private_valid, float("-inf"))
        return self._bias[dtype]

    def read(self, name: str, blocks: BlockGather, layer_cache: torch.Tensor) -> torch.Tensor:
        """``blocks`` of this layer copied into a buffer made once per step: ``[2, n * block_size, kvh, D]``."""
        if self._buffers is None:
            self._buffers = {}
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = layer_cache.new_empty(
                2 * blocks.num_blocks, layer_cache[0, 0].numel()
            )
        kvh, hd = layer_cache.shape[-2:]
        return blocks.read_into(layer_cache, buf).view(2, -1, kvh, hd)


def plan_chunked_decode(
    tables: list[list[int]],
    lens: list[int],
    shared_blocks: int,
    block_size: int,
    pool_blocks: int,
    device: torch.device,
) -> ChunkedDecode:
    """The ``ChunkedDecode`` of decode sequences with block tables ``tables`` (at least their used blocks) and
    context lengths ``lens``, whose first ``shared_blocks`` blocks are the same physical blocks (0: no cascade;
    only whole chunks inside them are shared)."""
    cb = chunk_blocks(block_size)
    c = cb * block_size
    b = len(tables)
    counts = [-(-n // c) for n in lens]
    nmax = max(counts)
    s = shared_blocks // cb if b > 1 else 0
    s = min([s, *(n // c for n in lens)])  # a shared chunk is whole in every sequence
    ids: list[int] = []
    seq_of: list[int] = []
    valid: list[int] = []
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        for j in range(s, counts[i]):
            part = t[j * cb : min((j + 1) * cb, -(-n // block_size))]
            ids.extend(part + [0] * (cb - len(part)))
            seq_of.append(i)
            valid.append(min(c, n - j * c))
    p = len(seq_of)
    merge = None
    if s or any(k != nmax for k in counts):
        rows: list[int] = []
        empty = s * b + p
        nxt = s * b
        for i in range(b):
            for j in range(nmax):
                if j < s:
                    rows.append(j * b + i)
                elif j < counts[i]:
                    rows.append(nxt)
                    nxt += 1
                else:
                    rows.append(empty)
        merge = torch.tensor(rows, dtype=torch.long, device=device)
    pos = torch.arange(c, device=device)
    return ChunkedDecode(
        num_seqs=b,
        chunk_tokens=c,
        shared_chunks=s,
        shared=block_gather(tables[0][: s * cb], pool_blocks, device) if s else None,
        private=block_gather(ids, pool_blocks, device),
        private_seq=torch.tensor(seq_of, dtype=torch.long, device=device),
        private_valid=(pos[None, :] < torch.tensor(valid, device=device)[:, None])[:, None, None, :],
        max_chunks=nmax,
        merge_index=merge,
    )


def _attend_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention with log-sum-exp: ``q`` ``[N, kvh, g, D]``, ``k``/``v`` ``[N, kvh, C, D]``, ``bias``
    ``[N, 1, 1, C]`` -> (``[N, kvh, g, D]``, ``[N, kvh, g]``); contiguous batches (fp32 GEMMs are batch- and
    thread-invariant over those, not over a stride-0 batch), rows padded to ``MIN_QUERY_ROWS`` (fp32 GEMMs,
    like the flash kernel, round a row alike at any row count from 4 up: a decode then equals its prefill)."""
    g = q.shape[2]
    s = torch.matmul(pad_rows(q), k.transpose(-1, -2).contiguous()).mul_(scale).add_(bias)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v.contiguous())
    return o[:, :, :g], lse[:, :, :g]


def pad_rows(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[N, heads, M, D]`` with zero rows appended up to ``MIN_QUERY_ROWS`` rows (the flash kernel rounds
    a row alike at any row count from 4 up, not below: module docstring); unchanged when ``M`` is enough."""
    m = q.shape[2]
    if m >= MIN_QUERY_ROWS:
        return q
    return torch.cat([q, q.new_zeros(*q.shape[:2], MIN_QUERY_ROWS - m, q.shape[3])], dim=2)


def chunked_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    plan: ChunkedDecode,
    scale: float,
    group: int,
    adt: torch.dtype,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode attention of ``B`` sequences (module docstring): ``q`` ``[B, H, D]`` -> ``[B, H, D]`` in
    ``out_dtype`` (default q's), computed in ``adt`` (``engine.attention.attention_dtype``): bf16 on the flash
    kernel (q and the probabilities rounded to bf16, statistics and accumulation fp32), fp32 with fp32
    matmuls. The merge is fp32. Shared chunks (``plan.shared``) need ``adt`` bf16.

    Raises:
        ValueError: ``adt`` neither bf16 nor fp32, or shared chunks with fp32 compute.
    """
    if adt not in (torch.bfloat16, torch.float32) or (plan.shared is not None and adt != torch.bfloat16):
        raise ValueError(
            f"chunked decode attention computes in bf16 or fp32 (shared chunks: bf16), not {adt}"
        )
    b, num_heads, head_dim = q.shape
    kvh = layer_cache.shape[-2]
    out_dtype = out_dtype or q.dtype
    c = plan.chunk_tokens
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qg = q.view(b, kvh, group, head_dim).to(adt)
    bias = plan.bias(adt)
    kv = plan.read("private", plan.private, layer_cache).view(2, -1, c, kvh, head_dim).transpose(2, 3)
    if kv.dtype != adt:
        kv = kv.to(adt)
    qp = qg.index_select(0, plan.private_seq) if plan.private_seq.shape[0] != b else qg
    if adt == torch.bfloat16:
        o, lse = flash(pad_rows(qp), kv[0], kv[1], 0.0, False, attn_mask=bias, scale=scale)
        o, lse = o[:, :, :group], lse[:, :, :group]
    else:
        o, lse = _attend_fp32(qp, kv[0], kv[1], bias, scale)
    if plan.merge_index is None and plan.max_chunks == 1:
        return o.reshape(b, num_heads, head_dim).to(out_dtype)
    if plan.merge_index is not None:
        outs, lses = [], []
        if plan.shared is not None:
            # every query of a KV head as the rows of one call (cascade attention: the shared K/V read once per
            # head and chunk), the shared chunks a batch, the queries a stride-0 batch over them
            s = plan.shared_chunks
            skv = plan.read("shared", plan.shared, layer_cache).view(2, s, c, kvh, head_dim).transpose(2, 3)
            qs = pad_rows(qg.permute(1, 0, 2, 3).reshape(1, kvh, b * group, head_dim))
            zero = bias.new_zeros(1, 1, 1, c)
            o_s, lse_s = flash(
                qs.expand(s, -1, -1, -1), skv[0], skv[1], 0.0, False, attn_mask=zero, scale=scale
            )
            o_s = o_s[:, :, : b * group].reshape(s, kvh, b, group, head_dim).transpose(1, 2)
            outs.append(o_s.reshape(s * b, kvh, group, head_dim))
            lses.append(
                lse_s[:, :, : b * group].reshape(s, kvh, b, group).transpose(1, 2).reshape(s * b, kvh, group)
            )
        outs += [o, o.new_zeros(1, kvh, group, head_dim)]
        lses += [lse, lse.new_full((1, kvh, group), float("-inf"))]
        o = torch.cat(outs).index_select(0, plan.merge_index)
        lse = torch.cat(lses).index_select(0, plan.merge_index)
    n = plan.max_chunks
    o = o.reshape(b, n, kvh, group, head_dim)
    lse = lse.reshape(b, n, kvh, group)
    d = lse.sub(lse.amax(1, keepdim=True)).unsqueeze(-1)
    w = d.expand(b, n, kvh, group, head_dim).exp()  # innermost dim head_dim: see the module docstring
    out = o.float().mul_(w).sum(1).div_(w.sum(1))
    return out.reshape(b, num_heads, head_dim).to(out_dtype)
