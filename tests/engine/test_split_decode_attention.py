"""Split decode attention (``engine.attention.SplitDecode``) equals one pass over the gathered context within bf16
rounding, and covers every context position exactly once.

Over a bf16 cache on CPU, decode attention reads a context that is not one run of consecutive blocks as partial
attentions: the shared blocks (cascade), each sequence's longest run in place (cut into ``chunks`` for threads)
and the rest gathered, merged by their log-sum-exp. Checked on one layer directly (random K/V, GQA, ragged
lengths, sequences with and without a long run, 1-3 chunks) against fp32 attention over the gathered context,
and through the engine on SmolLM2 with a bf16 KV cache: cache on == cache off and batched == alone, same greedy
tokens."""

from __future__ import annotations

import pytest
import torch

from engine.attention import (
    MIN_VIEW_BLOCKS,
    AttentionMetadata,
    attention_chunks,
    longest_run,
    paged_attention,
    plan_attention,
    plan_split_decode,
    split_decode_attention,
)
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
    "one run": ([list(range(0, 68))], [1071]),
    "prefix hit, fresh blocks elsewhere": ([RUN + [200, 201, 150]], [62 * BS + 40]),
    "two sequences, both with a run": ([RUN + [200, 201, 150], list(range(110, 140)) + [299]], [1032, 483]),
    "one sequence without a long run": ([RUN + [200], [3, 7, 9]], [62 * BS + 1, 40]),
    "cascade, short private parts": ([RUN[:20] + [200, 201], RUN[:20] + [150, 151, 152]], [340, 360]),
    "cascade with a private run": (
        [RUN[:5] + list(range(110, 125)) + [200], RUN[:5] + [150, 151]],
        [323, 100],
    ),
}


def test_longest_run():
    assert longest_run([]) == (0, 0)
    assert longest_run([5]) == (0, 1)
    assert longest_run([9, 1, 2, 3, 7, 8]) == (1, 3)
    assert longest_run([1, 2, 7, 8]) == (0, 2)  # the first on ties
    assert longest_run([3, 2, 1]) == (0, 1)


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_split_plan_covers_each_context_once(case, chunks):
    tables, lens = CASES[case]
    shared = 20 if case == "cascade, short private parts" else 5 if case.startswith("cascade") else 0
    split = plan_split_decode(tables, lens, shared, BS, POOL, CPU, chunks)
    shared_tokens = 0 if split.shared is None else split.shared.num_blocks * BS
    assert shared_tokens % (chunks * BS) == 0
    heads = {i: n for i, _, n in split.heads}
    rest_lens = [lens[i] - shared_tokens - heads.get(i, 0) for i in range(len(lens))]
    assert max(rest_lens) == split.rest_len
    assert all(n % (chunks * BS) == 0 and n >= MIN_VIEW_BLOCKS * BS for n in heads.values())
    width = split.rest.num_blocks // len(lens)
    rows = split.rest.rows
    rest_ids = (
        list(range(split.rest.first, split.rest.first + split.rest.num_blocks))
        if rows is None
        else rows[: split.rest.num_blocks].tolist()
    )
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        nb = -(-n // BS)
        used = rest_ids[i * width : i * width + -(-rest_lens[i] // BS)]
        head = [first + j for j_, first, m in split.heads if j_ == i for j in range(m // BS)]
        shared_ids = t[: shared_tokens // BS]
        assert sorted(shared_ids + head + used) == sorted(t[:nb])  # every block once
        assert used[-1] == t[nb - 1]  # the partial last block is the rest's last
    if split.rest_mask is not None:
        assert split.rest_mask.sum(-1).flatten().tolist() == rest_lens


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_split_equals_fp32_attention_over_the_gathered_context(case, chunks, monkeypatch):
    tables, lens = CASES[case]
    g = torch.Generator().manual_seed(len(case) + chunks)
    cache = torch.randn(2, POOL, BS, KVH, D, generator=g).to(torch.bfloat16)
    b = len(lens)
    q = torch.randn(b, KVH * GROUP, D, generator=g)
    k = torch.randn(b, KVH, D, generator=g)
    v = torch.randn(b, KVH, D, generator=g)
    monkeypatch.setattr("engine.attention.attention_chunks", lambda kvh, threads=None: chunks)
    plan = plan_attention(decode_meta(tables, lens), CPU, POOL, num_kv_heads=KVH)
    split = plan.decode.split
    if split is None:  # one run on one thread: the plain view path; planned here to test the split anyway
        shared = plan.decode.shared.num_tokens // BS if plan.decode.shared is not None else 0
        split = plan_split_decode(tables, lens, shared, BS, POOL, CPU, chunks)
    assert split.chunks == chunks
    kv = cache.clone()
    paged_attention(q, k, v, kv, plan, D**-0.5)  # writes this step's K/V
    got = split_decode_attention(q, kv, split, D**-0.5, GROUP, torch.float32)
    # reference: fp32 softmax attention of each query group over its gathered context
    want = torch.empty(b, KVH, GROUP, D)
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        ctx = kv[:, t[: -(-n // BS)]].reshape(2, -1, KVH, D)[:, :n].float().transpose(1, 2)  # [2, kvh, n, D]
        s = q[i].view(KVH, GROUP, D).to(torch.bfloat16).float() @ ctx[0].transpose(-1, -2) * D**-0.5
        want[i] = torch.softmax(s, -1) @ ctx[1]
    # bf16 query and probabilities (as the flash kernel rounds them) and bf16 partial outputs: 8 significant bits
    torch.testing.assert_close(got, want.view(b, KVH * GROUP, D), atol=2e-2, rtol=2e-2)


def test_split_is_planned_for_non_consecutive_contexts_only_on_one_thread(monkeypatch):
    monkeypatch.setattr("engine.attention.attention_chunks", lambda kvh, threads=None: 1)
    one_run = plan_attention(decode_meta(*CASES["one run"]), CPU, POOL, num_kv_heads=KVH)
    assert one_run.decode.split is None and one_run.decode.blocks.first == 0
    hit = plan_attention(
        decode_meta(*CASES["prefix hit, fresh blocks elsewhere"]), CPU, POOL, num_kv_heads=KVH
    )
    assert hit.decode.split.heads == [(0, 40, 62 * BS)] and hit.decode.split.rest.num_blocks == 3
    short = plan_attention(decode_meta([[5, 9, 2]], [40]), CPU, POOL, num_kv_heads=KVH)
    assert short.decode.split is None  # no long run: one gather, one call
    monkeypatch.setattr("engine.attention.attention_chunks", lambda kvh, threads=None: 2)
    one_run = plan_attention(decode_meta(*CASES["one run"]), CPU, POOL, num_kv_heads=KVH)
    assert one_run.decode.split.heads == [
        (0, 0, 66 * BS)
    ]  # two chunks of 33 blocks; the last block in the rest


def test_attention_chunks_spread_kv_heads_over_threads():
    assert attention_chunks(3, 1) == 1
    assert attention_chunks(3, 2) == 2
    assert attention_chunks(3, 3) == 1
    assert attention_chunks(2, 2) == 1
    assert attention_chunks(3, 16) == 4


@pytest.mark.slow
def test_smollm2_bf16_cache_split_decode_keeps_greedy_tokens():
    """SmolLM2 with a bf16 KV cache: a prompt whose system prefix is cached (blocks not consecutive, split
    decode) and the same prompts batched get the greedy tokens each gets alone with caching off."""
    ckpt = smollm2_checkpoint()
    tok = ckpt.tokenizer
    system = "You are a helpful assistant for a train company. Answer briefly and politely. " * 8
    prompts = [
        tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("When is the first train?", "How much is a ticket?", "Can I bring a bike?")
    ]
    n_new = 12

    def alone(prompt: list[int]) -> list[int]:
        eng = make_engine(ckpt, kv_dtype="bfloat16", enable_prefix_caching=False)
        return eng.generate([prompt], greedy(n_new))[0]

    refs = [alone(p) for p in prompts]
    eng = make_engine(ckpt, kv_dtype="bfloat16")
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
