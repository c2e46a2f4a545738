"""Scheduler alone (no model): continuous batching, chunked prefill, budgets, waiting on blocks, preemption,
policies (fcfs / lpm), the starvation bound and in-flight sharing. A fake forward marks scheduled tokens computed,
registers full blocks (as the engine does after every step) and appends token 7 where a token is sampled."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.api import EngineConfig, SamplingParams
from engine.block_hash import hash_request_blocks
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling import SequenceSampler
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stats import EngineCounters

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Sim:
    """A scheduler over a real KVCacheManager and a fake forward pass."""

    def __init__(self, *, sharing: bool = True, clock: Clock | None = None, **cfg) -> None:
        config = replace(
            EngineConfig(block_size=BS, num_blocks=64, max_batch=8, max_num_batched_tokens=32),
            enable_inflight_sharing=sharing,
            **cfg,
        )
        self.kv = KVCacheManager(config.num_blocks, BS, config.enable_prefix_caching)
        self.counters = EngineCounters()
        self.clock = clock or Clock()
        self.sched = Scheduler(self.kv, config, self.counters, clock=self.clock)
        self.finished: list[Request] = []
        self.steps = 0

    def add(self, ids: list[int], max_tokens: int = 3, rid: str | None = None) -> Request:
        req = Request(
            request_id=rid
            or f"r{len(self.sched.waiting) + len(self.sched.running) + len(self.finished)}-{ids[:2]}",
            prompt_token_ids=list(ids),
            params=SamplingParams(max_tokens=max_tokens),
            max_tokens=max_tokens,
            stop_token_ids=frozenset(),
            extra_keys=("m", ""),
            arrival_time=self.clock(),
            sampler=SequenceSampler(SamplingParams(max_tokens=max_tokens, seed=0), list(ids)),
        )
        req.update_block_hashes(
            BS, lambda toks, parent: hash_request_blocks(toks, BS, ("m", ""), parent=parent)
        )
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.steps += 1
        for r in out.finished:
            self.finished.append(r)
        for s in out.scheduled:
            r = s.request
            r.num_computed_tokens = s.end
            self.counters.prefill_tokens += s.num_prefill_tokens
            self.kv.cache_full_blocks(
                r.request_id, r.all_token_ids, r.num_computed_tokens, r.block_hashes, r.extra_keys
            )
            if s.needs_token:
                r.append_token(7)
                r.update_block_hashes(
                    BS, lambda toks, parent: hash_request_blocks(toks, BS, ("m", ""), parent=parent)
                )
                if r.num_output_tokens >= r.max_tokens:
                    self.sched.finish_request(r)
                    self.finished.append(r)
        self.kv.check_invariants()
        return out

    def run(self, max_steps: int = 1000) -> None:
        while self.sched.has_unfinished():
            self.step()
            assert self.steps <= max_steps, "did not finish"


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def test_chunked_prefill_does_not_stall_running_decodes():
    sim = Sim(max_num_batched_tokens=16)
    a = sim.add(toks(6, 1), max_tokens=20)
    sim.step()  # a prefilled
    b = sim.add(toks(50, 2), max_tokens=2)
    chunks = []
    while b.num_output_tokens == 0:
        out = sim.step()
        by_req = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert by_req[a.request_id] == 1  # a decodes every step
        assert out.num_tokens <= 16
        chunks.append(by_req.get(b.request_id, 0))
    assert chunks == [15, 15, 15, 5]
    assert out.scheduled[0].request is a  # decodes come first


def test_max_batch_caps_sequences_per_step():
    sim = Sim(max_batch=3, max_num_batched_tokens=1000)
    reqs = [sim.add(toks(5, i), max_tokens=4) for i in range(7)]
    out = sim.step()
    assert len(out.scheduled) == 3
    assert [s.request for s in out.scheduled] == reqs[:3]
    sim.run()
    assert all(r.num_output_tokens == 4 for r in reqs)


def test_request_without_blocks_waits_and_runs_later():
    sim = Sim(num_blocks=8, max_num_batched_tokens=100, enable_prefix_caching=False)
    big = sim.add(toks(19, 1), max_tokens=2)  # 5 blocks, enough for its decode too
    small = sim.add(toks(11, 2), max_tokens=2)  # 3 blocks: the pool is now full
    out = sim.step()
    assert [s.request for s in out.scheduled] == [big, small]
    late = sim.add(toks(12, 3), max_tokens=2)
    out = sim.step()
    assert late.status is RequestStatus.WAITING  # no blocks now: it waits, it is not dropped
    sim.run()
    assert late.num_output_tokens == 2 and sim.kv.blocks_used == 0


def test_decode_out_of_blocks_preempts_newest_and_recomputes():
    sim = Sim(num_blocks=6, max_num_batched_tokens=100, enable_prefix_caching=False)
    old = sim.add(toks(8, 1), max_tokens=8)
    new = sim.add(toks(8, 2), max_tokens=8)
    sim.step()  # both prefilled: 2 blocks each (+2 free)
    preempted = []
    while sim.sched.has_unfinished():
        out = sim.step()
        preempted += out.preempted
    assert preempted and all(r is new for r in preempted)
    assert sim.counters.preemptions == len(preempted) == new.num_preemptions
    assert old.num_preemptions == 0
    assert old.num_output_tokens == new.num_output_tokens == 8
    # the recompute re-prefills prompt + generated tokens, and counts as prefill, never as a hit
    assert sim.counters.prefill_tokens > 16
    assert sim.counters.prefix_hit_tokens == 0
    assert sim.kv.blocks_used == 0


def test_lone_request_that_fills_the_pool_finishes_with_length():
    sim = Sim(num_blocks=3, max_num_batched_tokens=100)
    r = sim.add(toks(10, 1), max_tokens=50)
    sim.run()
    assert r in sim.finished and r.finish_reason == "length"
    # 3 blocks x 4 slots hold tokens 0..11; token 12 was sampled from position 11 and needs no slot
    assert r.num_tokens == 13 and r.num_output_tokens == 3
    assert sim.kv.blocks_used == 0


def test_wholly_cached_prompt_still_computes_its_last_token():
    sim = Sim()
    p = toks(12, 5)  # exactly 3 blocks
    sim.add(p, max_tokens=1)
    sim.run()
    r = sim.add(p, max_tokens=1)
    out = sim.step()
    assert r.num_cached_tokens == 8  # (12 - 1) // 4 blocks
    assert out.scheduled[0].num_new_tokens == 4


def test_lpm_prefers_longest_cached_prefix_and_fcfs_keeps_arrival_order():
    for policy, expect_first in (("lpm", "warm"), ("fcfs", "cold")):
        sim = Sim(scheduling=policy, max_batch=1)
        shared = toks(16, 9)
        sim.add(shared + [1], max_tokens=1)
        sim.run()
        cold = sim.add(toks(17, 10), max_tokens=1, rid="cold")
        warm = sim.add(shared + [2], max_tokens=1, rid="warm")
        out = sim.step()
        assert out.scheduled[0].request.request_id == expect_first, policy
        assert len(out.scheduled) == 1
        later = cold if expect_first == "warm" else warm
        assert later.status is RequestStatus.WAITING


def test_lpm_groups_requests_sharing_a_prefix_into_one_step():
    sim = Sim(scheduling="lpm", max_batch=4, max_num_batched_tokens=1000)
    pa, pb = toks(16, 1), toks(16, 2)
    sim.add(pa + [1], max_tokens=1)
    sim.add(pb + [1], max_tokens=1)
    sim.run()
    # interleaved arrivals of two prefix groups; both prefixes are cached (4 blocks each)
    arrivals = [
        sim.add((pa if i % 2 == 0 else pb) + [10 + i], max_tokens=1, rid=f"{'ab'[i % 2]}{i}")
        for i in range(6)
    ]
    out = sim.step()
    names = [s.request.request_id for s in out.scheduled]
    assert names == ["a0", "a2", "a4", "b1"]
    assert all(r.num_cached_tokens == 16 for r in arrivals if r.status is RequestStatus.RUNNING)


def test_starvation_bound_admits_a_cold_request_among_a_stream_of_hits():
    """One cold request among a steady stream of cache hits (lpm, one sequence per step): without a bound it
    never runs; with max_wait_s = 5 steps it runs within the bound (steps are counted with a fake clock)."""

    def run(max_wait_s: float) -> int | None:
        clock = Clock()
        sim = Sim(scheduling="lpm", max_batch=1, max_wait_s=max_wait_s, clock=clock)
        shared = toks(16, 1)
        sim.add(shared + [0], max_tokens=1)
        sim.run()
        cold = sim.add(toks(17, 2), max_tokens=1, rid="cold")
        for i in range(60):
            sim.add(shared + [100 + i], max_tokens=1)  # a new hit arrives every step
            sim.step()
            clock.t += 1.0
            if cold.is_finished:
                return i + 1
        return None

    assert run(float("inf")) is None
    steps = run(5.0)
    assert steps is not None and steps <= 5 + 2  # bound + one step to pass it + its own step


def test_burst_sharing_a_new_prefix_prefills_it_once():
    for sharing, expect in ((True, 64 + 8 * 8), (False, 8 * 72)):
        sim = Sim(sharing=sharing, max_batch=16, max_num_batched_tokens=1000, num_blocks=256)
        prefix = toks(64, 3)
        reqs = [sim.add(prefix + toks(8, 100 + i), max_tokens=2) for i in range(8)]
        sim.run()
        assert sim.counters.prefill_tokens == expect
        if sharing:
            assert all(r.num_cached_tokens == 64 for r in reqs[1:])
            assert all(r.num_inflight_shared_tokens == 64 for r in reqs[1:])
            assert sim.counters.inflight_shared_tokens == 7 * 64
        else:
            assert sim.counters.inflight_shared_tokens == 0


def test_followers_arriving_mid_chunked_prefill_attach_to_the_leaders_blocks():
    sim = Sim(max_num_batched_tokens=16, num_blocks=256)
    prefix = toks(64, 4)
    leader = sim.add(prefix + toks(4, 50), max_tokens=1)
    sim.step()  # leader computed 16 of 68
    followers = [sim.add(prefix + toks(4, 60 + i), max_tokens=1) for i in range(3)]
    while sim.sched.has_unfinished():
        out = sim.step()
        if leader.status is RequestStatus.RUNNING:
            # followers never compute blocks the leader is computing
            assert all(s.request is leader for s in out.scheduled)
    assert sim.counters.prefill_tokens == 68 + 3 * 4
    assert [f.num_cached_tokens for f in followers] == [64] * 3
    # 16 tokens were already cached at their arrival; 48 were in flight in the leader
    assert [f.num_inflight_shared_tokens for f in followers] == [48] * 3


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="scheduling"):
        Sim(scheduling="random")
