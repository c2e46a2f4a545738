"""Short prompts behind a long prefill (head-of-line blocking), scheduler alone: exact step-by-step plans.

The trial that found it: a 3,500-token prompt, then a 51-token one 1.5 s later; the short one got its first token
only when the long prefill was done (13 s), because a running prefill took the whole step budget every step and
a waiting prompt was admitted only from what was left. Here with a 32-token budget and the default threshold (16,
half the budget): a plan is a list of ``(request id, start, tokens)``, decodes first, then running prefills in
admission order, then admissions."""

from __future__ import annotations

import pytest

from engine.api import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stats import EngineCounters
from tests.engine.test_scheduler import Sim, toks


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_short_prompt_is_admitted_between_the_chunks_of_a_long_prefill():
    sim = Sim()  # budget 32, threshold 16
    sim.add(toks(100, 1), max_tokens=2, rid="L")
    assert plan(sim.step()) == [("L", 0, 32)]
    short = sim.add(toks(6, 2), max_tokens=2, rid="S")
    # the short prompt goes in the very next step; the long prefill takes the rest of the budget
    assert plan(sim.step()) == [("L", 32, 26), ("S", 0, 6)]
    assert short.num_output_tokens == 1
    # nothing waits: the long prefill takes the whole budget again (after the short one's decode)
    assert plan(sim.step()) == [("S", 6, 1), ("L", 58, 31)]
    assert short.is_finished
    assert plan(sim.step()) == [("L", 89, 11)]
    assert plan(sim.step()) == [("L", 100, 1)]
    assert not sim.sched.has_unfinished()


def test_without_the_threshold_the_short_prompt_waits_for_the_whole_long_prefill():
    """``long_prefill_token_threshold=0``: the schedule before the fix (the trial's 13 s TTFT)."""
    sim = Sim(long_prefill_token_threshold=0)
    sim.add(toks(100, 1), max_tokens=2, rid="L")
    assert plan(sim.step()) == [("L", 0, 32)]
    sim.add(toks(6, 2), max_tokens=2, rid="S")
    assert plan(sim.step()) == [("L", 32, 32)]
    assert plan(sim.step()) == [("L", 64, 32)]
    assert plan(sim.step()) == [("L", 96, 4), ("S", 0, 6)]


def test_a_short_prompt_passes_a_long_one_waiting_behind_a_long_prefill():
    """The trial's second report (running=1, waiting=2): two long prompts and a short one. One long prefill runs
    at a time, in arrival order; the short prompt passes the waiting long one; the second long prefill starts in
    the step where the first one's last chunk is short."""
    sim = Sim()
    sim.add(toks(100, 1), max_tokens=2, rid="L1")
    l2 = sim.add(toks(100, 2), max_tokens=2, rid="L2")
    assert plan(sim.step()) == [("L1", 0, 32)]
    assert l2.status is RequestStatus.WAITING  # a long prompt waits while another long prefill runs
    sim.add(toks(6, 3), max_tokens=2, rid="S")
    assert plan(sim.step()) == [("L1", 32, 26), ("S", 0, 6)]
    assert (len(sim.sched.running), len(sim.sched.waiting)) == (2, 1)
    assert plan(sim.step()) == [("S", 6, 1), ("L1", 58, 31)]
    assert plan(sim.step()) == [("L1", 89, 11), ("L2", 0, 21)]
    assert plan(sim.step()) == [("L1", 100, 1), ("L2", 21, 31)]
    assert plan(sim.step()) == [("L2", 52, 32)]
    assert plan(sim.step()) == [("L2", 84, 16)]
    assert plan(sim.step()) == [("L2", 100, 1)]
    assert not sim.sched.has_unfinished()


def test_several_long_prompts_are_prefilled_one_after_the_other_as_before():
    """Three long prompts at once (the trial's 6k-token report): one prefill at a time, the next one starting in
    the step of the previous one's last chunk, step for step the plans of the old schedule (threshold 0)."""

    def plans(threshold: int | None) -> list[list[tuple[str, int, int]]]:
        sim = Sim(num_blocks=512, long_prefill_token_threshold=threshold)
        for i in range(3):
            sim.add(toks(150 + i, i), max_tokens=4, rid=f"L{i}")
        out = []
        while sim.sched.has_unfinished():
            out.append(plan(sim.step()))
        return out

    new, old = plans(None), plans(0)
    assert new == old
    assert new[4] == [("L0", 128, 22), ("L1", 0, 10)]  # L1 starts with what L0's last chunk leaves
    assert [p for p in new if any(r == "L2" for r, _, _ in p)][0] == [("L1", 135, 16), ("L2", 0, 16)]


def test_short_prefills_take_at_most_the_threshold_while_a_long_prefill_runs():
    sim = Sim()
    sim.add(toks(100, 1), max_tokens=1, rid="L")
    assert plan(sim.step()) == [("L", 0, 32)]
    for i in range(3):
        sim.add(toks(8, 10 + i), max_tokens=1, rid=f"S{i}")
    assert plan(sim.step()) == [("L", 32, 16), ("S0", 0, 8), ("S1", 0, 8)]
    assert plan(sim.step()) == [("L", 48, 24), ("S2", 0, 8)]
    assert plan(sim.step()) == [("L", 72, 28)]


def test_a_short_chunk_cut_by_the_threshold_runs_first_next_step():
    sim = Sim()
    sim.add(toks(100, 1), max_tokens=1, rid="L")
    sim.step()
    sim.add(toks(12, 10), max_tokens=1, rid="S0")
    sim.add(toks(12, 11), max_tokens=1, rid="S1")
    assert plan(sim.step()) == [("L", 32, 16), ("S0", 0, 12), ("S1", 0, 4)]
    sim.add(toks(12, 12), max_tokens=1, rid="S2")
    # S1's rest is a running short prefill: it goes before the admission, both inside the threshold
    assert plan(sim.step()) == [("L", 48, 16), ("S1", 4, 8), ("S2", 0, 8)]
    assert plan(sim.step()) == [("L", 64, 28), ("S2", 8, 4)]


def test_the_long_prefill_progresses_every_step_under_a_stream_of_short_prompts():
    sim = Sim(num_blocks=256)
    long = sim.add(toks(300, 1), max_tokens=1, rid="L")
    sim.step()
    chunks = []
    for i in range(20):
        sim.add(toks(6, 100 + i), max_tokens=1, rid=f"S{i}")
        by_req = {rid: n for rid, _, n in plan(sim.step())}
        assert by_req[f"S{i}"] == 6  # each short prompt is prefilled in the step after it arrives
        if "L" not in by_req:
            break
        chunks.append(by_req["L"])
    assert chunks == [26] * 10 + [8]  # 32 + 10 * 26 + 8 = 300
    assert long.is_finished


def test_decodes_still_come_first_and_a_long_prefill_alone_takes_the_whole_budget():
    sim = Sim(max_num_batched_tokens=16)  # threshold 8
    sim.add(toks(6, 1), max_tokens=20, rid="A")
    sim.step()
    sim.add(toks(50, 2), max_tokens=1, rid="B")
    plans = [plan(sim.step()) for _ in range(4)]
    assert plans == [
        [("A", 6, 1), ("B", 0, 15)],
        [("A", 7, 1), ("B", 15, 15)],
        [("A", 8, 1), ("B", 30, 15)],
        [("A", 9, 1), ("B", 45, 5)],
    ]


def test_a_prompt_with_a_long_cached_prefix_counts_only_its_uncached_tokens():
    """A question about a cached document is a short prefill: it passes a long one."""
    sim = Sim()
    doc = toks(64, 5)
    sim.add(doc + [1], max_tokens=1)
    sim.run()
    sim.add(toks(100, 1), max_tokens=1, rid="L")
    sim.step()
    q = sim.add(doc + toks(6, 6), max_tokens=1, rid="Q")
    assert plan(sim.step()) == [("L", 32, 26), ("Q", 64, 6)]
    assert q.num_cached_tokens == 64


def test_followers_of_a_long_leader_still_wait_for_its_blocks():
    """In-flight sharing is unchanged: a follower whose prefix the long prefill is computing does not take the
    short room; it is admitted once the leader's blocks are cached and prefills only its own suffix."""
    sim = Sim()
    prefix = toks(64, 4)
    sim.add(prefix + toks(36, 50), max_tokens=1, rid="L")
    assert plan(sim.step()) == [("L", 0, 32)]
    f = sim.add(prefix + toks(4, 60), max_tokens=1, rid="F")
    assert plan(sim.step()) == [("L", 32, 32)]
    assert f.status is RequestStatus.WAITING
    assert plan(sim.step()) == [("L", 64, 28), ("F", 64, 4)]
    assert (f.num_cached_tokens, f.num_inflight_shared_tokens) == (64, 32)


@pytest.mark.parametrize(("budget", "threshold"), [(32, -1), (32, 32), (32, 40), (1, 1)])
def test_a_threshold_outside_the_budget_is_rejected(budget, threshold):
    config = EngineConfig(
        block_size=4,
        num_blocks=8,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(KVCacheManager(8, 4, True), config, EngineCounters())


@pytest.mark.parametrize(
    ("budget", "threshold", "resolved"), [(512, None, 256), (33, None, 16), (1, None, 0)]
)
def test_the_default_threshold_is_half_the_budget(budget, threshold, resolved):
    config = EngineConfig(
        block_size=4,
        num_blocks=8,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )
    assert Scheduler(KVCacheManager(8, 4, True), config, EngineCounters()).long_threshold == resolved


def test_engine_short_prompt_between_long_chunks_gets_the_tokens_it_gets_alone():
    """Engine level, tiny model, 64-token budget (threshold 32): a 300-token prompt, and a 20-token one added after
    its first chunk. The short one's first token comes in the next step, long before the long prefill ends; both
    get the greedy tokens and logits each gets alone (uncached, unchunked), whatever the interleaving."""
    from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint
    from tests.engine.test_engine_cache_parity import assert_same

    ckpt = tiny_checkpoint()
    eng = make_engine(ckpt, record_logits=True, max_num_batched_tokens=64)
    long_prompt, short_prompt = random_tokens(300, 70), random_tokens(20, 71)
    long = eng.add_request(long_prompt, greedy(4))
    eng.step()
    short = eng.add_request(short_prompt, greedy(4))
    plans = []
    while eng.has_unfinished():
        plan_ = eng.schedule_step()
        plans.append({s.request.request_id: (s.start, s.num_new_tokens) for s in plan_.sched.scheduled})
        eng.finish_step(plan_, eng.run_step(plan_))
    lid, sid = long.request_id, short.request_id
    assert plans[0] == {lid: (64, 44), sid: (0, 20)}
    assert plans[1] == {sid: (20, 1), lid: (108, 63)}
    assert [p[lid] for p in plans[2:5]] == [(171, 63), (234, 63), (297, 3)]  # the long prefill every step
    assert short.num_output_tokens == 4 and long.num_output_tokens == 4
    assert_same(ckpt, eng, long, long_prompt, 4)
    assert_same(ckpt, eng, short, short_prompt, 4)


def test_at_a_long_prefills_last_chunk_the_next_long_one_and_a_short_one_share_what_it_leaves():
    sim = Sim(num_blocks=512)
    sim.add(toks(150, 0), max_tokens=1, rid="L0")
    sim.add(toks(151, 1), max_tokens=1, rid="L1")
    for _ in range(4):
        sim.step()  # L0: 128 of 150 computed, L1 waiting
    sim.add(toks(6, 2), max_tokens=1, rid="S")
    # L0's last chunk first (oldest long), the short prompt within the threshold, L1 the rest
    assert plan(sim.step()) == [("L0", 128, 22), ("L1", 0, 4), ("S", 0, 6)]
    assert plan(sim.step()) == [("L1", 4, 32)]
