"""Write-back from one block pool and load-back into another (a restart): the installed blocks are ordinary
cached entries with exactly the KV that was evicted, chained on the pool's own hits."""

from __future__ import annotations

import torch

from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers.config import build_tier_stack
from engine.kv_tiers.keys import keyed_block_hash
from engine.kv_tiers.policy import TierPolicies
from engine.kv_tiers.pool_link import PoolTiers
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
