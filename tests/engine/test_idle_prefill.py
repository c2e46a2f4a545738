"""Idle prefills (``Request.idle``, ``AsyncEngine.prefill_next_turn``): a conversation's next turn, its reply
included, prefilled on the prompt path while nothing else runs, so the next turn computes only its new message
and still answers as it would cold. Counts are exact on the tiny checkpoint (blocks of 16)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

import engine.async_engine as async_engine_module
from engine.api import Finished, GenerationRequest, TextDelta
from engine.async_engine import AsyncEngine
from engine.next_turn import next_turn_prefix
from tests.engine.engine_helpers import ManualClock, greedy, make_engine, random_tokens, tiny_checkpoint
from tests.engine.test_batch_invariance import N_NEW, int4_checkpoint

SYSTEM = {"role": "system", "content": "You are the idle prefill test. Answer in one short line. " * 3}


def admit_idle(eng, tokens: list[int], rid: str):
    """Queue ``tokens`` as an idle prefill on an ``LLMEngine`` (what ``prefill_next_turn`` submits)."""
    return eng.add_checked_request(tokens, greedy(1), request_id=rid, idle=True)


def test_an_idle_prefill_computes_its_prompt_in_small_steps_and_samples_nothing():
    eng = make_engine(idle_prefill_chunk_tokens=64)
    req = admit_idle(eng, random_tokens(200, seed=1), "idle")
    planned = []
    while eng.has_unfinished():
        plan = eng.schedule_step()
        planned.append(plan.sched.num_tokens)
        assert not any(s.needs_token for s in plan.sched.scheduled)
        eng.finish_step(plan, eng.run_step(plan))
    assert planned == [64, 64, 64, 8]
    assert req.output_token_ids == [] and req.finish_reason == "stop"
    stats = eng.stats()
    assert (stats.idle_prefills, stats.idle_prefill_tokens) == (1, 200)
    # no client's request: kept out of the request, prompt, hit and TTFT counters
    assert (stats.requests, stats.prompt_tokens, stats.prefix_query_tokens, stats.ttft.count) == (0, 0, 0, 0)
    assert stats.blocks_used == 0 and stats.blocks_cached == 200 // 16 + 1  # the partial last block kept
    eng.kv.check_invariants()


def test_an_idle_prefill_steps_aside_for_a_request_and_resumes_from_what_it_cached():
    eng = make_engine(idle_prefill_chunk_tokens=128, enable_partial_prefix_hits=False)
    idle = admit_idle(eng, random_tokens(300, seed=2), "idle")
    eng.step()  # alone: its first 128 tokens
    assert idle.num_computed_tokens == 128
    client = eng.add_request(random_tokens(40, seed=3), greedy(3), request_id="client")
    plan = eng.schedule_step()
    assert [s.request.request_id for s in plan.sched.scheduled] == ["client"]
    assert plan.sched.num_tokens == 40  # the whole budget was there for it: no idle token in its step
    eng.finish_step(plan, eng.run_step(plan))
    assert eng.stats().idle_prefills_yielded == 1
    while client.finish_reason is None:
        plan = eng.schedule_step()
        assert all(not s.request.idle for s in plan.sched.scheduled)  # not while the client runs
        eng.finish_step(plan, eng.run_step(plan))
    eng.run_to_completion()
    stats = eng.stats()
    # resumed from its 8 cached blocks: 128 + 172, nothing computed twice
    assert idle.finish_reason == "stop" and stats.idle_prefill_tokens == 300
    assert (stats.requests, stats.idle_prefills, stats.blocks_used) == (1, 1, 0)
    eng.kv.check_invariants()


def test_an_idle_prefill_waits_while_any_request_waits_or_runs():
    eng = make_engine()
    client = eng.add_request(random_tokens(30, seed=4), greedy(5), request_id="client")
    idle = admit_idle(eng, random_tokens(50, seed=5), "idle")
    while client.finish_reason is None:
        eng.step()
        assert idle.num_computed_tokens == 0
    eng.run_to_completion()
    assert idle.finish_reason == "stop" and eng.stats().idle_prefill_tokens == 50


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_a_next_turn_after_an_idle_prefill_reuses_the_reply_and_equals_it_cold_bit_for_bit(kv_dtype):
    """Without the idle prefill the next turn reuses turn 1's prompt only (``cache_generated_kv`` off), and
    computes the reply again; with it, the reply too, with the KV a cold run computes."""
    first = random_tokens(150, seed=11)
    eng = make_engine(int4_checkpoint(), record_logits=True, kv_dtype=kv_dtype)
    turn1 = eng.add_request(first, greedy(40))
    eng.run_to_completion()
    resent = first + turn1.output_token_ids
    admit_idle(eng, resent, "idle")
    eng.run_to_completion()
    second = resent + random_tokens(20, seed=12)
    warm = eng.add_request(second, greedy(N_NEW))
    eng.run_to_completion()
    assert warm.num_cached_tokens == len(resent)  # token-granular: all of it, the reply included
    cold_eng = make_engine(int4_checkpoint(), record_logits=True, kv_dtype=kv_dtype)
    cold = cold_eng.add_request(second, greedy(N_NEW))
    cold_eng.run_to_completion()
    assert warm.output_token_ids == cold.output_token_ids
    assert torch.equal(
        torch.stack(eng.logits_log[warm.request_id]), torch.stack(cold_eng.logits_log[cold.request_id])
    )
    eng.kv.check_invariants()


def test_the_next_turn_prefix_ends_at_the_next_message_s_content():
    tok = tiny_checkpoint().tokenizer
    conv = [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    prefix = next_turn_prefix(tok, conv, None, "")
    for nxt in ("What is a block?", "!", "?"):
        full = tok.render_chat([*conv, {"role": "user", "content": nxt}], scope="")
        assert full[: len(prefix)] == prefix
    # the reply, its end of turn and the next turn's head (special tokens are not decoded)
    assert tok.decode(prefix).endswith("\nassistant\nHello there.\nuser\n")
    assert next_turn_prefix(tok, conv[:2], None, "") is None  # the newest message is no reply


def test_the_next_turn_prefix_of_a_tool_call_reaches_the_result_s_head():
    tok = tiny_checkpoint().tokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    conv = [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    prefix = next_turn_prefix(tok, conv, None, "")
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}
    full = tok.render_chat([*conv, result], scope="")
    assert full[: len(prefix)] == prefix and len(prefix) > len(tok.render_chat(conv[:2], scope=""))


async def generate(eng: AsyncEngine, messages: list[dict], max_tokens: int = 12, salt: str = "t") -> Finished:
    events = [
        e
        async for e in eng.generate(
            GenerationRequest(messages=messages, params=greedy(max_tokens), cache_salt=salt)
        )
    ]
    return events[-1]


async def test_prefill_next_turn_serves_the_next_turn_all_but_its_new_message():
    eng = AsyncEngine(make_engine(), tiny_checkpoint().tokenizer)
    try:
        conv = [SYSTEM, {"role": "user", "content": "What is a block table?"}]
        reply = (await generate(eng, conv, 40)).text
        conv = [*conv, {"role": "assistant", "content": reply}]
        prefix = next_turn_prefix(eng._tokenizer, conv, None, "t")
        computed = await eng.prefill_next_turn(GenerationRequest(messages=conv, cache_salt="t"))
        assert computed is not None and 0 < computed < len(prefix)
        nxt = [*conv, {"role": "user", "content": "And a slot mapping?"}]
        assert (await generate(eng, nxt)).usage.cached_tokens == len(prefix)
        # another tenant's next turn finds none of it
        assert (await generate(eng, nxt, salt="other")).usage.cached_tokens == 0
        # done again: all but the last token was cached
        assert await eng.prefill_next_turn(GenerationRequest(messages=conv, cache_salt="t")) == 1
        assert eng.stats().requests == 3
    finally:
        await eng.shutdown()


@pytest.mark.parametrize(
    "config", [{"idle_reply_prefill": False}, {"cache_generated_kv": True}, {"enable_prefix_caching": False}]
)
async def test_prefill_next_turn_does_nothing_where_it_is_off_or_would_keep_nothing(config):
    eng = AsyncEngine(make_engine(**config), tiny_checkpoint().tokenizer)
    try:
        conv = [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
        assert await eng.prefill_next_turn(GenerationRequest(messages=conv)) is None
        assert eng.stats().idle_prefill_tokens == 0
    finally:
        await eng.shutdown()


async def test_prefill_next_turn_skips_what_is_no_reply_or_does_not_fit():
    eng = AsyncEngine(make_engine(max_model_len=64), tiny_checkpoint().tokenizer)
    try:
        assert (
            await eng.prefill_next_turn(
                GenerationRequest(messages=[SYSTEM, {"role": "user", "content": "Hi"}])
            )
            is None
        )
        too_long = [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
        assert await eng.prefill_next_turn(GenerationRequest(messages=too_long)) is None
        assert await eng.prefill_next_turn(GenerationRequest(prompt="text")) is None
        stats = eng.stats()
        assert (stats.idle_prefill_tokens, stats.blocks_used) == (0, 0)
    finally:
        await eng.shutdown()


async def test_a_newer_idle_prefill_drops_the_oldest_past_the_cap(monkeypatch):
    monkeypatch.setattr(async_engine_module, "MAX_IDLE_PREFILLS", 1)
    eng = AsyncEngine(make_engine(), tiny_checkpoint().tokenizer)
    try:
        busy = eng.generate(
            GenerationRequest(messages=[SYSTEM, {"role": "user", "content": "Go"}], params=greedy(300))
        )
        assert isinstance(await anext(busy), TextDelta)  # running: no idle prefill is admitted now
        turns = [
            [SYSTEM, {"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Hello {i}."}]
            for i in range(2)
        ]
        older = asyncio.ensure_future(eng.prefill_next_turn(GenerationRequest(messages=turns[0])))
        await asyncio.sleep(0)
        newer = asyncio.ensure_future(eng.prefill_next_turn(GenerationRequest(messages=turns[1])))
        assert await older is None
        async for _ in busy:
            pass
        assert await newer > 0
        stats = eng.stats()
        assert (stats.idle_prefills, stats.blocks_used) == (1, 0)
    finally:
        await eng.shutdown()


def test_a_chunk_of_no_token_is_refused():
    with pytest.raises(ValueError, match="idle_prefill_chunk_tokens"):
        make_engine(idle_prefill_chunk_tokens=0)


@pytest.mark.parametrize("after_s, runs", [(20.0, True), (3.0, False)])
def test_an_idle_prefill_runs_only_where_the_pool_keeps_its_blocks_long_enough(after_s, runs):
    """The default ``idle_prefill_min_residency_s`` (5 s): two requests took 24 blocks; ``after_s`` later an
    idle prefill needs 7 of the 24 free or cached ones, so its blocks would stay cached for the other 17 at 24
    blocks per ``after_s``: 14.2 s (runs) or 2.1 s (dropped). Before (``bench.idle_tight_pool``, a 64-block pool,
    no such bound): idle prefills evicted entries released 0.5-2 s before, bought no hit, and the clients' mean
    TTFT rose."""
    clock = ManualClock()
    eng = make_engine(num_blocks=24, enable_partial_prefix_hits=False, clock=clock)
    eng.generate([random_tokens(180, seed=20), random_tokens(180, seed=21)], greedy(1))  # 22 cached blocks
    assert eng.kv.pool.allocations == 24
    clock.now += after_s
    idle = admit_idle(eng, random_tokens(100, seed=22), "idle")
    eng.run_to_completion()
    stats = eng.stats()
    if runs:
        assert idle.finish_reason == "stop" and stats.idle_prefill_tokens == 100 and stats.evictions > 0
        assert stats.idle_prefills_dropped == 0
    else:
        assert idle.finish_reason == "abort" and stats.idle_prefill_tokens == 0 and stats.evictions == 0
        assert stats.idle_prefills_dropped == 1
    assert stats.blocks_used == 0
    eng.kv.check_invariants()


def test_a_residency_bound_of_zero_lets_an_idle_prefill_evict_any_block_released_before_it_was_queued():
    eng = make_engine(num_blocks=24, enable_partial_prefix_hits=False, idle_prefill_min_residency_s=0.0)
    eng.generate([random_tokens(180, seed=20), random_tokens(180, seed=21)], greedy(1))
    idle = admit_idle(eng, random_tokens(100, seed=22), "idle")
    eng.run_to_completion()
    assert idle.finish_reason == "stop" and eng.stats().idle_prefill_tokens == 100


@pytest.mark.parametrize("bound", [-1.0, math.inf, math.nan])
def test_a_residency_bound_that_is_not_a_finite_number_at_least_zero_is_refused(bound):
    with pytest.raises(ValueError, match="idle_prefill_min_residency_s"):
        make_engine(idle_prefill_min_residency_s=bound)


def test_an_idle_prefill_is_dropped_rather_than_evict_blocks_released_after_it_was_queued():
    """Before (a trial, a 64-block pool and six long conversations): each idle prefill evicted blocks another
    conversation's next turn needed and was itself evicted before its own came back: 15,832 idle tokens
    computed for 267 more cached tokens, evictions doubled."""
    eng = make_engine(num_blocks=24, enable_partial_prefix_hits=False)
    first = eng.add_request(random_tokens(60, seed=30), greedy(4))
    eng.run_to_completion()
    idle = admit_idle(eng, first.all_token_ids + random_tokens(40, seed=31), "idle")
    # conversations active since: their blocks fill the pool and are released after the idle prefill was queued
    others = [eng.add_request(random_tokens(180, seed=32 + i), greedy(1)) for i in range(2)]
    eng.run_to_completion()
    stats = eng.stats()
    assert all(r.finish_reason == "length" for r in others)
    assert idle.finish_reason == "abort" and stats.idle_prefill_tokens == 0
    assert (stats.idle_prefills_dropped, stats.idle_prefills, stats.blocks_used) == (1, 0, 0)
    eng.kv.check_invariants()
