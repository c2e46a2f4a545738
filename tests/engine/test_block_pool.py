"""BlockPool: free queue, LRU of unreferenced cached blocks, eviction order, counters, misuse errors."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, KVBlock


def _register(pool: BlockPool, block: KVBlock, tag: int) -> None:
    assert pool.register(block, bytes([tag]) * 32, (tag,), None, None, ("m",))


def _state(pool: BlockPool) -> tuple:
    return (
        [(b.ref_cnt, b.block_hash, b.cache_gen) for b in pool.blocks],
        list(pool.free_ids()),
        list(pool.evictable_ids()),
        pool.blocks_used,
        pool.evictions,
    )


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(5)
    assert list(pool.free_ids()) == [0, 1, 2, 3, 4]
    assert (pool.blocks_used, pool.blocks_cached, pool.blocks_free, pool.evictions) == (0, 0, 5, 0)
    pool.check_invariants()


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_allocate_takes_free_blocks_first_then_evicts_lru() -> None:
    pool = BlockPool(5)
    a = pool.allocate(3)  # blocks 0, 1, 2
    assert [b.block_id for b in a] == [0, 1, 2]
    for tag, block in enumerate(a):
        _register(pool, block, tag + 1)
    pool.release(reversed(a))  # tail first: 2, 1, 0
    assert list(pool.evictable_ids()) == [2, 1, 0]
    assert (pool.blocks_used, pool.blocks_cached, pool.blocks_free) == (0, 3, 2)

    # Two hash-less free blocks are used before any cached block is evicted.
    b = pool.allocate(2)
    assert [x.block_id for x in b] == [3, 4]
    assert pool.evictions == 0
    # Then the least recently used cached block, the chain tail 2, then its parent 1.
    c = pool.allocate(2)
    assert [x.block_id for x in c] == [2, 1]
    assert pool.evictions == 2
    assert all(x.block_hash is None and x.ref_cnt == 1 for x in c)
    assert pool.get_cached(bytes([3]) * 32) is None and pool.get_cached(bytes([2]) * 32) is None
    assert pool.get_cached(bytes([1]) * 32) is pool.blocks[0]
    pool.check_invariants()


def test_touch_takes_a_cached_block_out_of_the_lru_and_release_puts_it_at_the_tail() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for tag, block in enumerate(blocks):
        _register(pool, block, tag + 1)
    pool.release(reversed(blocks))
    assert list(pool.evictable_ids()) == [2, 1, 0]
    pool.touch([pool.blocks[2]])  # a hit on the LRU block
    assert list(pool.evictable_ids()) == [1, 0]
    assert pool.blocks_used == 1 and pool.blocks[2].ref_cnt == 1
    pool.touch([pool.blocks[2]])  # a second request shares it
    assert pool.blocks[2].ref_cnt == 2 and pool.blocks_used == 1
    pool.release([pool.blocks[2]])
    assert list(pool.evictable_ids()) == [1, 0]  # still referenced once
    pool.release([pool.blocks[2]])
    assert list(pool.evictable_ids()) == [1, 0, 2]  # now most recently used
    assert [b.block_id for b in pool.allocate(1)] == [1]
    pool.check_invariants()


def test_released_hashless_blocks_return_to_the_free_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.release(reversed(blocks))
    assert list(pool.free_ids()) == [2, 3, 1, 0]
    assert pool.blocks_cached == 0 and pool.blocks_free == 4


def test_allocate_more_than_available_changes_nothing() -> None:
    pool = BlockPool(3)
    held = pool.allocate(2)
    _register(pool, held[0], 9)
    pool.release([held[0]])
    before = _state(pool)
    with pytest.raises(ValueError, match="need 3 blocks, only 2 available"):
        pool.allocate(3)
    assert _state(pool) == before


def test_register_rules() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    h = b"h" * 32
    assert pool.register(a, h, (1, 2), None, None, ())
    assert a.cache_gen == 0
    assert not pool.register(b, h, (3, 4), None, None, ())  # hash taken: keep the existing entry
    assert b.block_hash is None and pool.get_cached(h) is a
    with pytest.raises(ValueError, match="already registered"):
        pool.register(a, b"x" * 32, (1, 2), None, None, ())
    with pytest.raises(ValueError, match="not referenced"):
        pool.register(pool.blocks[2], b"y" * 32, (5, 6), None, None, ())
    pool.check_invariants()


def test_misuse_of_references_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free, not cached"):
        pool.touch([pool.blocks[0]])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([pool.blocks[1]])
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.allocate(-1)
    pool.check_invariants()


def test_drop_unreferenced_cached_keeps_referenced_entries() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    _register(pool, a, 1)
    _register(pool, b, 2)
    pool.release([b])
    assert pool.drop_unreferenced_cached() == 1
    assert pool.num_cached_entries() == 1 and pool.get_cached(bytes([1]) * 32) is a
    assert (pool.blocks_used, pool.blocks_cached, pool.blocks_free) == (1, 0, 2)
    pool.check_invariants()


def test_evicts_released_after_looks_past_the_free_blocks_at_the_lru_entries_it_would_take() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for tag, block in enumerate(blocks):
        _register(pool, block, tag)
    pool.release([blocks[0]])
    seq = pool.release_seq
    pool.release([blocks[1], blocks[2]])  # released after ``seq``
    assert [b.released_at for b in blocks] == [1, 2, 3]
    assert not pool.evicts_released_after(1, seq, keep=set())  # the free block
    assert not pool.evicts_released_after(
        2, seq, keep=set()
    )  # the free block, then blocks[0] (released before)
    assert pool.evicts_released_after(3, seq, keep=set())  # blocks[1] too
    assert pool.evicts_released_after(2, seq, keep={blocks[0].block_id})  # blocks[0] kept: blocks[1] is next
    assert not pool.evicts_released_after(3, pool.release_seq, keep=set())
