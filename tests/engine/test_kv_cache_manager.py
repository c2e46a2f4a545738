"""KVCacheManager + block hashing: exact accounting, eviction order, collisions, tenant isolation, errors."""

from __future__ import annotations

import ast
import hashlib
import inspect
import subprocess
import sys
from collections.abc import Sequence

import pytest

import engine.scheduler
from engine.block_hash import BlockHash, hash_block, hash_request_blocks
from engine.errors import PromptTooLongError
from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hit import NO_HIT, PrefixHit, StaleCacheHitError

EXTRA = ("tiny-model", "")


def toks(seed: int, n: int) -> list[int]:
    """n deterministic token ids that differ between seeds."""
    return [(seed * 1009 + i * 31) % 50000 for i in range(n)]


def submit(m: KVCacheManager, rid: str, prompt: list[int], extra: tuple = EXTRA) -> tuple[list[int], int]:
    """Look up, allocate the prompt, 'compute' it and register its full blocks; returns (table, hit blocks)."""
    hashes = m.block_hashes(prompt, extra)
    hits = m.find_cached_prefix(prompt, hashes[: (len(prompt) - 1) // m.block_size], extra)
    table = m.allocate(rid, len(prompt), hits)
    assert table is not None
    m.cache_full_blocks(rid, prompt, len(prompt), hashes, extra)
    return table, len(hits)


def snapshot(m: KVCacheManager) -> tuple:
    pool = m.pool
    return (
        [(b.ref_cnt, b.block_hash, b.cache_gen) for b in pool.blocks],
        list(pool.free_ids()),
        list(pool.evictable_ids()),
        m.usage(),
        {rid: m.block_table(rid) for rid in list(m._requests)},
    )


# ---- hashing ----------------------------------------------------------------------------------------------


def test_hash_chains_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block(None, [1, 2, 3, 4], EXTRA)
    assert len(base) == 32
    assert base == hash_block(None, (1, 2, 3, 4), EXTRA)  # list or tuple, same bytes
    assert base != hash_block(None, [1, 2, 3, 5], EXTRA)
    assert base != hash_block(b"\x00" * 32, [1, 2, 3, 4], EXTRA)
    assert base != hash_block(None, [1, 2, 3, 4], ("tiny-model", "tenant-b"))
    assert hash_block(None, [1], (1,)) != hash_block(None, [1], ("1",))  # typed encoding
    assert hash_block(None, [1], ("a", "bc")) != hash_block(None, [1], ("ab", "c"))  # length-prefixed


def test_hash_is_seeded_per_process() -> None:
    code = "from engine.block_hash import hash_block; print(hash_block(None, [1, 2, 3], ('m', '')).hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(outs) == 2
    assert hash_block(None, [1, 2, 3], ("m", "")).hex() + "\n" not in outs


def test_hash_rejects_bad_extra_keys_and_token_ids() -> None:
    with pytest.raises(TypeError, match="extra key of type dict"):
        hash_block(None, [1], ({"a": 1},))
    with pytest.raises(TypeError):
        hash_block(None, ["x"], EXTRA)  # type: ignore[list-item]


def test_hash_request_blocks_covers_full_blocks_only() -> None:
    ids = toks(1, 37)
    hashes = hash_request_blocks(ids, 16, EXTRA)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, ids[:16], EXTRA)
    assert hashes[1] == hash_block(hashes[0], ids[16:32], EXTRA)
    assert hash_request_blocks(ids[:15], 16, EXTRA) == []
    with pytest.raises(ValueError, match="block_size"):
        hash_request_blocks(ids, 0, EXTRA)


# ---- exact accounting -------------------------------------------------------------------------------------


def test_requests_sharing_a_prefix_hold_its_full_blocks_once() -> None:
    n, bs = 5, 16
    m = KVCacheManager(num_blocks=64, block_size=bs)
    prefix = toks(7, 40)  # 2 full blocks + 8 tokens
    tables = []
    hit_blocks = []
    for r in range(n):
        table, hits = submit(m, f"r{r}", prefix + toks(100 + r, 10))  # 50 tokens = 4 blocks each
        tables.append(table)
        hit_blocks.append(hits)
    assert hit_blocks == [0, 2, 2, 2, 2]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert all(m.pool.blocks[b].ref_cnt == n for b in shared)
    # 2 shared + 2 private per request.
    assert m.blocks_used == 2 + n * 2
    assert len({b for t in tables for b in t}) == 2 + n * 2
    m.check_invariants()
    for r in range(n):
        m.free(f"r{r}")
    assert m.blocks_used == 0
    assert m.blocks_free + m.blocks_cached == m.blocks_total == 64
    # Cached: the 2 prefix blocks + each request's third block (8 prefix + 8 own tokens, full, computed).
    assert m.blocks_cached == 2 + n
    assert m.evictions == 0
    m.check_invariants()


def test_a_wholly_cached_prompt_leaves_its_last_block_to_compute() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = toks(3, 8)  # exactly 2 blocks
    submit(m, "a", prompt)
    m.free("a")
    table, hits = submit(m, "b", prompt)
    assert hits == 1  # capped at (8 - 1) // 4 blocks: the last token is computed again
    assert m.find_cached_prefix(prompt, m.block_hashes(prompt, EXTRA), EXTRA).block_ids[1] == 1
    assert table[0] == 0 and table[1] != 1


def test_cache_off_shares_nothing_and_caches_nothing() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    prompt = toks(3, 9)
    submit(m, "a", prompt)
    table, hits = submit(m, "b", prompt)
    assert hits == 0 and m.blocks_used == 6
    with pytest.raises(ValueError, match="disabled"):
        m.allocate("c", 4, PrefixHit((m.pool.blocks[0],), 4))
    m.free("a")
    m.free("b")
    assert (m.blocks_used, m.blocks_cached, m.blocks_free) == (0, 0, 8)


# ---- eviction order ---------------------------------------------------------------------------------------


def test_lru_eviction_takes_chain_tails_before_parents_and_free_blocks_first() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4)
    a = toks(1, 12)
    assert submit(m, "a", a)[0] == [0, 1, 2]
    m.free("a")
    assert list(m.pool.evictable_ids()) == [2, 1, 0]  # tail first
    assert submit(m, "b", toks(2, 8))[0] == [3, 4]  # hash-less free blocks first, no eviction
    assert m.evictions == 0
    m.free("b")
    assert list(m.pool.evictable_ids()) == [2, 1, 0, 4, 3]
    assert submit(m, "c", toks(3, 12))[0] == [5, 2, 1]  # the last free block, then LRU: a's tail, parent
    assert m.evictions == 2
    hits = m.find_cached_prefix(a, m.block_hashes(a, EXTRA), EXTRA)
    assert hits.block_ids == [0]  # a's first block survives
    m.check_invariants()


def test_a_hit_makes_blocks_most_recently_used() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4)
    a, b = toks(1, 9), toks(2, 9)
    submit(m, "a", a)  # blocks 0, 1 cached, 2 private
    submit(m, "b", b)  # blocks 3, 4 cached, 5 private
    m.free("a")
    m.free("b")
    assert list(m.pool.evictable_ids()) == [1, 0, 4, 3]
    assert list(m.pool.free_ids()) == [2, 5]
    submit(m, "a2", a)  # hits 0, 1 (they leave the LRU), takes free block 2
    m.free("a2")
    assert list(m.pool.evictable_ids()) == [4, 3, 1, 0]
    assert submit(m, "c", toks(3, 12))[0] == [5, 2, 4]  # b's chain goes before a's
    m.check_invariants()


# ---- collisions -------------------------------------------------------------------------------------------


def constant_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple) -> BlockHash:
    """Every block collides with every other."""
    return b"\x42" * 32


def test_constant_hash_never_serves_another_prompts_blocks() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4, hash_fn=constant_hash)
    a, b = toks(1, 12), toks(2, 12)
    table_a, _ = submit(m, "a", a)
    assert m.pool.num_cached_entries() == 1  # block 0 only; block 1 collides with it and stays private
    hits_b = m.find_cached_prefix(b, m.block_hashes(b, EXTRA), EXTRA)
    assert hits_b.block_ids == []
    table_b, _ = submit(m, "b", b)
    assert not set(table_a) & set(table_b)
    # The same prompt still hits what was safely cached.
    hits_a = m.find_cached_prefix(a, m.block_hashes(a, EXTRA), EXTRA)
    assert hits_a.block_ids == [table_a[0]]
    # A prompt equal in its first block but not its second stops after the first block.
    c = a[:4] + toks(3, 8)
    assert m.find_cached_prefix(c, m.block_hashes(c, EXTRA), EXTRA).block_ids == [table_a[0]]
    m.free("a")
    m.free("b")
    assert m.blocks_used == 0 and m.blocks_cached + m.blocks_free == 16
    m.check_invariants()


def make_colliding_hash(x: Sequence[int], y: Sequence[int]):
    """sha256 chaining, except that first blocks x and y share one hash."""
    collide = {tuple(x), tuple(y)}

    def weak(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple) -> BlockHash:
        if parent is None and tuple(token_ids) in collide:
            return b"\x13" * 32
        return hash_block(parent, token_ids, extra_keys)

    return weak


def test_child_of_an_evicted_colliding_parent_is_never_served() -> None:
    """A0 and B0 collide. A1 was computed after A0; after A0 is replaced by B0, [B0, A1] must not hit A1."""
    a0, a1, b0 = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    m = KVCacheManager(num_blocks=4, block_size=4, hash_fn=make_colliding_hash(a0, b0))
    ha = m.block_hashes(a0 + a1, EXTRA)
    # Two requests compute the same [A0, A1] at once (no hits yet).
    assert m.allocate("r1", 8) == [0, 1]
    assert m.allocate("r2", 8) == [2, 3]
    m.cache_full_blocks("r1", a0 + a1, 4, ha, EXTRA)  # r1 registered A0 only so far (chunked)
    m.cache_full_blocks("r2", a0 + a1, 8, ha, EXTRA)  # A0 is a duplicate; A1 chains onto r1's A0 entry
    assert m.pool.get_cached(ha[0]).block_id == 0 and m.pool.get_cached(ha[1]).block_id == 3
    # Equal content and chain: a third prompt hits r1's A0 and r2's A1.
    assert m.find_cached_prefix(a0 + a1 + [9], ha, EXTRA).block_ids == [0, 3]
    m.free("r1")  # A0's entry (block 0) becomes evictable; r2 still holds the A1 entry (block 3)
    assert m.allocate("r3", 8) == [1, 0]  # evicts A0's entry
    hb = m.block_hashes(b0 + a1, EXTRA)
    assert hb[0] == ha[0] and hb[1] == ha[1]  # the collision carries into the chain
    m.cache_full_blocks("r3", b0 + [5, 5, 5, 5], 8, hb[:1], EXTRA)  # B0 now holds the colliding hash
    hits = m.find_cached_prefix(b0 + a1 + [9], hb, EXTRA)
    assert hits.block_ids == [1]  # B0 only: A1's KV was computed after A0, not B0
    assert m.find_cached_prefix(a0 + a1 + [9], ha, EXTRA).block_ids == []  # A0's tokens differ from B0's
    m.check_invariants()


def test_duplicate_computation_keeps_the_first_entry_and_the_second_copy_private() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    p = toks(5, 8)
    h = m.block_hashes(p, EXTRA)
    t1 = m.allocate("r1", 9)
    t2 = m.allocate("r2", 9)
    m.cache_full_blocks("r1", p + [0], 9, h, EXTRA)
    m.cache_full_blocks("r2", p + [0], 9, h, EXTRA)
    m.cache_full_blocks("r2", p + [0], 9, h, EXTRA)  # idempotent
    assert m.find_cached_prefix(p + [0], h, EXTRA).block_ids == t1[:2]
    m.free("r2")
    assert sorted(m.pool.free_ids()) == sorted([t2[0], t2[1], t2[2], 6, 7])  # r2's copies were private
    m.free("r1")
    assert m.blocks_cached == 2
    m.check_invariants()


# ---- tenants ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weak", [False, True])
def test_cache_salt_and_model_id_isolate_tenants(weak: bool) -> None:
    def ignores_extra_keys(
        parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple
    ) -> BlockHash:
        return hashlib.sha256((parent or b"") + bytes(str(list(token_ids)), "ascii")).digest()

    m = KVCacheManager(num_blocks=16, block_size=4, hash_fn=ignores_extra_keys if weak else hash_block)
    p = toks(9, 13)
    submit(m, "a", p, ("tiny-model", "tenant-a"))
    for extra in [("tiny-model", "tenant-b"), ("other-model", "tenant-a")]:
        assert m.find_cached_prefix(p, m.block_hashes(p, extra), extra).block_ids == []
    extra = ("tiny-model", "tenant-a")
    assert len(m.find_cached_prefix(p, m.block_hashes(p, extra), extra)) == 3


# ---- in-flight sharing and generated tokens ---------------------------------------------------------------


def test_blocks_registered_after_a_chunk_are_hit_at_the_next_step() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    p = toks(4, 20)
    h = m.block_hashes(p, EXTRA)
    assert m.allocate("a", 8) == [0, 1]  # first prefill chunk: 8 tokens
    m.cache_full_blocks("a", p, 8, h, EXTRA)
    hits = m.find_cached_prefix(p, h, EXTRA)
    assert hits.block_ids == [0, 1]
    assert m.allocate("b", 20, hits) == [0, 1, 2, 3, 4]
    assert m.append_slots("a", 20)
    assert m.block_table("a") == [0, 1, 5, 6, 7]
    m.cache_full_blocks("a", p, 20, h, EXTRA)
    assert m.num_cached_blocks("a") == 5


def test_generated_tokens_are_hashed_and_cached_without_caller_hashes() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    prompt, output = toks(1, 6), toks(2, 7)
    h = m.block_hashes(prompt, EXTRA)
    m.allocate("a", 6)
    m.cache_full_blocks("a", prompt, 6, h, EXTRA)
    seq = list(prompt)
    for tok in output:
        seq.append(tok)
        assert m.append_slots("a", len(seq))
        m.cache_full_blocks("a", seq, len(seq) - 1, h, EXTRA)  # the newest token's KV is written next step
    nxt = seq + [99]
    hits = m.find_cached_prefix(nxt, m.block_hashes(nxt, EXTRA), EXTRA)
    assert hits.block_ids == m.block_table("a")[:3]  # (13 - 1) // 4 full, computed blocks


# ---- errors and no-change guarantees ----------------------------------------------------------------------


def test_failed_allocate_and_append_change_nothing() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    submit(m, "a", toks(1, 9))
    before = snapshot(m)
    assert not m.can_allocate(8)
    assert m.allocate("b", 8) is None
    assert not m.append_slots("a", 17)
    assert snapshot(m) == before
    assert "b" not in m
    m.check_invariants()


def test_too_long_for_the_pool_raises_before_any_change() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    submit(m, "a", toks(1, 5))
    before = snapshot(m)
    m.check_fits(16)
    for call in (lambda: m.check_fits(17), lambda: m.allocate("b", 17), lambda: m.can_allocate(17)):
        with pytest.raises(PromptTooLongError) as err:
            call()
        assert (err.value.what, err.value.prompt_tokens, err.value.limit) == ("pool", 17, 16)
    assert not m.append_slots("a", 17)
    assert snapshot(m) == before


def test_stale_hits_are_refused_before_any_change() -> None:
    m = KVCacheManager(num_blocks=3, block_size=4)
    p = toks(1, 9)
    submit(m, "a", p)
    m.free("a")
    hits = m.find_cached_prefix(p, m.block_hashes(p, EXTRA), EXTRA)
    assert len(hits) == 2
    assert m.allocate("b", 12) is not None  # evicts both cached blocks
    assert m.evictions == 2
    m.free("b")
    before = snapshot(m)
    with pytest.raises(StaleCacheHitError):
        m.allocate("c", 9, hits)
    with pytest.raises(StaleCacheHitError):
        m.can_allocate(9, hits)
    assert snapshot(m) == before


def test_request_id_errors() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.allocate("a", 1)
    with pytest.raises(ValueError, match="already holds blocks"):
        m.allocate("a", 1)
    with pytest.raises(ValueError, match=">= 0"):
        m.allocate("b", -1)
    with pytest.raises(KeyError, match="holds no blocks"):
        m.block_table("zz")
    with pytest.raises(KeyError):
        m.append_slots("zz", 4)
    with pytest.raises(KeyError):
        m.cache_full_blocks("zz", [1], 1, [], EXTRA)
    m.free("zz")  # no-op
    m.free("a")
    m.free("a")  # no-op
    assert m.blocks_used == 0
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_reset_prefix_cache_drops_unreferenced_entries() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    p, q = toks(1, 9), toks(2, 9)
    submit(m, "a", p)
    submit(m, "b", q)
    m.free("a")
    assert m.blocks_cached == 2
    assert m.reset_prefix_cache() is False  # b's entries are still referenced
    assert m.find_cached_prefix(p, m.block_hashes(p, EXTRA), EXTRA).block_ids == []
    assert len(m.find_cached_prefix(q, m.block_hashes(q, EXTRA), EXTRA)) == 2
    m.free("b")
    assert m.reset_prefix_cache() is True
    assert (m.blocks_used, m.blocks_cached, m.blocks_free) == (0, 0, 8)
    m.check_invariants()


def test_blocks_after_a_colliding_block_stay_private() -> None:
    """Y0 collides with the cached X0, so Y1 (computed after Y0) must not be registered under Y0's chain."""
    x0, y0, y1 = [1, 1, 1, 1], [3, 3, 3, 3], [4, 4, 4, 4]
    m = KVCacheManager(num_blocks=8, block_size=4, hash_fn=make_colliding_hash(x0, y0))
    submit(m, "x", x0 + [7])
    assert m.pool.num_cached_entries() == 1
    table_y, hits = submit(m, "y", y0 + y1 + [7])
    assert hits == 0
    assert m.pool.num_cached_entries() == 1  # neither Y0 (collision) nor Y1 (unproven chain)
    assert all(m.pool.blocks[b].block_hash is None for b in table_y)
    m.free("y")
    assert set(table_y) <= set(m.pool.free_ids())
    m.check_invariants()


def test_an_equal_block_under_a_different_parent_entry_does_not_extend_the_chain() -> None:
    """[B0, A1, Z]: A1's entry was computed after A0 (evicted); B0 collides with A0. Z must stay private."""
    a0, a1, b0, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [6, 6, 6, 6]
    m = KVCacheManager(num_blocks=6, block_size=4, hash_fn=make_colliding_hash(a0, b0))
    ha = m.block_hashes(a0 + a1, EXTRA)
    assert m.allocate("r1", 8) == [0, 1]
    assert m.allocate("r2", 8) == [2, 3]
    m.cache_full_blocks("r1", a0 + a1, 4, ha, EXTRA)
    m.cache_full_blocks("r2", a0 + a1, 8, ha, EXTRA)  # A1 entry = block 3, parent entry = block 0
    m.free("r1")
    r3 = b0 + [5] * 12
    assert submit(m, "r3", r3)[0] == [4, 5, 1, 0]  # evicts A0's entry; block 4 now holds B0 (same hash)
    m.free("r3")
    r4 = b0 + a1 + z + [9]
    table, hits = submit(m, "r4", r4)
    assert hits == 1 and table[0] == 4
    assert m.pool.blocks[table[1]].block_hash is None  # equal to A1's entry, but under another parent
    assert m.pool.blocks[table[2]].block_hash is None  # so Z's chain is unproven
    assert m.find_cached_prefix(r4, m.block_hashes(r4, EXTRA), EXTRA).block_ids == [4]
    m.check_invariants()


def test_prefix_hit_exposes_ids_hashes_and_counts_and_no_hit_when_caching_is_off() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    p = toks(1, 13)
    table, _ = submit(m, "a", p)
    hashes = m.block_hashes(p, EXTRA)
    hit = m.find_cached_prefix(p, hashes, EXTRA)
    assert (hit.num_blocks, hit.num_tokens, len(hit)) == (3, 12, 3)
    assert hit.block_ids == table[:3] and hit.last_block_id == table[2]
    assert hit.block_hashes == hashes[:3]
    assert (NO_HIT.num_blocks, NO_HIT.num_tokens, NO_HIT.block_ids, NO_HIT.last_block_id) == (0, 0, [], None)
    off = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    submit(off, "a", p)
    assert off.find_cached_prefix(p, off.block_hashes(p, EXTRA), EXTRA) is NO_HIT


def test_the_scheduler_imports_nothing_of_the_block_pool() -> None:
    tree = ast.parse(inspect.getsource(engine.scheduler))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "engine.kv_cache_manager" in imported and "engine.block_pool" not in imported
    assert "KVBlock" not in inspect.getsource(engine.scheduler)
