"""Shared-prefix (cascade) decode attention equals the plain per-sequence gather within fp32 rounding.

Decode sequences whose block tables start with the same blocks read them once (``engine.decode_attention.SharedPrefix``
off CPU; on CPU the shared chunks of ``engine.chunked_decode``, tested there); the softmax over the shared part
and over each private part are merged by their log-sum-exp. Checked on one layer's attention directly (the
off-CPU planner forced: random K/V, GQA, ragged private lengths, bf16 cache) and through the engine (same greedy
tokens with the switch on and off, and the shared chunks really planned)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from engine.attention import attention_dtype, paged_attention, plan_attention
from engine.decode_attention import SHARED_PREFIX_MIN_TOKENS, shared_prefix_blocks
from tests.engine.engine_helpers import decode_meta, greedy, make_engine, random_tokens, tiny_checkpoint

BS = 16


def test_shared_prefix_blocks_stops_at_the_first_difference_and_before_each_last_token():
    assert shared_prefix_blocks([[1, 2, 3, 4], [1, 2, 5, 6]], [60, 60], BS) == 2
    assert shared_prefix_blocks([[1, 2, 3], [1, 2, 3]], [33, 48], BS) == 2  # (33 - 1) // 16 = 2
    assert shared_prefix_blocks([[1, 2, 3], [1, 2, 3]], [32, 48], BS) == 1  # position 31 is seq 0's own token
    assert shared_prefix_blocks([[7, 2], [1, 2]], [30, 30], BS) == 0


@pytest.fixture
def off_cpu_planner(monkeypatch):
    """``plan_attention`` as off CPU (no flash kernel with log-sum-exp): the ``SharedPrefix`` cascade."""
    monkeypatch.setattr("engine.attention.prefix_split_available", lambda device: False)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[100, 100, 100], [97, 130, 112, 160], [81, 82]])
def test_cascade_equals_plain_decode_attention(cache_dtype, lens, off_cpu_planner):
    kvh, group, d = 2, 3, 16
    g = torch.Generator().manual_seed(sum(lens))
    cache = torch.randn(2, 40, BS, kvh, d, generator=g).to(cache_dtype)
    shared = [5, 9, 2, 30, 7]  # 80 positions, not consecutive
    rest = iter(range(10, 40))
    tables = [shared + [next(rest) for _ in range(-(-n // BS) - len(shared))] for n in lens]
    meta = decode_meta(tables, lens)
    b = len(lens)
    q = torch.randn(b, kvh * group, d, generator=g)
    k = torch.randn(b, kvh, d, generator=g)
    v = torch.randn(b, kvh, d, generator=g)
    cascade = plan_attention(meta, torch.device("cpu"), 40, shared_prefix=True)
    plain = plan_attention(meta, torch.device("cpu"), 40, shared_prefix=False)
    assert cascade.decode.shared is not None and cascade.decode.shared.num_tokens == 80
    assert plain.decode.shared is None
    got = paged_attention(q, k, v, cache.clone(), cascade, d**-0.5)
    with mock.patch("engine.attention.attention_dtype", lambda cache, query, device: query):
        want = paged_attention(q, k, v, cache.clone(), plain, d**-0.5)  # fp32 compute of the same cache
    # both paths as they run: bf16 compute over a bf16 cache where the CPU has bf16 kernels
    # (``attention_dtype``; the cascade's two partial attentions too, merged in fp32): q and the probabilities
    # rounded to 8 significant bits; fp32 compute otherwise
    fast = paged_attention(q, k, v, cache.clone(), plain, d**-0.5)
    bf16 = attention_dtype(cache_dtype, torch.float32, torch.device("cpu")) == torch.bfloat16
    tol = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 2e-6, "rtol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(fast, want, **tol)
    torch.testing.assert_close(got, fast, **tol)


def test_too_short_a_shared_prefix_uses_the_plain_path(off_cpu_planner):
    lens = [SHARED_PREFIX_MIN_TOKENS + 5] * 2
    tables = [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5]]  # 64 shared positions, but seq lens leave 4 whole blocks
    plan = plan_attention(decode_meta(tables, lens), torch.device("cpu"), 8)
    assert plan.decode.shared is not None
    tables = [[0, 1, 2, 6, 4], [0, 1, 2, 3, 5]]  # 48 shared positions
    plan = plan_attention(decode_meta(tables, lens), torch.device("cpu"), 8)
    assert plan.decode.shared is None


@pytest.mark.parametrize("kind", ["hf", "qwen2"])
def test_engine_tokens_equal_with_shared_prefix_attention_on_and_off(kind, monkeypatch):
    ck = tiny_checkpoint(kind)
    system = random_tokens(300, 7)  # more than one decode chunk (256 positions): one shared chunk
    prompts = [system + random_tokens(5 + 3 * i, 20 + i) for i in range(5)]
    planned = []
    import engine.model as model_mod

    real = model_mod.plan_attention

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        dec = plan.decode
        planned.append(dec is not None and dec.chunked is not None and dec.chunked.shared is not None)
        return plan

    monkeypatch.setattr(model_mod, "plan_attention", spy)
    # shared chunks are planned where attention computes in bf16: as on a CPU with bf16 kernels (on one
    # without, torch still runs bf16 attention, slowly), so the cascade is checked on every machine
    monkeypatch.setattr("engine.attention._bf16_fast", lambda device: True)
    on = make_engine(
        ck, shared_prefix_attention=True, kv_dtype="bfloat16", decode_kernel="torch"
    )  # shared chunks: bf16 only
    on.generate([system], greedy(1))
    got = on.generate(prompts, greedy(12))
    assert sum(planned) >= 11  # the 5 decodes ran together through the cascade
    planned.clear()
    off = make_engine(ck, shared_prefix_attention=False, kv_dtype="bfloat16", decode_kernel="torch")
    off.generate([system], greedy(1))
    assert off.generate(prompts, greedy(12)) == got
    assert not any(planned)
