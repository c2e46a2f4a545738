"""Exact block and token accounting of the engine: shared prefixes are held once, every end or cancel gives every
block back at once, and the counters count each request once."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import SamplingParams
from tests.engine.engine_helpers import greedy, make_engine, random_tokens

BS = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_all_returned(eng) -> None:
    s = eng.stats()
    assert s.blocks_used == 0
    assert s.blocks_free + s.blocks_cached == s.blocks_total
    assert s.running == s.waiting == 0
    eng.kv.check_invariants()


def test_requests_sharing_a_prefix_hold_its_blocks_once():
    n, p, own = 5, 100, 20
    prefix = random_tokens(p, 1)
    eng = make_engine()
    reqs = [eng.add_request(prefix + random_tokens(own, 10 + i), greedy(6)) for i in range(n)]
    eng.step()  # the leader prefills; the others wait for its prefix blocks (in-flight sharing)
    eng.step()  # the others attach to them and prefill their own suffixes
    assert all(r.status.value == "running" for r in reqs)
    shared_blocks = p // BS  # full prefix blocks
    own_blocks = cdiv(p + own, BS) - shared_blocks
    assert eng.stats().blocks_used == shared_blocks + n * own_blocks
    eng.kv.check_invariants()
    eng.run_to_completion()
    assert_all_returned(eng)
    s = eng.stats()
    assert s.requests == n
    assert s.prompt_tokens == s.prefix_query_tokens == n * (p + own)
    assert (
        s.prefix_hit_tokens == (n - 1) * p
    )  # whole blocks, then the prefix's 4 tokens of the leader's block 6
    assert s.prefill_tokens == n * (p + own) - s.prefix_hit_tokens
    assert s.decode_tokens == n * 6
    assert s.ttft.count == n and s.tpot.count == n * 5  # one TTFT per request, one TPOT per later token
    assert s.ttft.counts[-1] <= s.ttft.count and list(s.ttft.counts) == sorted(s.ttft.counts)
    assert s.prefill_seconds > 0 and s.decode_seconds > 0
    assert [r.num_cached_tokens for r in reqs] == [0] + [p] * (n - 1)


def test_cancel_mid_prefill_frees_blocks_at_once():
    eng = make_engine(max_num_batched_tokens=32)
    other = eng.add_request(random_tokens(20, 2), greedy(50))
    eng.step()
    used_by_other = eng.stats().blocks_used
    long = eng.add_request(random_tokens(300, 3), greedy(5))
    eng.step()
    assert 0 < long.num_computed_tokens < 300  # mid chunked prefill
    assert eng.stats().blocks_used == used_by_other + cdiv(300, BS)
    out = eng.abort_request(long.request_id)
    assert out.finished and out.finish_reason == "abort" and out.usage.completion_tokens == 0
    assert eng.stats().blocks_used == used_by_other
    assert eng.abort_request(long.request_id) is None  # already gone
    eng.abort_request(other.request_id)
    assert_all_returned(eng)


def test_cancel_mid_decode_frees_blocks_at_once():
    eng = make_engine()
    reqs = [eng.add_request(random_tokens(40, 4 + i), greedy(30)) for i in range(3)]
    for _ in range(5):
        eng.step()
    assert all(r.num_output_tokens == 5 for r in reqs)
    before = eng.stats().blocks_used
    out = eng.abort_request(reqs[1].request_id)
    assert out.usage.completion_tokens == 5
    assert eng.stats().blocks_used == before - cdiv(45, BS)
    for r in (reqs[0], reqs[2]):
        eng.abort_request(r.request_id)
    assert_all_returned(eng)
    assert eng.stats().requests == 3


def test_cancel_while_waiting_takes_nothing_and_counts_no_query():
    eng = make_engine(max_batch=1)
    running = eng.add_request(random_tokens(30, 5), greedy(3))
    queued = eng.add_request(random_tokens(30, 6), greedy(3))
    eng.step()
    assert queued.status.value == "waiting"
    eng.abort_request(queued.request_id)
    eng.run_to_completion()
    s = eng.stats()
    assert s.prefix_query_tokens == s.prompt_tokens == 30  # only the admitted one was looked up
    assert s.requests == 2 and running.num_output_tokens == 3
    assert_all_returned(eng)


@pytest.mark.parametrize("cache_generated_kv", [False, True])
def test_cached_blocks_are_reused_after_the_requests_end(cache_generated_kv):
    eng = make_engine(cache_generated_kv=cache_generated_kv)
    prompt = random_tokens(80, 7)
    eng.add_request(prompt, greedy(2))
    eng.run_to_completion()
    if cache_generated_kv:
        # full blocks of the 81 computed tokens (80 + 1 decoded), and the last one's partial block (1 token)
        assert eng.stats().blocks_cached == 81 // BS + 1 and eng.kv.partial_entries == 1
    else:  # the prompt's 5 full blocks only: the decoded token's KV is not cached
        assert eng.stats().blocks_cached == 80 // BS and eng.kv.partial_entries == 0
    again = eng.add_request(prompt, greedy(2))
    eng.run_to_completion()
    assert again.num_cached_tokens == 79  # all but the last prompt token (4 whole blocks + 15 copied slots)
    assert_all_returned(eng)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["submit", "submit", "step", "step", "step", "cancel"]), st.integers(0, 7)),
        min_size=1,
        max_size=40,
    )
)
def test_random_submit_cancel_step_never_leaks_a_block(ops):
    """Random submits (prefixes drawn from a few shared ones), cancels and steps on a 10-block pool: the block pool
    invariants hold after every operation, and when everything has ended every block is free or cached."""
    eng = make_engine(num_blocks=10, max_num_batched_tokens=24, max_batch=3)
    prefixes = [random_tokens(40, 100 + i) for i in range(3)]
    live = []
    for op, k in ops:
        if op == "submit":
            prompt = prefixes[k % 3][: 10 + 5 * k] + random_tokens(k + 1, 200 + len(live))
            live.append(
                eng.add_request(prompt, SamplingParams(max_tokens=1 + k, temperature=0.0, ignore_eos=True))
            )
        elif op == "cancel" and live:
            eng.abort_request(live[k % len(live)].request_id)
        elif eng.has_unfinished():
            eng.step()
        eng.kv.check_invariants()
    eng.run_to_completion(max_steps=2000)
    assert_all_returned(eng)
    assert eng.stats().requests == len(live)
