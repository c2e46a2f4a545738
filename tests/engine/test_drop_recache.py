"""After ``drop_cached`` (``DELETE /admin/cache?prefix_key=``), every prompt under the dropped prefix is cached
again by its next run, and no entry is left behind that no lookup can reach.

Before: dropping a prefix's blocks left the entries chained on them (other conversations under the same system
prompt) in the pool. Once the prefix was computed again it was a new parent entry, so those children were stale:
no lookup served them (``engine.prefix_chain``, invariant 3), and since they still held their hashes, the same
blocks computed again could not be registered. Such a conversation stayed at the prefix's hit for good."""

from __future__ import annotations

from engine.block_pool import BlockPool
from tests.engine.engine_helpers import greedy, make_engine, random_tokens

SYSTEM = random_tokens(40, 1)  # two full blocks and a half (blocks of 16)
A = SYSTEM + random_tokens(60, 2)
B = SYSTEM + random_tokens(60, 3)


def run(eng, prompt: list[int], **kw) -> int:
    """Cached tokens of one greedy two-token run of ``prompt``."""
    req = eng.add_request(prompt, greedy(2), **kw)
    eng.run_to_completion()
    return req.num_cached_tokens


def test_every_conversation_under_a_dropped_prefix_is_cached_again_by_its_next_run():
    eng = make_engine(enable_partial_prefix_hits=False)
    for prompt in (A, A, B):
        run(eng, prompt, prefix_key="sys")
    assert run(eng, A, prefix_key="sys") == 96 and run(eng, B, prefix_key="sys") == 96
    assert len(eng.list_cached(prefix_key="sys")) == 1
    dropped = eng.drop_cached(prefix_key="sys")
    # the listed chain (B's blocks, the newest record) and everything chained on it: A's blocks after the
    # shared system blocks too, which no lookup could reach once those are gone
    assert dropped == {"prefixes": 1, "ram": 10}, dropped  # B's 6 blocks, then A's 4 after the system's 2
    assert eng.kv.pool.num_cached_entries() == 0
    eng.kv.check_invariants()
    assert run(eng, A) == 0
    assert run(eng, A) == 96  # was 32 for good: A's own blocks could not be registered again
    assert run(eng, B) == 32
    assert run(eng, B) == 96
    eng.kv.check_invariants()


def test_a_stale_entry_gives_way_to_the_same_block_computed_on_a_live_parent():
    """The pool-level rule, for any way a child outlives its parent entry: registering a block whose hash an
    unreferenced entry holds, chained on a parent entry that is gone, replaces that entry (it becomes free)."""
    pool = BlockPool(4)
    keys = ("m",)
    parent, child = pool.allocate(2)
    assert pool.register(parent, b"p" * 32, (1,), None, None, keys)
    assert pool.register(child, b"c" * 32, (2,), b"p" * 32, parent.cache_gen, keys)
    pool.release([child, parent])
    pool.drop_unreferenced_cached(lambda b: b is parent)
    # the child was chained on the dropped parent: it went with it
    assert pool.get_cached(b"c" * 32) is None and pool.blocks_free == 4
    pool.check_invariants()

    # a child left stale while a request held it (a drop only takes unreferenced blocks)
    parent, child = pool.allocate(2)
    assert pool.register(parent, b"p" * 32, (1,), None, None, keys)
    assert pool.register(child, b"c" * 32, (2,), b"p" * 32, parent.cache_gen, keys)
    pool.release([parent])
    pool.drop_unreferenced_cached(lambda b: b is parent)
    pool.release([child])
    assert pool.get_cached(b"c" * 32) is child  # stale: its parent entry is gone
    new_parent, new_child = pool.allocate(2)  # the free blocks: the stale child stays cached
    assert child.block_id not in (new_parent.block_id, new_child.block_id)
    assert pool.register(new_parent, b"p" * 32, (1,), None, None, keys)
    assert pool.register(new_child, b"c" * 32, (2,), b"p" * 32, new_parent.cache_gen, keys)
    assert pool.get_cached(b"c" * 32) is new_child and child.block_hash is None
    assert child.block_id in set(pool.free_ids())
    pool.check_invariants()


def test_a_live_entry_is_never_replaced():
    """A block computed on a stale chain (or a collision) does not push out the entry the live chain serves."""
    pool = BlockPool(4)
    keys = ("m",)
    parent, child, other = pool.allocate(3)
    assert pool.register(parent, b"p" * 32, (1,), None, None, keys)
    assert pool.register(child, b"c" * 32, (2,), b"p" * 32, parent.cache_gen, keys)
    pool.release([child])
    assert not pool.register(other, b"c" * 32, (2,), b"p" * 32, 12345, keys)  # a dead parent gen
    assert pool.get_cached(b"c" * 32) is child and other.block_hash is None
    pool.check_invariants()


def test_a_prefix_cached_nowhere_is_not_listed_until_cached_again():
    """A trial: a prefix evicted from RAM (or expired from every tier) was still listed by ``/admin/cache``, with
    its full token count, and the dashboard showed it as cached now."""
    eng = make_engine(
        num_blocks=8, enable_partial_prefix_hits=False
    )  # 128 tokens: a new prompt evicts SYSTEM
    eng.warm(SYSTEM, prefix_key="sys")
    assert [(p.prefix_key, p.tokens, p.tiers["ram"]) for p in eng.list_cached()] == [("sys", 32, 32)]
    run(eng, random_tokens(120, 9))  # takes every block: SYSTEM's are evicted
    assert eng.kv.count_cached_leading(eng.catalog.get("sys").block_hashes) == 0
    assert eng.list_cached() == []
    run(eng, SYSTEM + random_tokens(8, 10))  # a request caches its blocks again: listed again
    assert [(p.prefix_key, p.tiers["ram"]) for p in eng.list_cached()] == [("sys", 32)]
    eng.kv.check_invariants()
