"""Token-granular prefix hits in the engine, on the tiny checkpoints: cache on (partial hits on) == partial hits off ==
cache off give the same greedy tokens and logits for prompts diverging at every offset inside a block and at block
boundaries, alone and batched (many requests copying from one source block in one step); exact hit counts in the
request, the usage and the engine's counters; multi-turn prompts hit the previous turn's kept partial block; no block
leaks; partial blocks never reach the KV tiers."""

from __future__ import annotations

import pytest

from engine.api import GenerationRequest
from engine.async_engine import AsyncEngine
from engine.kv_tiers.settings import DiskTierConfig
from engine.partial_hits import common_prefix_len
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint
from tests.engine.test_engine_cache_parity import assert_same

N_NEW = 6
BS = 16


def diverging_prompts(base: list[int]) -> list[list[int]]:
    """Prompts sharing ``base``'s first ``2 * 16 + offset`` tokens, offsets 0..15, then at 3 block boundaries."""
    out = [base[: 2 * BS + off] + random_tokens(9, 500 + off) for off in range(BS)]
    out += [base[: k * BS] + random_tokens(7, 600 + k) for k in (1, 3, 4)]
    return out


def expected_hit(prompt: list[int], base: list[int], partial: bool) -> int:
    """Tokens the cache must serve once ``base`` has run: the common prefix, never the last token; whole blocks
    only without partial hits."""
    n = min(common_prefix_len(prompt, base), len(prompt) - 1)
    return n if partial else n - n % BS


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_every_offset_inside_a_block_matches_partial_off_and_cache_off(kind):
    ckpt = tiny_checkpoint(kind)
    base = random_tokens(77, 1)  # 4 whole blocks and a 13-token tail, kept as a partial entry
    for prompt in diverging_prompts(base):
        got = {}
        for partial in (True, False):
            eng = make_engine(ckpt, record_logits=True, enable_partial_prefix_hits=partial)
            eng.add_request(base, greedy(1))
            eng.run_to_completion()
            req = eng.add_request(prompt, greedy(N_NEW))
            eng.run_to_completion()
            assert req.num_cached_tokens == expected_hit(prompt, base, partial)
            assert eng.stats().prefix_hit_tokens == req.num_cached_tokens
            assert_same(ckpt, eng, req, prompt, N_NEW)  # == cache off, alone
            got[partial] = req.output_token_ids
        assert got[True] == got[False]


def test_batched_requests_copying_one_source_block_equal_alone():
    """All diverging prompts at once, chunked, several per step: most copy slots of base's block 2 in the same
    admission step; each gives what it gives alone with no cache."""
    ckpt = tiny_checkpoint()
    base = random_tokens(77, 1)
    eng = make_engine(ckpt, record_logits=True, max_num_batched_tokens=48, max_batch=8)
    eng.add_request(base, greedy(1))
    eng.run_to_completion()
    prompts = diverging_prompts(base)
    reqs = [eng.add_request(p, greedy(N_NEW)) for p in prompts]
    eng.run_to_completion()
    hits = [r.num_cached_tokens for r in reqs]
    assert hits == [expected_hit(p, base, True) for p in prompts]
    assert eng.stats().prefix_hit_tokens == sum(hits)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert_same(ckpt, eng, req, prompt, N_NEW)
    eng.kv.check_invariants()


def test_the_next_turn_hits_the_previous_turns_kept_partial_block():
    """The W4 shape: the same head, a question differing in its last tokens; each turn recomputes only them."""
    ckpt = tiny_checkpoint()
    head = random_tokens(70, 3)
    eng = make_engine(ckpt, record_logits=True)
    off = make_engine(ckpt, enable_partial_prefix_hits=False)
    prev = None
    for turn in range(4):
        prompt = head + [5 + turn, 9, 10, 11]  # 74 tokens: 4 whole blocks, a 10-token tail
        req = eng.add_request(prompt, greedy(1))
        ref = off.add_request(prompt, greedy(1))
        eng.run_to_completion()
        off.run_to_completion()
        assert req.num_cached_tokens == (0 if prev is None else 70)
        assert ref.num_cached_tokens == (0 if prev is None else 64)
        assert req.output_token_ids == ref.output_token_ids
        prev = prompt
    assert eng.kv.partial_entries == 4  # one per turn: they diverge at token 70
    assert eng.stats().prefill_tokens == 74 + 3 * 4
    assert off.stats().prefill_tokens == 74 + 3 * 10


async def test_usage_and_deltas_report_the_copied_tokens():
    ckpt = tiny_checkpoint()
    eng = AsyncEngine(make_engine(ckpt), ckpt.tokenizer)
    await eng.start()
    try:
        base = random_tokens(50, 4)
        events = [e async for e in eng.generate(GenerationRequest(prompt_token_ids=base, params=greedy(2)))]
        prompt = base[:45] + random_tokens(4, 5)
        events = [e async for e in eng.generate(GenerationRequest(prompt_token_ids=prompt, params=greedy(2)))]
        n = expected_hit(prompt, base, True)
        assert n == 45
        assert events[-1].usage.cached_tokens == n
        assert events[0].cached_tokens == n
        assert eng.stats().prefix_hit_tokens == n
    finally:
        await eng.shutdown()


def test_many_requests_leak_no_block_and_preemption_keeps_results():
    ckpt = tiny_checkpoint()
    eng = make_engine(ckpt, num_blocks=14, max_num_batched_tokens=32, max_batch=6)
    head = random_tokens(40, 6)
    prompts = [head[: 10 + 3 * i] + random_tokens(5 + i % 7, 700 + i) for i in range(24)]
    outs = eng.generate(prompts, greedy(4))
    ref = make_engine(ckpt, enable_prefix_caching=False, num_blocks=64)
    assert outs == [ref.generate([p], greedy(4))[0] for p in prompts]
    stats = eng.stats()
    assert stats.blocks_used == 0 and stats.blocks_cached + stats.blocks_free == 14
    assert stats.prefix_hit_tokens > 0 and stats.evictions > 0
    eng.kv.check_invariants()
    assert eng.kv.reset_prefix_cache()
    assert eng.kv.blocks_free == 14 and eng.kv.partial_entries == 0


def test_partial_blocks_never_reach_the_tiers(tmp_path):
    ckpt = tiny_checkpoint()
    eng = make_engine(
        ckpt,
        num_blocks=12,
        tiers=("disk",),
        tier_disk=DiskTierConfig(str(tmp_path / "disk"), 1 << 26),
        deployment_secret="partial-hit-tests-secret-0123456789",
    )
    shown = []
    listener = eng.kv.pool.on_evict

    def recording(block):
        shown.append((block.partial, block.block_hash, len(block.token_ids)))
        listener(block)

    eng.kv.pool.on_evict = recording
    for i in range(6):
        eng.add_request(random_tokens(40 + i, 800 + i), greedy(1))  # 2 whole blocks and a tail each
        eng.run_to_completion()
    assert eng.kv.evictions > len(shown) > 0  # partial entries were evicted, but not shown to the tiers
    assert all(not partial and h is not None and n == BS for partial, h, n in shown)
    registered = sum(1 for _ in eng.kv.registered_blocks())
    assert eng.kv.partial_entries > 0
    assert eng.flush_tiers(write_cached=True)
    stats = eng.tier_stats()
    assert stats["disk.writes"] == len(shown) + registered
    eng.close()
