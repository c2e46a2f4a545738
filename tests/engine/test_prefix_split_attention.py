"""Prefill over a cached prefix, split into prefix + own-chunk attention merged by log-sum-exp, equals the masked
attention over the gathered context (``engine.attention.prefix_split_attention``)."""

from __future__ import annotations

import random

import pytest
import torch

import engine.attention as attention
from engine.attention import AttentionMetadata, paged_attention, plan_attention

CPU = torch.device("cpu")
BS, POOL, KVH, H, D = 16, 80, 3, 9, 64

needs_split = pytest.mark.skipif(not attention.prefix_split_available(CPU), reason="CPU flash kernel")


def run(cached: int, qlen: int, table: list[int], dtype: torch.dtype, split: bool, monkeypatch):
    gen = torch.Generator().manual_seed(cached * 1000 + qlen)
    cache = torch.zeros(2, POOL, BS, KVH, D, dtype=dtype)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(cached)], dtype=torch.long)
    cache.view(2, -1, KVH, D)[:, slots] = torch.randn(2, cached, KVH, D, generator=gen).to(dtype)
    q, k, v = (torch.randn(qlen, n, D, generator=gen) for n in (H, KVH, KVH))
    seq_len = cached + qlen
    new = torch.tensor([table[p // BS] * BS + p % BS for p in range(cached, seq_len)], dtype=torch.long)
    meta = AttentionMetadata(new, [0, qlen], [seq_len], torch.tensor([table]), BS)
    monkeypatch.setattr(attention, "prefix_split_available", lambda device: split)
    plan = plan_attention(meta, CPU, POOL)
    return plan, paged_attention(q, k, v, cache, plan, D**-0.5)


@needs_split
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("cached", "qlen", "scrambled"), [(32, 20, False), (37, 5, True), (1024, 58, False), (16, 2, True)]
)
def test_split_equals_masked_gather(cached, qlen, scrambled, dtype, monkeypatch):
    nb = -(-(cached + qlen) // BS)
    table = random.Random(cached).sample(range(POOL), nb) if scrambled else list(range(3, 3 + nb))
    plan, got = run(cached, qlen, table, dtype, True, monkeypatch)
    (p,) = plan.prefills
    assert p.mask is None and p.blocks is None and p.prefix.num_blocks == -(-cached // BS)
    # consecutive blocks (one block is) are read as a view, not gathered
    assert (p.prefix.first is None) == (scrambled and p.prefix.num_blocks > 1)
    _, want = run(cached, qlen, table, dtype, False, monkeypatch)
    # fp32: summation order only; bf16: the merge sees two bf16-rounded partial outputs instead of one
    tol = 1e-5 if dtype == torch.float32 else 2**-7 * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol
