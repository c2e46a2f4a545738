"""Issue 5: grouping requests by prefix. A new prefix brought by many requests at once is prefilled once (in-flight
sharing), cache-aware scheduling has a starvation bound, and preemption under memory pressure changes neither the
outputs nor the hit counters. All assertions are exact token / step counts."""

from __future__ import annotations

import functools

from engine.api import SamplingParams
from tests.engine.engine_helpers import greedy, make_engine, random_tokens

BS = 16
N_NEW = 8
GREEDY = greedy(N_NEW)


@functools.cache
def alone(prompt: tuple[int, ...], params: SamplingParams = GREEDY) -> list[int]:
    """What ``prompt`` generates alone on a fresh engine with prefix caching off."""
    eng = make_engine(enable_prefix_caching=False, max_num_batched_tokens=4096)
    req = eng.add_request(list(prompt), params)
    eng.run_to_completion()
    return req.output_token_ids


def burst(prefix_len: int, n: int, suffix_len: int, seed: int = 1) -> list[list[int]]:
    prefix = random_tokens(prefix_len, seed)
    return [prefix + random_tokens(suffix_len, 1000 * seed + i) for i in range(n)]


def test_burst_of_16_prefills_a_new_512_token_prefix_once():
    prompts = burst(512, 16, 32)
    eng = make_engine()
    reqs = [eng.add_request(p, greedy(N_NEW)) for p in prompts]
    eng.run_to_completion()
    s = eng.stats()
    # the bound of issue 5: 512 + 16 x 32 tokens, plus at most one block per request
    assert 512 + 16 * 32 <= s.prefill_tokens <= 512 + 16 * 32 + 16 * BS
    assert s.prefill_tokens == 512 + 16 * 32  # the prefix is block aligned: not one token more
    assert s.prefix_hit_tokens == s.inflight_shared_tokens == 15 * 512
    assert [r.num_cached_tokens for r in reqs] == [0] + [512] * 15
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == alone(tuple(p))


def test_without_inflight_sharing_the_same_burst_prefills_the_prefix_16_times():
    prompts = burst(512, 16, 32)
    eng = make_engine(enable_inflight_sharing=False, max_num_batched_tokens=16 * 544, num_blocks=1024)
    reqs = [eng.add_request(p, greedy(N_NEW)) for p in prompts]
    eng.run_to_completion()
    assert eng.stats().prefill_tokens == 16 * 544
    assert eng.stats().inflight_shared_tokens == 0
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == alone(tuple(p))


def test_burst_with_a_large_step_budget_still_prefills_once():
    prompts = burst(512, 16, 32)
    eng = make_engine(max_num_batched_tokens=16 * 544, num_blocks=1024)
    for p in prompts:
        eng.add_request(p, greedy(N_NEW))
    eng.run_to_completion()
    assert eng.stats().prefill_tokens == 512 + 16 * 32


def test_unaligned_prefix_costs_at_most_one_block_per_request():
    prompts = burst(500, 16, 32, seed=2)
    eng = make_engine()
    reqs = [eng.add_request(p, greedy(N_NEW)) for p in prompts]
    eng.run_to_completion()
    s = eng.stats()
    assert 500 + 16 * 32 <= s.prefill_tokens <= 500 + 16 * 32 + 16 * BS
    # followers share 31 full blocks (496 tokens) and copy the prefix's 4 tokens of the block it ends in
    # (token-granular hits: they compute only their own 32 tokens)
    assert s.prefill_tokens == 532 + 15 * (532 - 500)
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == alone(tuple(p))


def test_followers_arriving_mid_chunked_prefill_attach_to_the_leaders_blocks():
    prompts = burst(512, 8, 32, seed=3)
    eng = make_engine(max_num_batched_tokens=128)
    leader = eng.add_request(prompts[0], greedy(N_NEW))
    eng.step()
    eng.step()
    assert leader.num_computed_tokens == 256  # mid chunked prefill
    followers = [eng.add_request(p, greedy(N_NEW)) for p in prompts[1:]]
    eng.run_to_completion()
    s = eng.stats()
    assert s.prefill_tokens == 544 + 7 * 32
    assert [f.num_cached_tokens for f in followers] == [512] * 7
    # 256 tokens were already cached when they arrived; the other 256 were in flight in the leader
    assert [f.num_inflight_shared_tokens for f in followers] == [256] * 7
    assert s.inflight_shared_tokens == 7 * 256
    for r, p in zip([leader, *followers], prompts, strict=True):
        assert r.output_token_ids == alone(tuple(p))


def test_seeded_sampling_in_a_shared_burst_equals_alone():
    prompts = burst(64, 4, 8, seed=4)
    params = [
        SamplingParams(max_tokens=N_NEW, temperature=0.9, top_p=0.95, seed=10 + i, ignore_eos=True)
        for i in range(4)
    ]
    eng = make_engine()
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    eng.run_to_completion()
    assert eng.stats().inflight_shared_tokens == 3 * 64
    for r, p, sp in zip(reqs, prompts, params, strict=True):
        assert r.output_token_ids == alone(tuple(p), sp)


def test_lpm_starvation_bound_counted_in_steps():
    """lpm, one sequence per step, a new cache hit arriving every step: the cold request never runs without the
    bound, and runs within max_wait_s (5 steps of a fake clock) + its own prefill step with it."""

    class StepClock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    def steps_until_cold_finishes(max_wait_s: float) -> int | None:
        clock = StepClock()
        eng = make_engine(scheduling="lpm", max_batch=1, max_wait_s=max_wait_s, clock=clock)
        shared = random_tokens(64, 5)
        eng.add_request(shared + [7], greedy(1))
        eng.run_to_completion()
        cold = eng.add_request(random_tokens(65, 6), greedy(1))
        for step in range(1, 40):
            hit = eng.add_request(shared + random_tokens(1, 100 + step), greedy(1))
            eng.step()
            assert hit.num_cached_tokens in (None, 64)
            clock.t += 1.0
            if cold.is_finished:
                return step
        return None

    assert steps_until_cold_finishes(float("inf")) is None
    steps = steps_until_cold_finishes(5.0)
    assert steps is not None and steps <= 7


def test_preemption_under_a_tiny_pool_keeps_outputs_and_hit_counters():
    prompts = burst(64, 4, 16, seed=6)  # 5 blocks each; the 4 prefix blocks are shared

    def run(num_blocks: int):
        eng = make_engine(num_blocks=num_blocks)
        reqs = [eng.add_request(p, greedy(64)) for p in prompts]
        eng.run_to_completion(max_steps=5000)
        return eng, reqs

    big_eng, big = run(256)
    tiny_eng, tiny = run(12)  # 8 blocks at admission; growing to 24 forces preemption
    b, t = big_eng.stats(), tiny_eng.stats()
    assert b.preemptions == 0 and t.preemptions > 0
    assert [r.output_token_ids for r in tiny] == [r.output_token_ids for r in big]
    assert all(len(r.output_token_ids) == 64 for r in tiny)
    # the shared blocks, and prompt 2 copies one more token: its suffix starts like prompt 0's (seed 6 data)
    assert t.prefix_hit_tokens == b.prefix_hit_tokens == 3 * 64 + 1
    assert [r.num_cached_tokens for r in tiny] == [r.num_cached_tokens for r in big] == [0, 64, 65, 64]
    assert t.prefill_tokens > b.prefill_tokens  # recomputation is counted as prefill, never as a hit
    assert t.blocks_used == 0 and t.blocks_free + t.blocks_cached == t.blocks_total
