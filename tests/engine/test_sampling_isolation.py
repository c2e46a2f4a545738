"""A request whose sampling fails ends alone, with a named error and no leaked block; the rest of its batch
produces the tokens it produces alone, and the engine keeps serving (sync engine, sampler, async streams).

The failure is a real one: ``repetition_penalty`` 1e-40 passes validation (any value > 0), but dividing a
positive logit of a seen token by it overflows float32 to ``inf``, so at a temperature > 0 the distribution
is NaN and ``torch.multinomial`` raises (before the isolation, the step loop died and took every request and
the engine with it).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.api import GenerationRequest, SamplingParams, TextDelta
from engine.async_engine import AsyncEngine
from engine.errors import SamplingError
from engine.sampling import SequenceSampler, sample_sequences
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

POISON = SamplingParams(max_tokens=6, temperature=1.0, repetition_penalty=1e-40, ignore_eos=True, seed=5)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, ignore_eos=True, seed=11)


def test_the_poison_parameters_really_make_the_sampler_raise():
    sampler = SequenceSampler(POISON, [3, 4, 5])
    logits = torch.full((16,), -1.0)
    logits[4] = 2.0  # a seen token with a positive logit: 2 / 1e-40 is inf in float32
    with pytest.raises(RuntimeError):
        sampler.sample(logits)


def test_sample_sequences_isolates_a_failing_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 64) * 3
    logits[1, 7] = 5.0
    ok = [SequenceSampler(SEEDED, [1, 2]), SequenceSampler(POISON, [7]), SequenceSampler(greedy(2), [3])]
    alone = [
        SequenceSampler(SEEDED, [1, 2]).sample(logits[0]),
        None,
        SequenceSampler(greedy(2), [3]).sample(logits[2]),
    ]
    out = sample_sequences(logits, ok)
    assert out[1].token_id == -1 and out[1].error is not None and out[1].error.startswith("RuntimeError: ")
    assert [out[0], out[2]] == [alone[0], alone[2]]
    assert out[0].error is None and out[2].error is None


def check_no_block_held(engine) -> None:
    kv = engine.kv
    assert kv.blocks_used == 0
    assert kv.num_free_blocks() == kv.blocks_total == kv.blocks_free + kv.blocks_cached


def test_a_failing_request_ends_alone_and_the_batch_runs_on():
    prompts = [random_tokens(40, seed=s) for s in range(4)]
    params = [greedy(6), SEEDED, POISON, greedy(6)]
    engine = make_engine(num_blocks=64)
    reqs = [
        engine.add_request(p, sp, request_id=f"r{i}")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    first = engine.step()  # the whole prompts in one step, one token each sampled
    failed = [o for o in first if o.request_id == "r2"]
    assert len(failed) == 1 and failed[0].finished and failed[0].finish_reason == "error"
    assert isinstance(failed[0].error, SamplingError) and failed[0].error.request_id == "r2"
    assert failed[0].usage.completion_tokens == 0 and failed[0].new_token_ids == []
    # its blocks are free at once: only the three live requests hold blocks (3 blocks of 16 for 40 tokens)
    assert "r2" not in engine.requests and engine.kv.blocks_used == 3 * 3
    finals = engine.run_to_completion()
    assert sorted(finals) == ["r0", "r1", "r3"]
    assert all(finals[r].finish_reason == "length" for r in finals)
    check_no_block_held(engine)
    for i in (0, 1, 3):
        ref = make_engine(num_blocks=64).generate([prompts[i]], params[i])[0]
        assert reqs[i].output_token_ids == ref, f"request {i} changed by its failing neighbour"
    # the engine serves on
    again = engine.generate([prompts[0]], greedy(6))[0]
    assert again == reqs[0].output_token_ids
    check_no_block_held(engine)


def test_a_failure_taking_the_token_ends_that_request_alone(monkeypatch):
    # e.g. a grammar state that cannot advance: the token is sampled, then taking it raises
    prompts = [random_tokens(20, seed=s) for s in (7, 8)]
    engine = make_engine(num_blocks=64)
    good = engine.add_request(prompts[0], greedy(5), request_id="good")
    bad = engine.add_request(prompts[1], greedy(5), request_id="bad")
    engine.step()
    calls = []

    def broken_accept(token_id: int) -> None:
        calls.append(token_id)
        raise ValueError("the grammar state cannot advance")

    monkeypatch.setattr(bad.sampler, "accept", broken_accept)
    outs = engine.step()
    (failed,) = [o for o in outs if o.request_id == "bad"]
    assert calls and failed.finish_reason == "error" and "ValueError" in failed.error.cause
    finals = engine.run_to_completion()
    assert list(finals) == ["good"]
    assert good.output_token_ids == make_engine(num_blocks=64).generate([prompts[0]], greedy(5))[0]
    check_no_block_held(engine)


def test_a_failing_fork_family_frees_every_block():
    engine = make_engine(num_blocks=64)
    prompt = random_tokens(35, seed=3)
    engine.add_request(prompt, SamplingParams(max_tokens=4, n=3, temperature=1.0, repetition_penalty=1e-40))
    finals = engine.run_to_completion()
    (only,) = finals.values()
    assert only.finish_reason == "error" and only.unforked == (1, 2)
    check_no_block_held(engine)


async def test_async_streams_survive_a_neighbour_that_fails():
    ckpt = tiny_checkpoint()
    eng = AsyncEngine(make_engine(ckpt, num_blocks=64), ckpt.tokenizer)
    await eng.start()
    try:
        prompts = [random_tokens(30, seed=s) for s in (21, 22, 23)]
        params = [greedy(8), POISON, SEEDED]

        async def run(i: int) -> list[int] | BaseException:
            try:
                events = [
                    e
                    async for e in eng.generate(
                        GenerationRequest(prompt_token_ids=prompts[i], params=params[i])
                    )
                ]
            except SamplingError as exc:
                return exc
            return [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]

        results = await asyncio.gather(*(run(i) for i in range(3)))
        assert isinstance(results[1], SamplingError)
        core = make_engine(num_blocks=64)
        assert results[0] == core.generate([prompts[0]], params[0])[0]
        assert results[2] == core.generate([prompts[2]], params[2])[0]
        # the step loop lives on and the pool holds nothing
        after = [
            e async for e in eng.generate(GenerationRequest(prompt_token_ids=prompts[0], params=greedy(8)))
        ]
        assert [t for e in after if isinstance(e, TextDelta) for t in e.token_ids] == results[0]
        assert eng.stats().blocks_used == 0
    finally:
        await eng.shutdown()
