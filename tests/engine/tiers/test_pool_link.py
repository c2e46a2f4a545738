"""Write-back from one block pool and load-back into another (a restart): the installed blocks are ordinary
cached entries with exactly the KV that was evicted, chained on the pool's own hits."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers.config import build_tier_stack, entry_nbytes
from engine.kv_tiers.disk import EMPTY_LEVEL_BYTES, TierConfigError
from engine.kv_tiers.entry import BlockMeta, encode_entry
from engine.kv_tiers.keys import keyed_block_hash
from engine.kv_tiers.policy import TierPolicies
from engine.kv_tiers.pool_link import PoolTiers, chain_order
from engine.kv_tiers.settings import DiskTierConfig, RedisTierConfig

HASH = keyed_block_hash(b"p" * 32)
EXTRA = ("tiny-model@abc", "tenant")
NUM_BLOCKS = 16


def pool(layout, stack):
    kv = KVCacheManager(NUM_BLOCKS, layout.block_size, hash_fn=HASH)
    tensor = torch.zeros(
        layout.num_layers, 2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim
    )
    return kv, tensor, PoolTiers(kv, tensor, stack)


def make_stack(layout, tmp_path, redis_prefix, tiers=("disk",)):
    return build_tier_stack(
        tiers,
        layout,
        disk=DiskTierConfig(str(tmp_path / "disk"), 1 << 22),
        redis=RedisTierConfig(prefix=redis_prefix),
        policies=TierPolicies(),
        writeback_capacity=64,
    )


def compute(kv, tensor, rid, prompt):
    """Allocate, "prefill" (random KV), cache and free one request; return its KV per block."""
    hashes = kv.block_hashes(prompt, EXTRA)
    table = kv.allocate(rid, len(prompt))
    for b in table:
        tensor[:, :, b] = torch.randn(tensor[:, :, b].shape)
    kv.cache_full_blocks(rid, prompt, len(prompt), hashes, EXTRA)
    out = [tensor[:, :, b].clone() for b in table[: len(prompt) // kv.block_size]]
    kv.free(rid)
    return hashes, out


def test_evicted_blocks_are_loaded_into_a_new_pool(layout, tmp_path, redis_prefix):
    stack = make_stack(layout, tmp_path, redis_prefix)
    kv, tensor, link = pool(layout, stack)
    prompt = list(range(3, 3 + 5 * layout.block_size + 2))  # 5 full blocks and a tail
    hashes, blocks_kv = compute(kv, tensor, "a", prompt)
    for block in kv.pool.blocks:
        if block.block_hash is not None:
            link.on_evict(block)
    assert stack.flush() and stack.counters.get("disk.writes") == 5

    kv2, tensor2, link2 = pool(layout, stack)  # a restarted engine: empty pool, same tiers
    assert link2.start_prefetch("b", prompt, hashes, EXTRA)
    link2._prefetches["b"].future.result(10)
    assert link2.ready("b", prompt, hashes, EXTRA)
    hits = kv2.find_cached_prefix(prompt, hashes[:5], EXTRA)
    assert len(hits) == 5  # all usable blocks (the last token's block is partial)
    for block_id, expected in zip(hits.block_ids, blocks_kv, strict=True):
        assert torch.equal(tensor2[:, :, block_id], expected)
    assert kv2.blocks_cached == 5 and kv2.blocks_used == 0
    kv2.check_invariants()
    assert not link2.start_prefetch("c", prompt, hashes, EXTRA)  # all in RAM now: no read
    stack.close()


def test_install_chains_on_pool_hits_and_stops_when_the_pool_is_full(layout, tmp_path, redis_prefix):
    stack = make_stack(layout, tmp_path, redis_prefix)
    kv, tensor, link = pool(layout, stack)
    prompt = list(range(3, 3 + 8 * layout.block_size + 1))
    hashes, _ = compute(kv, tensor, "a", prompt)
    for block in kv.pool.blocks:
        if block.block_hash is not None:
            link.on_evict(block)
    stack.flush()
    kv2, tensor2, link2 = pool(layout, stack)
    compute(kv2, tensor2, "x", prompt[: 2 * layout.block_size])  # the pool already has blocks 0-1
    held = kv2.allocate("holder", 10 * layout.block_size)  # 10 of 16 blocks held by a live request
    assert held is not None
    link2.start_prefetch("b", prompt, hashes, EXTRA)
    link2._prefetches["b"].future.result(10)
    assert link2._prefetches["b"].start == 2
    assert link2.ready("b", prompt, hashes, EXTRA)
    assert len(kv2.find_cached_prefix(prompt, hashes[:8], EXTRA)) == 6  # 2 pool hits + 4 free blocks loaded
    kv2.check_invariants()
    stack.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_restart_serves_the_head_of_a_chain_longer_than_its_tier(layout, tmp_path, redis_prefix, tier):
    """Before: the close-time write-down wrote a chain head first and a full level drops its oldest writes
    first, so a tier smaller than the chain kept the chain's tail and lost its head: after a restart the
    lookup stopped at block 0 and served nothing (``cached=0; miss=cold`` with the tier full). Written deepest
    first, the tier keeps the head and the restart serves all the blocks it holds."""
    prompt = list(range(3, 3 + 12 * layout.block_size + 1))  # a 12-block chain and one more token
    hashes = KVCacheManager(NUM_BLOCKS, layout.block_size, hash_fn=HASH).block_hashes(prompt, EXTRA)
    second = BlockMeta(hashes[1], hashes[0], tuple(prompt[4:8]), EXTRA)
    entry = len(encode_entry(layout, second, torch.zeros(layout.block_shape)))  # every block's but the head's
    ticks = itertools.count(1_000_000.0, 0.001)  # a clock that moves on every call: writes are ordered
    stack = build_tier_stack(
        (tier,),
        layout,
        # the history level (blocks without levels) holds 5 entries in Redis, a few in SQLite on disk
        disk=DiskTierConfig(str(tmp_path / "disk"), (EMPTY_LEVEL_BYTES + 4 * 4096) * 4),
        redis=RedisTierConfig(prefix=redis_prefix, budget_bytes=20 * entry + 3),
        policies=TierPolicies(),
        writeback_capacity=64,
        clock=lambda: next(ticks),
    )
    kv, tensor, link = pool(layout, stack)
    hashes, blocks_kv = compute(kv, tensor, "a", prompt)
    assert link.write_all_cached() == 12  # the shutdown write-down
    assert stack.flush()
    held = [stack.tiers[0].peek(stack.layout.tier_key(h))[0] for h in hashes[:12]]
    kept = held.count(True)
    assert held == [True] * kept + [False] * (12 - kept)  # the head, not the tail
    assert 0 < kept < 12
    if tier == "redis":
        assert kept == 5

    kv2, tensor2, link2 = pool(layout, stack)  # the restart: an empty pool, the same tier
    assert link2.start_prefetch("b", prompt, hashes, EXTRA)
    link2._prefetches["b"].future.result(10)
    assert link2.ready("b", prompt, hashes, EXTRA)
    hits = kv2.find_cached_prefix(prompt, hashes[:12], EXTRA)
    assert len(hits) == kept
    for block_id, expected in zip(hits.block_ids, blocks_kv[:kept], strict=True):
        assert torch.equal(tensor2[:, :, block_id], expected)
    stack.close()


def test_chain_order_puts_every_block_after_its_descendants(layout, tmp_path, redis_prefix):
    """Two chains sharing a head, registered in any order: every block comes after the blocks below it."""
    stack = make_stack(layout, tmp_path, redis_prefix)
    kv, tensor, _ = pool(layout, stack)
    base = list(range(3, 3 + 3 * layout.block_size))
    compute(kv, tensor, "a", base + list(range(100, 100 + 2 * layout.block_size + 1)))
    compute(kv, tensor, "b", base + list(range(200, 200 + 4 * layout.block_size + 1)))
    blocks = list(kv.registered_blocks())
    assert len(blocks) == 3 + 2 + 4
    order = chain_order(list(reversed(blocks)))
    position = {b.block_hash: i for i, b in enumerate(order)}
    for b in blocks:
        if b.parent_hash is not None:
            assert position[b.parent_hash] > position[b.block_hash]
    assert order[-1].parent_hash is None
    stack.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_budget_whose_level_cannot_hold_one_block_stops_the_start(layout, tmp_path, redis_prefix, tier):
    """Before: accepted, and every write of that level then failed (counted, nothing kept)."""
    entry = entry_nbytes(layout)
    overhead = EMPTY_LEVEL_BYTES if tier == "disk" else 0
    least = math.ceil((entry + overhead) / 0.25)  # history, the smallest default share

    def build(budget: int):
        return build_tier_stack(
            (tier,),
            layout,
            disk=DiskTierConfig(str(tmp_path / "disk"), budget),
            redis=RedisTierConfig(prefix=redis_prefix, budget_bytes=budget),
            policies=TierPolicies(),
            writeback_capacity=4,
        )

    with pytest.raises(TierConfigError) as e:
        build(least - 1)
    assert e.value.key == f"engine.tier_{tier}.budget_bytes"
    assert f"less than one KV block ({entry} bytes per entry at block_size 4" in e.value.reason
    assert e.value.reason.endswith(f"give at least {least} bytes")
    build(least).close()
