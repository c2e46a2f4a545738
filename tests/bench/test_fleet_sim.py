"""The fleet in virtual time (``bench.fleet.sim``): tokens, the replica scheduler, determinism, the bench's
JSON line, and stopping on a signal."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import replace

import pytest

from bench.fleet.__main__ import main as fleet_main
from bench.fleet.replica import EngineTiming
from bench.fleet.sim import Clock, SimConfig, SimReplica, _Seq, chat_tokens, index_blocks_for, simulate
from bench.fleet.soak import until_signal
from bench.fleet.tokens import encode_chat
from bench.fleet.workload import WorkloadConfig, build_sessions
from gateway.transport.routing_policy import block_hashes

TIMING = EngineTiming()


def test_chat_tokens_memoized_per_message_equal_the_whole_rendering():
    sessions = build_sessions(WorkloadConfig(n_sessions=5, seed=3), 1.0)
    for s in sessions:
        messages = [{"role": "system", "content": s.system}]
        for user in s.user_messages:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": " w1 w2."}]
            assert chat_tokens(messages) == encode_chat(messages)


def seq(ids: list[int], events: list, name: str, max_tokens: int = 3) -> _Seq:
    return _Seq(
        ids,
        block_hashes(ids),
        max_tokens,
        on_first=lambda cached: events.append((name, "first", cached)),
        on_done=lambda n: events.append((name, "done", n)),
        on_fail=lambda after_first: events.append((name, "fail", after_first)),
    )


def run(clock: Clock, until: float) -> None:
    while clock._heap and clock._heap[0][0] <= until:
        fn = clock.pop()
        assert fn is not None
        fn()


def test_replica_prefills_one_at_a_time_batches_decode_and_caches_whole_blocks():
    clock = Clock()
    replica = SimReplica("r", 1600, TIMING, clock)
    replica.start()
    events: list = []
    ids = list(range(100))  # 6 full blocks
    assert replica.submit(seq(ids, events, "a"))
    assert replica.submit(seq(ids[:96] + [7, 8, 9, 10], events, "b"))
    run(clock, 10.0)
    # a: cold prefill of 100 tokens; b: its 96 leading tokens were cached after a's prefill.
    assert [e for e in events if e[1] == "first"] == [("a", "first", 0), ("b", "first", 96)]
    assert [e for e in events if e[1] == "done"] == [("a", "done", 3), ("b", "done", 3)]
    prefill = 100 * TIMING.prefill_s_per_token + 4 * TIMING.prefill_s_per_token
    # Prefill first while the batch has room: b's prefill runs before a's first decode step, then the two
    # decode their 2 remaining tokens together (the first one comes from each prefill).
    assert replica.busy_s == pytest.approx(prefill + 2 * TIMING.decode_step_s(2))
    assert replica.served == 2 and len(replica.cache) == 6


def test_kill_fails_queued_requests_before_and_decoding_ones_after_the_first_byte():
    clock = Clock()
    replica = SimReplica("r", 1600, TIMING, clock)
    replica.start()
    events: list = []
    replica.submit(seq(list(range(64)), events, "a", max_tokens=50))
    replica.submit(seq(list(range(500, 1500)), events, "b"))
    run(clock, 64 * TIMING.prefill_s_per_token + 1e-9)  # a's prefill is done, b's is running
    replica.kill()
    assert events == [("a", "first", 0), ("b", "fail", False), ("a", "fail", True)]
    run(clock, 100.0)  # the steps scheduled before the kill land in a dead life: nothing happens
    assert len(events) == 3 and not replica.submit(seq([1] * 32, events, "c"))
    replica.start()
    assert len(replica.cache) == 0 and replica.submit(seq([1] * 32, events, "c"))


def small(policy: str, **kw) -> SimConfig:
    return SimConfig(
        policy=policy,
        n_gateways=1,
        load=0.5,
        n_replicas=3,
        faults=False,
        share=False,
        workload=WorkloadConfig(n_sessions=12, n_prefixes=4, seed=5),
        **kw,
    )


async def test_a_cell_is_deterministic_and_counts_every_request():
    a = await simulate(small("cache_aware"))
    b = await simulate(small("cache_aware"))
    assert a == b
    turns = sum(len(s.user_messages) for s in build_sessions(small("x").workload, 1.0))
    assert a["requests"] == a["ok"] == turns and a["errors"] == a["retries"] == 0
    assert 0 < a["hit_rate"] <= a["single_hit_rate"] + 1e-9


async def test_consistent_hash_sends_every_turn_of_a_prefix_home_when_alone():
    cfg = replace(small("consistent_hash"), load=0.01)  # one request in flight at a time
    r = await simulate(cfg)
    rr = await simulate(replace(cfg, policy="round_robin"))
    # Alone on the fleet, each prefix stays home: after its first request everything but the new turn hits.
    assert r["hit_rate"] > rr["hit_rate"] and r["errors"] == rr["errors"] == 0


async def test_faults_kill_and_restart_a_replica_and_requests_fail_over():
    cfg = replace(small("round_robin"), n_replicas=5, faults=True, load=1.0)
    r = await simulate(cfg)
    assert r["retries"] > 0  # refused by the replica that had not joined yet, or queued on the killed one
    assert r["ok"] + r["errors"] == r["requests"]


def test_index_blocks_follow_the_text_per_token_ratio():
    wl = WorkloadConfig(n_sessions=20)
    assert (
        index_blocks_for(8000, wl) == 2 * index_blocks_for(4000, wl)
        or abs(index_blocks_for(8000, wl) - 2 * index_blocks_for(4000, wl)) <= 1
    )
    assert index_blocks_for(8000, wl) > 8000 // 16  # ~3 characters per token here, not llm-d's 4


def test_bench_json_line_holds_the_issue_keys(capsys):
    argv = ["--sessions", "10", "--gateways", "1", "--loads", "low", "high"]
    argv += ["--policies", "round_robin", "cache_aware", "--soak", "0", "--seeds", "1"]
    assert fleet_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("cache_aware_share_of_single", "max_over_mean_load", "gateways4_share_of_1"):
        assert key in out
    assert out["soak_failed"] is None and out["soak_leaked_blocks"] is None
    assert out["gateways4_share_of_1"] is None  # no 4-gateway cell in this run
    assert out["seeds"] == [18] and len(out["cache_aware_share_of_single_by_seed"]) == 1
    assert [(r["policy"], r["load"]) for r in out["rows"]] == [
        ("round_robin", "low"),
        ("cache_aware", "low"),
        ("round_robin", "high"),
        ("cache_aware", "high"),
    ]


async def test_a_signal_cancels_the_work_and_its_finally_runs():
    cleaned: list[str] = []

    async def work() -> str:
        try:
            await asyncio.sleep(3600)
            return "finished"
        finally:
            cleaned.append("children stopped")

    async def send_term() -> None:
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = asyncio.create_task(send_term())
    assert await until_signal(work()) is None
    await killer
    assert cleaned == ["children stopped"]
    assert await until_signal(asyncio.sleep(0, result="done")) == "done"  # handlers removed, reusable
