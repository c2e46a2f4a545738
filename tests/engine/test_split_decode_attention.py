"""Decode attention over a bf16 cache on CPU (``engine.decode_attention.SplitDecode``): the context copied into a
buffer made once per step, the shared prefix attended once, merged by log-sum-exp; equal to fp32 attention over
the gathered context within bf16 rounding.

Checked on one layer directly (random K/V, GQA, ragged lengths, consecutive and scattered blocks, with and
without a shared prefix) against fp32 attention over the gathered context, and through the engine on SmolLM2
with a bf16 KV cache: cache on == cache off and batched == alone, same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention, plan_attention
from engine.decode_attention import decode_chunks, plan_split_decode, split_decode_attention
from tests.engine.engine_helpers import greedy, make_engine, smollm2_checkpoint

BS = 16
POOL = 300
KVH, GROUP, D = 3, 3, 64
CPU = torch.device("cpu")


def decode_meta(tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=list(range(len(lens) + 1)),
        seq_lens=lens,
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
        block_size=BS,
    )


RUN = list(range(40, 102))  # 62 consecutive blocks: a cached system prompt
CASES = {
    "consecutive blocks": ([list(range(0, 68))], [1071]),
    "prefix hit, fresh blocks elsewhere": ([RUN + [200, 201, 150]], [62 * BS + 40]),
    "two sequences": ([RUN + [200, 201, 150], list(range(110, 140)) + [299]], [1032, 483]),
    "two sequences, consecutive blocks": ([list(range(0, 10)), list(range(20, 30))], [150, 160]),
    "ragged, scattered": ([RUN + [200], [3, 7, 9]], [62 * BS + 1, 40]),
    "cascade, short private parts": ([RUN[:20] + [200, 201], RUN[:20] + [150, 151, 152]], [340, 360]),
    "cascade, longer private parts": (
        [RUN[:5] + list(range(110, 125)) + [200], RUN[:5] + [150, 151]],
        [323, 100],
    ),
}


SHARED = {"cascade, short private parts": 20, "cascade, longer private parts": 5}


@pytest.mark.parametrize("case", list(CASES))
def test_split_plan_covers_each_context_once(case):
    tables, lens = CASES[case]
    shared = SHARED.get(case, 0)
    split = plan_split_decode(tables, lens, shared, BS, POOL, CPU)
    assert split.num_shared == shared
    blocks = split.blocks
    ids = list(range(blocks.first, blocks.first + blocks.num_blocks)) if blocks.rows is None else None
    ids = ids or blocks.rows[: blocks.num_blocks].tolist()
    width = (len(ids) - shared) // len(lens)
    rest_lens = [n - shared * BS for n in lens]
    assert split.rest_len == max(rest_lens)
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        nb = -(-n // BS)
        assert ids[:shared] + ids[shared + i * width : shared + i * width + nb - shared] == t[:nb]
    if split.rest_mask is not None:
        assert split.rest_mask.sum(-1).flatten().tolist() == rest_lens


@pytest.mark.parametrize("case", list(CASES))
def test_split_equals_fp32_attention_over_the_gathered_context(case):
    tables, lens = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    cache = torch.randn(2, 2, POOL, BS, KVH, D, generator=g).to(torch.bfloat16)  # two layers
    b = len(lens)
    meta = decode_meta(tables, lens)
    plan = plan_attention(meta, CPU, POOL)
    shared = SHARED.get(case, 0)
    split = plan.decode.split or plan_split_decode(tables, lens, shared, BS, POOL, CPU)
    assert split.num_shared == shared
    for layer in range(2):
        q = torch.randn(b, KVH * GROUP, D, generator=g)
        k = torch.randn(b, KVH, D, generator=g)
        v = torch.randn(b, KVH, D, generator=g)
        kv = cache[layer]
        # as the step runs it (split, or one by one without a shared prefix), after writing this step's K/V
        planned = paged_attention(q, k, v, kv, plan_attention(meta, CPU, POOL), D**-0.5)
        got = split_decode_attention(q, kv, split, D**-0.5, GROUP, torch.float32)
        # reference: fp32 softmax attention of each query group over its gathered context
        want = torch.empty(b, KVH, GROUP, D)
        for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
            ctx = (
                kv[:, t[: -(-n // BS)]].reshape(2, -1, KVH, D)[:, :n].float().transpose(1, 2)
            )  # [2, kvh, n, D]
            s = q[i].view(KVH, GROUP, D).to(torch.bfloat16).float() @ ctx[0].transpose(-1, -2) * D**-0.5
            want[i] = torch.softmax(s, -1) @ ctx[1]
        # bf16 query and probabilities (as the flash kernel rounds them), bf16 partial outputs: 8 significant bits
        torch.testing.assert_close(got, want.view(b, KVH * GROUP, D), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(
            planned.view(b, KVH * GROUP, D), want.view(b, KVH * GROUP, D), atol=2e-2, rtol=2e-2
        )
    assert split.buffer.shape == (2 * split.blocks.num_blocks, BS * KVH * D)  # one buffer, both layers


def test_bf16_decode_goes_through_the_split_path_with_one_buffer(monkeypatch):
    import engine.attention as attention
    import engine.decode_attention as decode_attention

    calls = []
    real = decode_attention.split_decode_attention
    monkeypatch.setattr(
        decode_attention, "split_decode_attention", lambda *a, **k: calls.append(a[2]) or real(*a, **k)
    )
    monkeypatch.setattr(attention, "_bf16_fast", lambda device: True)
    tables, lens = CASES["cascade, short private parts"]
    cache = torch.randn(3, 2, POOL, BS, KVH, D).to(torch.bfloat16)
    plan = plan_attention(decode_meta(tables, lens), CPU, POOL)
    assert (
        plan_attention(decode_meta(*CASES["two sequences"]), CPU, POOL).decode.split is None
    )  # per sequence
    q, k, v = torch.randn(2, KVH * GROUP, D), torch.randn(2, KVH, D), torch.randn(2, KVH, D)
    for layer in range(3):
        paged_attention(q, k, v, cache[layer], plan, D**-0.5)
    assert len(calls) == 3 and all(c is plan.decode.split for c in calls)
    assert plan.decode.split.buffer is not None
    fp32 = plan_attention(decode_meta(tables, lens), CPU, POOL)
    paged_attention(q, k, v, cache[0].float(), fp32, D**-0.5)  # an fp32 cache keeps the fp32 paths
    assert len(calls) == 3 and fp32.decode.split.buffer is None


@pytest.mark.slow
def test_smollm2_bf16_cache_split_decode_keeps_greedy_tokens():
    """SmolLM2 with a bf16 KV cache: a prompt whose system prefix is cached (blocks not consecutive) and the
    same prompts batched (cascade over the shared prefix) get the greedy tokens each gets alone with caching
    off."""
    ckpt = smollm2_checkpoint()
    tok = ckpt.tokenizer
    system = "You are a helpful assistant for a train company. Answer briefly and politely. " * 8
    prompts = [
        tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("When is the first train?", "How much is a ticket?", "Can I bring a bike?")
    ]
    n_new = 12

    def alone(prompt: list[int]) -> list[int]:
        eng = make_engine(ckpt, kv_dtype="bfloat16", enable_prefix_caching=False, decode_kernel="torch")
        return eng.generate([prompt], greedy(n_new))[0]

    refs = [alone(p) for p in prompts]
    eng = make_engine(ckpt, kv_dtype="bfloat16", decode_kernel="torch")
    eng.generate([prompts[0]], greedy(2))
    plans = []
    import engine.model as model_mod

    real = model_mod.plan_attention

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        plans.append(plan.decode is not None and plan.decode.split is not None)
        return plan

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_mod, "plan_attention", spy)
        assert (
            eng.generate([prompts[1]], greedy(n_new))[0] == refs[1]
        )  # cached prefix, fresh blocks elsewhere
        assert eng.generate(prompts, greedy(n_new)) == refs  # batched, cascade over the shared prefix
    assert sum(plans) >= 2 * (n_new - 1)


ONE_SEQUENCE = {
    "consecutive, whole blocks": ([list(range(0, 68))], [68 * BS]),
    "consecutive, last block partial": ([list(range(0, 68))], [1071]),
    "scattered, odd block count": ([RUN[:8] + [200, 201, 150]], [10 * BS + 3]),
    "eight blocks": ([list(range(30, 38))], [8 * BS - 5]),
    "short: one part": ([[5, 9, 11]], [40]),
}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", list(ONE_SEQUENCE))
def test_one_sequence_in_parts_equals_fp32_attention(case, threads):
    # one decode sequence's context cut into one part per thread (``decode_chunks``), merged by log-sum-exp
    tables, lens = ONE_SEQUENCE[case]
    t = tables[0][: -(-lens[0] // BS)]
    split = plan_split_decode(tables, lens, 0, BS, POOL, CPU)
    split_parts = decode_chunks(len(t), threads)
    if split.chunks != split_parts:  # the plan follows torch's thread count: re-plan with the one asked for
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            split = plan_split_decode(tables, lens, 0, BS, POOL, CPU)
        finally:
            torch.set_num_threads(previous)
    assert split.chunks == split_parts == (1 if threads == 1 or len(t) < 8 else threads)
    if split.chunks > 1:
        per = split.chunk_bias.shape[-1]
        assert per * split.chunks >= lens[0] > per * (split.chunks - 1)  # every part holds context
        assert int((split.chunk_bias == 0).sum()) == lens[0]  # each position attended once
    g = torch.Generator().manual_seed(threads)
    kv = torch.randn(2, POOL, BS, KVH, D, generator=g).to(torch.bfloat16)
    q = torch.randn(1, KVH * GROUP, D, generator=g)
    got = split_decode_attention(q, kv, split, D**-0.5, GROUP, torch.float32)
    ctx = kv[:, t].reshape(2, -1, KVH, D)[:, : lens[0]].float().transpose(1, 2)
    s = q[0].view(KVH, GROUP, D).to(torch.bfloat16).float() @ ctx[0].transpose(-1, -2) * D**-0.5
    want = (torch.softmax(s, -1) @ ctx[1]).view(1, KVH * GROUP, D)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
