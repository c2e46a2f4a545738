"""``n > 1``: one prefill of the prompt, then ``n`` forks sharing its blocks (the partial last block copied on
write), each choice seeded ``seed + i``; exact counts, parity with ``n = 1`` runs, and no leaked block on any
cancel."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import Finished, GenerationRequest, SamplingParams, TextDelta
from engine.async_engine import AsyncEngine
from tests.engine.engine_helpers import make_engine, random_tokens, tiny_checkpoint

BS = 16


def assert_all_returned(eng) -> None:
    s = eng.stats()
    assert s.blocks_used == 0
    assert s.blocks_free + s.blocks_cached == s.blocks_total
    assert s.running == s.waiting == 0
    eng.kv.check_invariants()


def run_choices(eng, prompt, params) -> dict[int, list[int]]:
    req = eng.add_request(prompt, params)
    tokens: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == req.request_id or o.parent_id == req.request_id:
                tokens.setdefault(o.index, []).extend(o.new_token_ids)
        eng.kv.check_invariants()
    return tokens


@pytest.mark.parametrize("prompt_len", [37, 48])  # a partial last block (copied on write), all blocks full
@pytest.mark.parametrize("caching", [True, False])
def test_n4_prefills_the_prompt_once_and_matches_n1_runs(prompt_len, caching):
    prompt = random_tokens(prompt_len, 3)
    params = SamplingParams(max_tokens=7, seed=11, ignore_eos=True, n=4)
    eng = make_engine(enable_prefix_caching=caching)
    choices = run_choices(eng, prompt, params)
    s = eng.stats()
    assert s.prefill_tokens == prompt_len  # exactly one prefill of the prompt
    assert s.forks == 3 and s.forked_prefill_tokens_saved == 3 * prompt_len
    assert s.requests == 4 and s.decode_tokens == 4 * 7
    assert_all_returned(eng)
    assert sorted(choices) == [0, 1, 2, 3]
    for i in range(4):  # choice i == an n=1 request seeded seed + i, alone on a fresh engine
        alone = make_engine(enable_prefix_caching=caching)
        one = SamplingParams(max_tokens=7, seed=11 + i, ignore_eos=True)
        assert choices[i] == run_choices(alone, prompt, one)[0]


def test_forks_share_full_blocks_and_copy_only_the_partial_one():
    prompt = random_tokens(37, 4)  # 2 full blocks + 5 tokens
    eng = make_engine()
    req = eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=3))
    eng.step()  # prefill + fork
    tables = [eng.kv.block_table(req.request_id)] + [
        eng.kv.block_table(f"{req.request_id}/{i}") for i in (1, 2)
    ]
    assert all(t[:2] == tables[0][:2] for t in tables)  # the full blocks are shared
    assert len({t[2] for t in tables}) == 3  # each has its own copy of the partial block
    assert eng.stats().blocks_used == 2 + 3
    eng.kv.check_invariants()
    eng.run_to_completion()
    assert_all_returned(eng)


def test_greedy_forks_agree():
    eng = make_engine()
    choices = run_choices(
        eng, random_tokens(29, 5), SamplingParams(max_tokens=6, temperature=0.0, n=3, ignore_eos=True)
    )
    assert choices[0] == choices[1] == choices[2]


def test_cancel_one_fork_then_all_leaks_nothing():
    eng = make_engine()
    req = eng.add_request(random_tokens(40, 6), SamplingParams(max_tokens=30, seed=1, n=4, ignore_eos=True))
    eng.step()
    eng.step()
    out = eng.abort_request(f"{req.request_id}/2")
    assert out is not None and out.finish_reason == "abort" and out.index == 2
    eng.kv.check_invariants()
    eng.step()
    outs = eng.abort_family(req.request_id)
    assert sorted(o.index for o in outs) == [0, 1, 3]
    assert all(o.finish_reason == "abort" for o in outs)
    assert_all_returned(eng)


def test_cancel_before_the_prompt_is_computed_ends_every_choice():
    eng = make_engine(max_num_batched_tokens=16)
    req = eng.add_request(random_tokens(60, 7), SamplingParams(max_tokens=5, n=3))
    eng.step()  # first chunk only
    out = eng.abort_request(req.request_id)
    assert out.unforked == (1, 2)
    assert_all_returned(eng)


def test_async_stream_yields_every_choice_and_ends_after_the_last():
    async def main():
        ckpt = tiny_checkpoint()
        eng = AsyncEngine(make_engine(ckpt), ckpt.tokenizer)
        try:
            params = SamplingParams(max_tokens=4, seed=2, n=3, ignore_eos=True, logprobs=1)
            events = [
                e
                async for e in eng.generate(GenerationRequest(params, prompt_token_ids=random_tokens(20, 8)))
            ]
            stats = eng.stats()
        finally:
            await eng.shutdown()
        return events, stats

    events, stats = asyncio.run(main())
    finished = [e for e in events if isinstance(e, Finished)]
    assert sorted(e.index for e in finished) == [0, 1, 2]
    assert all(e.usage.prompt_tokens == 20 and e.usage.completion_tokens == 4 for e in finished)
    for i in range(3):
        deltas = [e for e in events if isinstance(e, TextDelta) and e.index == i]
        assert sum(len(d.token_ids) for d in deltas) == 4
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert stats.prefill_tokens == 20 and stats.blocks_used == 0


@pytest.mark.parametrize("caching", [True, False])
def test_fork_without_a_free_block_waits_and_recomputes(caching):
    prompt = random_tokens(37, 9)  # 3 blocks: the whole pool
    params = SamplingParams(max_tokens=5, seed=4, n=2, ignore_eos=True)
    eng = make_engine(num_blocks=3, enable_prefix_caching=caching)
    choices = run_choices(eng, prompt, params)
    s = eng.stats()
    assert s.forks == 1 and s.forked_prefill_tokens_saved == 0
    assert s.prefill_tokens > 37  # the fork recomputed (prompt + its first token) once blocks were back
    assert_all_returned(eng)
    alone = run_choices(make_engine(), prompt, SamplingParams(max_tokens=5, seed=5, ignore_eos=True))
    assert choices[1] == alone[0]


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    prompt_len=st.integers(1, 70), n=st.integers(2, 5), caching=st.booleans(), max_tokens=st.integers(1, 4)
)
def test_property_n_forks_prefill_once_and_return_every_block(prompt_len, n, caching, max_tokens):
    eng = make_engine(enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=max_tokens, seed=prompt_len, n=n, ignore_eos=True)
    choices = run_choices(eng, random_tokens(prompt_len, prompt_len), params)
    s = eng.stats()
    assert s.prefill_tokens == prompt_len
    assert s.forks == n - 1 and s.forked_prefill_tokens_saved == (n - 1) * prompt_len
    assert sorted(choices) == list(range(n)) and all(len(t) == max_tokens for t in choices.values())
    assert_all_returned(eng)


def test_closing_the_stream_early_aborts_every_fork():
    async def main():
        ckpt = tiny_checkpoint()
        eng = AsyncEngine(make_engine(ckpt), ckpt.tokenizer)
        try:
            params = SamplingParams(max_tokens=200, seed=2, n=4, ignore_eos=True)
            stream = eng.generate(GenerationRequest(params, prompt_token_ids=random_tokens(30, 9)))
            seen = set()
            async for event in stream:
                seen.add(event.index)
                if len(seen) == 4:
                    break  # every fork exists and runs
            await stream.aclose()
            stats = eng.stats()
            eng.core.kv.check_invariants()
        finally:
            await eng.shutdown()
        return stats

    stats = asyncio.run(main())
    assert stats.forks == 3 and stats.blocks_used == 0 and stats.running == stats.waiting == 0
