"""Aborting a request in the middle of a chunked prefill: the engine stops it after at most the chunk already
planned (or running), frees its blocks at once, and the prefix cache keeps only what was fully computed, so the
same prompt later gets exactly those tokens cached and the same greedy tokens as with the cache off."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.api import GenerationRequest, TextDelta
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine, StepPlan
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

BS = 16


def tokens_of(plan: StepPlan, request_id: str) -> int:
    """Tokens the step computes for ``request_id``."""
    return sum(s.num_new_tokens for s in plan.sched.scheduled if s.request.request_id == request_id)


def step(eng: LLMEngine) -> StepPlan:
    plan = eng.schedule_step()
    eng.finish_step(plan, eng.run_step(plan))
    return plan


def assert_no_block_held(eng: LLMEngine) -> None:
    s = eng.stats()
    assert s.blocks_used == 0 and s.running == s.waiting == 0
    assert s.blocks_free + s.blocks_cached == s.blocks_total
    eng.kv.check_invariants()


@pytest.mark.parametrize("partial_hits", [True, False])
def test_abort_mid_prefill_stops_after_the_planned_chunk_and_caches_only_computed_blocks(partial_hits):
    eng = make_engine(max_num_batched_tokens=64, enable_partial_prefix_hits=partial_hits)
    total = eng.stats().blocks_total
    other = eng.add_request(random_tokens(40, 2), greedy(12))
    step(eng)  # the other request's prefill: it decodes beside the long prefill from now on
    prompt = random_tokens(300, 3)
    long = eng.add_request(prompt, greedy(4))
    rid = long.request_id
    computed = [tokens_of(step(eng), rid) for _ in range(2)]
    assert computed == [63, 63]  # the budget less the other request's decode token: chunks not block-aligned
    assert long.num_computed_tokens == 126
    prefill_before = eng.stats().prefill_tokens

    plan = eng.schedule_step()  # its third chunk is planned; the abort comes while it runs
    assert tokens_of(plan, rid) == 63
    out = eng.abort_request(rid)
    assert out.finished and out.finish_reason == "abort" and out.usage.completion_tokens == 0
    assert eng.stats().blocks_used == len(eng.kv.block_table(other.request_id))  # freed at once
    eng.finish_step(plan, eng.run_step(plan))  # the forward writes into blocks already freed: results dropped

    later = []
    while eng.has_unfinished():
        later.append(tokens_of(step(eng), rid))
    assert later and set(later) == {0}  # nothing more of the aborted prompt
    assert other.num_output_tokens == 12  # the other request went on to its end
    assert eng.stats().prefill_tokens == prefill_before + 63  # the one chunk running at the abort, no more
    assert_no_block_held(eng)
    assert eng.stats().blocks_total == total

    # the prefix cache holds only the 126 computed tokens: 7 whole blocks, and with partial hits the 14 slots
    # of the eighth (the third chunk's 63 tokens were written but never registered)
    expected = 126 if partial_hits else 126 // BS * BS
    again = eng.add_request(prompt, greedy(4))
    eng.run_to_completion()
    assert again.num_cached_tokens == expected
    reference = make_engine(enable_prefix_caching=False).generate([prompt], greedy(4))[0]
    assert again.output_token_ids == reference
    assert_no_block_held(eng)


class StepGate:
    """Wraps ``core.run_step`` (the forward, run by the step thread without the engine lock): records the
    request ids and tokens of every step, and holds step number ``hold_at`` (1-based) until ``release``."""

    def __init__(self, core: LLMEngine, hold_at: int) -> None:
        self.steps: list[dict[str, int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self._run = core.run_step
        self._hold_at = hold_at
        core.run_step = self.run_step

    def run_step(self, plan: StepPlan):
        if plan.model_input is not None:
            counts: dict[str, int] = {}
            for s in plan.sched.scheduled:
                counts[s.request.request_id] = counts.get(s.request.request_id, 0) + s.num_new_tokens
            self.steps.append(counts)
            if len(self.steps) == self._hold_at:
                self.entered.set()
                self.release.wait(60)
        return self._run(plan)

    def tokens_of(self, prefix: str) -> list[int]:
        """Tokens computed per step for the requests whose id starts with ``prefix`` (0 = not in the step)."""
        return [sum(n for r, n in s.items() if r.startswith(prefix)) for s in self.steps]


async def test_closing_a_stream_during_a_prefill_chunk_frees_blocks_at_once_and_stops_after_that_chunk():
    ckpt = tiny_checkpoint()
    core = make_engine(ckpt, num_blocks=64, max_num_batched_tokens=32)
    gate = StepGate(core, hold_at=2)
    eng = AsyncEngine(core, ckpt.tokenizer)
    await eng.start()
    try:
        prompt = random_tokens(300, 9)  # 10 chunks of 32
        stream = eng.generate(GenerationRequest(prompt_token_ids=prompt, params=greedy(4), request_id="long"))
        first = asyncio.ensure_future(anext(stream))
        assert await asyncio.to_thread(gate.entered.wait, 60)  # the second chunk's forward is running
        first.cancel()  # the consumer goes: the stream's finally aborts the request under the lock
        await asyncio.gather(first, return_exceptions=True)
        s = eng.stats()
        assert s.blocks_used == 0 and s.running == 0 and s.waiting == 0  # before the chunk's forward ends
        gate.release.set()
        # a later request runs once the held step is done; nothing more of the aborted prompt runs
        short = [e async for e in eng.generate(GenerationRequest(prompt_token_ids=prompt, params=greedy(4)))]
        assert gate.tokens_of("long") == [32, 32] + [0] * (len(gate.steps) - 2)
        assert eng.stats().prefill_tokens == 64 + (300 - 32)
        # the first chunk's 2 blocks were registered; the aborted second chunk's were not
        assert short[0].cached_tokens == 32
        reference = make_engine(enable_prefix_caching=False).generate([prompt], greedy(4))[0]
        assert [t for e in short if isinstance(e, TextDelta) for t in e.token_ids] == reference
        s = eng.stats()
        assert s.blocks_used == 0 and s.blocks_free + s.blocks_cached == s.blocks_total
    finally:
        gate.release.set()
        await eng.shutdown()
