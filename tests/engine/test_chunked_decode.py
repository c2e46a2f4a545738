"""Decode attention on CPU (``engine.chunked_decode``): contexts cut at fixed positions, merged in a fixed order.

Checked on one layer directly (random K/V, GQA, ragged lengths, consecutive and scattered blocks, with and
without shared chunks, bf16 and fp32 caches): the plan covers every context position once; the result equals
fp32 attention over the gathered context within the cache's rounding; and a sequence's output is bit for bit
the same alone and in any batch, at 1 and 2 threads. Through the engine on SmolLM2 with a bf16 cache: cached,
batched and alone give the same greedy tokens (slow)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import attention_dtype, paged_attention, plan_attention
from engine.chunked_decode import chunk_blocks, chunked_decode_attention, plan_chunked_decode
from tests.engine.engine_helpers import decode_meta, greedy, make_engine, smollm2_checkpoint

BS = 16
POOL = 300
KVH, GROUP, D = 3, 3, 64
CPU = torch.device("cpu")
CB = chunk_blocks(BS)  # blocks per chunk
C = CB * BS


RUN = list(range(40, 102))  # 62 consecutive blocks: a cached system prompt
CASES = {
    "consecutive blocks": ([list(range(0, 68))], [1071]),
    "whole chunks": ([list(range(0, 64))], [64 * BS]),
    "prefix hit, fresh blocks elsewhere": ([RUN + [200, 201, 150]], [62 * BS + 40]),
    "short: one chunk": ([[5, 9, 11]], [40]),
    "two sequences": ([RUN + [200, 201, 150], list(range(110, 140)) + [299]], [1032, 483]),
    "ragged, scattered": ([RUN + [200], [3, 7, 9]], [62 * BS + 1, 40]),
    "sharing 62 blocks": ([RUN + [200, 201], RUN + [150, 151, 152], RUN + [160]], [1020, 1040, 1000]),
    "sharing less than a chunk": ([RUN[:10] + [200, 201], RUN[:10] + [150]], [190, 170]),
}
SHARED = {"sharing 62 blocks": 62, "sharing less than a chunk": 10}


def positions_read(plan, tables, lens):
    """(sequence, position) -> block id each chunk reads, from the plan's gathers."""
    ids = plan.private.rows[: plan.private.num_blocks].tolist() if plan.private.rows is not None else None
    ids = ids or list(range(plan.private.first, plan.private.first + plan.private.num_blocks))
    shared = (
        []
        if plan.shared is None
        else list(range(plan.shared.first, plan.shared.first + plan.shared.num_blocks))
    )
    if plan.shared is not None and plan.shared.rows is not None:
        shared = plan.shared.rows[: plan.shared.num_blocks].tolist()
    seen: dict[tuple[int, int], int] = {}
    for i, n in enumerate(lens):
        for p in range(min(n, plan.shared_chunks * C)):
            seen[(i, p)] = shared[p // BS]
    valid = plan.private_valid.view(-1, C)
    for k, i in enumerate(plan.private_seq.tolist()):
        first = sum(1 for j in plan.private_seq.tolist()[:k] if j == i) + plan.shared_chunks
        for off in range(int(valid[k].sum())):
            seen[(i, first * C + off)] = ids[k * CB + off // BS]
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_plan_reads_each_position_once_at_fixed_chunks(case):
    tables, lens = CASES[case]
    shared = SHARED.get(case, 0)
    plan = plan_chunked_decode(tables, lens, shared, BS, POOL, CPU)
    assert plan.shared_chunks == (min(shared // CB, *(n // C for n in lens)) if len(lens) > 1 else 0)
    seen = positions_read(plan, tables, lens)
    want = {(i, p): t[p // BS] for i, (t, n) in enumerate(zip(tables, lens, strict=True)) for p in range(n)}
    assert seen == want
    assert plan.max_chunks == max(-(-n // C) for n in lens)


def reference(q, kv, tables, lens):
    """fp32 softmax attention of each query group over its gathered context: ``[B, H, D]``."""
    b = len(lens)
    want = torch.empty(b, KVH, GROUP, D)
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        ctx = kv[:, t[: -(-n // BS)]].reshape(2, -1, KVH, D)[:, :n].float().transpose(1, 2)  # [2, kvh, n, D]
        s = q[i].view(KVH, GROUP, D).to(kv.dtype).float() @ ctx[0].transpose(-1, -2) * D**-0.5
        want[i] = torch.softmax(s, -1) @ ctx[1]
    return want.view(b, KVH * GROUP, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_equals_fp32_attention_over_the_gathered_context(case, dtype):
    tables, lens = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    cache = torch.randn(2, 2, POOL, BS, KVH, D, generator=g).to(dtype)  # two layers
    b = len(lens)
    meta = decode_meta(tables, lens)
    plan = plan_attention(meta, CPU, POOL, cache_dtype=dtype)
    chunked = plan.decode.chunked
    assert chunked is not None
    # shared chunks where attention computes in bf16 (a bf16 cache on a CPU with bf16 kernels)
    bf16_compute = attention_dtype(dtype, torch.float32, CPU) == torch.bfloat16
    assert chunked.shared_chunks == (
        min(SHARED.get(case, 0) // CB, *(n // C for n in lens)) if bf16_compute and b > 1 else 0
    )
    for layer in range(2):
        q = torch.randn(b, KVH * GROUP, D, generator=g)
        k = torch.randn(b, KVH, D, generator=g)
        v = torch.randn(b, KVH, D, generator=g)
        kv = cache[layer]
        got = paged_attention(q, k, v, kv, plan, D**-0.5)  # writes this step's K/V first
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: q and probabilities rounded to 8 bits
        torch.testing.assert_close(
            got.view(b, KVH * GROUP, D), reference(q, kv, tables, lens), atol=tol, rtol=tol
        )


COMPANIONS = {
    "alone": [],
    "a short one": [([3, 7, 9], 40)],
    "a long one, scattered": ([list(range(110, 140)) + [299], 483],),
    "two sharing its prefix": ([RUN + [150, 151, 152], 1040], [RUN + [160], 1000]),
    "seven sharing its prefix": tuple([RUN + [160 + i, 170 + i], 62 * BS + 5 + 3 * i] for i in range(7)),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(dtype, threads):
    """The invariance itself (issue 12 item 5): one sequence's output does not depend on the batch it runs in,
    where in the batch it is, whether shared chunks are used, or the thread count."""
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(2, POOL, BS, KVH, D, generator=g).to(dtype)
    mine = (RUN + [200, 201], 62 * BS + 20)
    q_mine = torch.randn(1, KVH * GROUP, D, generator=g)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = chunked_decode_attention(
            q_mine, kv, plan_chunked_decode([mine[0]], [mine[1]], 0, BS, POOL, CPU), D**-0.5, GROUP, dtype
        )
        torch.set_num_threads(threads)
        for name, others in COMPANIONS.items():
            for where in (0, len(others)):
                seqs = list(others[:where]) + [mine] + list(others[where:])
                tables, lens = [list(s[0]) for s in seqs], [s[1] for s in seqs]
                q = torch.randn(len(seqs), KVH * GROUP, D, generator=g)
                q[where] = q_mine[0]
                for shared in {0, 62 if dtype == torch.bfloat16 and "sharing" in name else 0}:
                    plan = plan_chunked_decode(tables, lens, shared, BS, POOL, CPU)
                    got = chunked_decode_attention(q, kv, plan, D**-0.5, GROUP, dtype)
                    assert torch.equal(got[where], alone[0]), (name, where, shared)
    finally:
        torch.set_num_threads(previous)


def test_shared_chunks_need_bf16_compute():
    tables, lens = CASES["sharing 62 blocks"]
    plan = plan_chunked_decode(tables, lens, 62, BS, POOL, CPU)
    kv = torch.randn(2, POOL, BS, KVH, D)
    with pytest.raises(ValueError, match="shared chunks: bf16"):
        chunked_decode_attention(torch.randn(3, KVH * GROUP, D), kv, plan, D**-0.5, GROUP, torch.float32)
    assert (
        plan_attention(decode_meta(tables, lens), CPU, POOL, cache_dtype=torch.float32).decode.chunked.shared
        is None
    )


@pytest.mark.slow
def test_smollm2_bf16_cache_chunked_decode_keeps_greedy_tokens(monkeypatch):
    """SmolLM2 with a bf16 KV cache: a prompt whose system prefix is cached (blocks not consecutive) and the
    same prompts batched (shared chunks over the system prompt) get the greedy tokens each gets alone with
    caching off."""
    ckpt = smollm2_checkpoint()
    tok = ckpt.tokenizer
    system = "You are a helpful assistant for a train company. Answer briefly and politely. " * 20
    prompts = [
        tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("When is the first train?", "How much is a ticket?", "Can I bring a bike?")
    ]
    n_new = 12

    # torch's paths throughout (the native prefill kernel attends the bf16 cache in fp32, torch's decode in bf16).
    # torch's glue: this configuration is not bit-for-bit cache on == off on main either (torch's decode path and
    # bf16 prefill attention over a cached prefix: logits ~0.05-0.1 apart from the first token on, measured),
    # so its greedy tokens hold only while no near-tie flips; the native glue kernel's rounding flips one at the
    # 7th token of the second prompt. The glue kernel's own invariance is tested in test_native_glue.py.
    def alone(prompt: list[int]) -> list[int]:
        eng = make_engine(
            ckpt,
            kv_dtype="bfloat16",
            enable_prefix_caching=False,
            decode_kernel="torch",
            prefill_kernel="torch",
            glue_kernel="torch",
        )
        return eng.generate([prompt], greedy(n_new))[0]

    # bf16 attention (shared chunks) as on a CPU with bf16 kernels; torch runs it on any CPU, slowly
    monkeypatch.setattr("engine.attention._bf16_fast", lambda device: True)
    refs = [alone(p) for p in prompts]
    eng = make_engine(
        ckpt, kv_dtype="bfloat16", decode_kernel="torch", prefill_kernel="torch", glue_kernel="torch"
    )
    eng.generate([prompts[0]], greedy(2))
    plans = []
    import engine.model as model_mod

    real = model_mod.plan_attention

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        plans.append(plan.decode is not None and plan.decode.chunked.shared is not None)
        return plan

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_mod, "plan_attention", spy)
        assert (
            eng.generate([prompts[1]], greedy(n_new))[0] == refs[1]
        )  # cached prefix, fresh blocks elsewhere
        assert eng.generate(prompts, greedy(n_new)) == refs  # batched, shared chunks over the system prompt
    assert sum(plans) >= n_new - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_token_gets_the_same_attention_bits_in_any_prefill_chunk_and_as_a_decode(threads, dtype):
    """``engine.chunked_prefill``: each row of a prefill chunk equals the same position attended in a chunk
    that starts elsewhere, and equals its attention as a one-token decode (``engine.chunked_decode``), so a
    prompt's last token computed alone (a 1-token chunk after a partial prefix hit) matches it in any chunk."""
    from engine.chunked_prefill import chunked_prefill_attention, plan_chunked_prefill

    g = torch.Generator().manual_seed(11)
    kv = torch.randn(2, POOL, BS, KVH, D, generator=g).to(dtype)
    table = RUN + [200, 201, 150]
    n = 62 * BS + 40
    q = torch.randn(n, KVH * GROUP, D, generator=g)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        whole = chunked_prefill_attention(
            q, kv, plan_chunked_prefill(table, n, n, BS, POOL, CPU), D**-0.5, dtype
        )
        for start, end in [(0, 300), (300, 301), (301, 303), (517, 900), (n - 1, n), (n - 3, n)]:
            plan = plan_chunked_prefill(table, end, end - start, BS, POOL, CPU)
            part = chunked_prefill_attention(q[start:end], kv, plan, D**-0.5, dtype)
            assert torch.equal(part, whole[start:end]), (start, end)
        for p in (5, 255, 256, 700, n - 1):
            dec = plan_chunked_decode([table], [p + 1], 0, BS, POOL, CPU)
            one = chunked_decode_attention(q[p : p + 1], kv, dec, D**-0.5, GROUP, dtype, torch.float32)
            assert torch.equal(one[0], whole[p]), p
    finally:
        torch.set_num_threads(previous)
