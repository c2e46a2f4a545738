"""Token-granular prefix hits (``KVCacheManager`` invariants 8-9): exact hit lengths for a prompt diverging at every
offset inside a block, the copy-on-write of the shared slots (source held during the copy, never written), partial
entries kept at free, evicted under pressure, never shown to the tiers, tenant isolation, no leaked block.

The manager tests stand a small tensor in for the KV pool: "computing" a token writes its id and position into its
slot, so a block table's slots can be checked against the tokens it must hold, copied slots included."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hit import StaleCacheHitError

EXTRA = ("tiny-model", "")
BS = 16


class FakeKV:
    """A ``[num_blocks, block_size, 2]`` int64 stand-in for the KV pool: slot = (token id, position)."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.kv = torch.full((m.blocks_total, m.block_size, 2), -1, dtype=torch.int64)
        self.copies: list[tuple[int, int, int]] = []
        m.set_slot_copier(self.copy)

    def copy(self, src: int, dst: int, n: int) -> None:
        block = self.m.pool.blocks[src]
        assert block.ref_cnt >= 1, "the source of a copy must be held"
        assert src not in set(self.m.pool.evictable_ids())
        self.copies.append((src, dst, n))
        self.kv[dst, :n] = self.kv[src, :n]

    def compute(self, table: Sequence[int], tokens: Sequence[int], start: int, end: int) -> None:
        for p in range(start, end):
            self.kv[table[p // BS], p % BS] = torch.tensor([tokens[p], p])

    def check(self, table: Sequence[int], tokens: Sequence[int], n: int) -> None:
        """The table's first ``n`` slots hold exactly ``tokens[:n]`` at their positions."""
        for p in range(n):
            assert self.kv[table[p // BS], p % BS].tolist() == [tokens[p], p], p


def run(m: KVCacheManager, fkv: FakeKV, rid: str, prompt: list[int], extra: tuple = EXTRA, free: bool = True):
    """Look up (partial), allocate, check the served slots, 'compute' the rest, register; free unless told.
    Returns the hit."""
    hashes = m.block_hashes(prompt, extra)
    hit = m.find_cached_prefix(prompt, hashes[: (len(prompt) - 1) // BS], extra, partial=True)
    table = m.allocate(rid, len(prompt), hit)
    assert table is not None
    fkv.check(table, prompt, hit.num_tokens)
    fkv.compute(table, prompt, hit.num_tokens, len(prompt))
    m.cache_full_blocks(rid, prompt, len(prompt), hashes, extra)
    if free:
        m.free(rid, prompt, len(prompt), extra)
    m.check_invariants()
    return hit


def cached_ids(m: KVCacheManager, prompt: list[int], extra: tuple = EXTRA) -> list[int]:
    """Block ids of the cached whole blocks of ``prompt``."""
    return m.find_cached_prefix(prompt, m.block_hashes(prompt, extra), extra).block_ids


def manager(num_blocks: int = 64, **kw) -> tuple[KVCacheManager, FakeKV]:
    m = KVCacheManager(num_blocks, BS, **kw)
    return m, FakeKV(m)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 50000) for _ in range(n)]


@pytest.mark.parametrize("offset", range(BS))
def test_a_prompt_diverging_inside_a_cached_full_block_gets_every_shared_token(offset: int) -> None:
    m, fkv = manager()
    base = toks(1, 80)  # 5 full blocks, all cached after the first run
    run(m, fkv, "base", base)
    prompt = base[: 2 * BS + offset] + toks(2, 20)
    hit = run(m, fkv, "p", prompt)
    assert (hit.num_blocks, hit.partial_tokens, hit.num_tokens) == (2, offset, 2 * BS + offset)
    assert hit.partial_block_id == (cached_ids(m, base)[2] if offset else None)
    assert fkv.copies == ([(hit.partial_block_id, fkv.copies[-1][1], offset)] if offset else [])
    fkv.check(cached_ids(m, base), base, 80)  # the source was never written


@pytest.mark.parametrize("offset", range(1, BS))
def test_a_kept_partial_block_serves_the_next_turn(offset: int) -> None:
    """The previous turn's last block holds 12 computed tokens; the next turn diverges at ``offset`` in it."""
    m, fkv = manager()
    first = toks(3, 3 * BS + 12)
    run(m, fkv, "t0", first)
    assert m.partial_entries == 1
    nxt = first[: 3 * BS + offset] + toks(4, 5)
    hit = run(m, fkv, "t1", nxt)
    assert (hit.num_blocks, hit.partial_tokens) == (3, min(offset, 12))
    assert m.pool.blocks[hit.partial_block_id].partial


def test_at_a_block_boundary_no_partial_part() -> None:
    m, fkv = manager()
    base = toks(5, 64)
    run(m, fkv, "a", base)
    hit = run(m, fkv, "b", base[:32] + toks(6, 10))
    assert (hit.num_blocks, hit.partial_tokens, hit.num_tokens) == (2, 0, 32)
    assert fkv.copies == []


@pytest.mark.parametrize("n", [17, 31, 32, 33, 48, 50])
def test_a_wholly_cached_prompt_computes_only_its_last_token(n: int) -> None:
    m, fkv = manager()
    prompt = toks(7, n)
    run(m, fkv, "a", prompt)
    hit = run(m, fkv, "b", prompt)
    assert hit.num_tokens == n - 1
    assert hit.num_blocks == (n - 1) // BS
    assert hit.partial_tokens == (n - 1) % BS
    if hit.partial_tokens:
        with pytest.raises(ValueError, match="leave a token"):
            m.allocate("c", n - 1, hit)  # a partial hit must leave a token to compute


def test_partial_hits_off_or_without_a_copier_stop_at_the_last_whole_block() -> None:
    for m, fkv in (manager(enable_partial_hits=False), manager(enable_caching=False)):
        base = toks(8, 40)
        run(m, fkv, "a", base)
        hit = run(m, fkv, "b", base[:20] + toks(9, 5))
        assert hit.partial_tokens == 0 and fkv.copies == [] and m.partial_entries == 0
    m = KVCacheManager(64, BS)  # no slot copier: no partial hits
    assert not m.partial_hits_active


def test_a_duplicate_partial_is_not_kept_and_a_longer_one_replaces_a_shorter() -> None:
    m, fkv = manager()
    head = toks(10, 32)
    run(m, fkv, "a", head + [11, 12, 13])
    run(m, fkv, "b", head + [11, 12, 13])  # same tokens: the kept entry serves them all
    assert m.partial_entries == 1
    run(m, fkv, "c", head + [11, 12, 13, 14, 15])  # longer: replaces the shorter one
    assert m.partial_entries == 1
    hit = run(m, fkv, "d", head + [11, 12, 13, 14, 15, 99])
    assert hit.num_tokens == 32 + 5
    run(m, fkv, "e", head + [11, 12, 77])  # a sibling that diverges: both kept
    assert m.partial_entries == 2


def test_tenants_never_share_a_partial_block() -> None:
    m, fkv = manager()
    prompt = toks(12, 40)
    run(m, fkv, "a", prompt, ("tiny-model", "tenant-a"))
    hit = run(m, fkv, "b", prompt[:38] + [1, 2], ("tiny-model", "tenant-b"))
    assert hit.num_tokens == 0
    hit = run(m, fkv, "c", prompt[:38] + [1, 2], ("tiny-model", "tenant-a"))
    assert hit.num_tokens == 38


def test_requests_sharing_one_source_block_copy_it_concurrently() -> None:
    m, fkv = manager()
    base = toks(13, 45)
    run(m, fkv, "base", base)  # keeps a 13-token partial entry
    src_tokens = fkv.kv.clone()
    hits = [run(m, fkv, f"r{i}", base[: 32 + 3 + i] + toks(20 + i, 7), free=False) for i in range(6)]
    assert [h.partial_tokens for h in hits] == [3 + i for i in range(6)]
    assert len({h.partial_block_id for h in hits}) == 1
    src = hits[0].partial_block_id
    assert m.pool.blocks[src].ref_cnt == 0  # held only during each copy
    assert torch.equal(fkv.kv[src], src_tokens[src])
    dsts = [dst for _, dst, _ in fkv.copies]
    assert len(set(dsts)) == 6 and src not in dsts
    for i in range(6):
        m.free(f"r{i}", base[: 32 + 3 + i] + toks(20 + i, 7), 32 + 3 + i + 7, EXTRA)
    m.check_invariants()


def test_a_kept_partial_block_is_evicted_under_pressure_and_never_shown_to_the_tiers() -> None:
    m, fkv = manager(num_blocks=8)
    seen = []
    m.set_evict_listener(lambda b: seen.append((b.block_id, b.block_hash, b.partial)))
    first = toks(14, 40)  # 2 full + a partial of 8
    run(m, fkv, "a", first)
    assert m.partial_entries == 1
    assert all(not b.partial for b in m.registered_blocks())
    for i in range(4):
        run(m, fkv, f"f{i}", toks(30 + i, 64))  # 4 blocks each in an 8-block pool
    assert m.partial_entries == 0 and m.evictions == 11
    assert len(seen) == 10 and all(
        h is not None and not partial for _, h, partial in seen
    )  # 11 - the partial
    hit = run(m, fkv, "again", first[:36] + [5])
    assert hit.partial_tokens == 0


def test_a_source_evicted_between_lookup_and_allocate_is_refused() -> None:
    m, fkv = manager(num_blocks=6)
    first = toks(15, 40)
    run(m, fkv, "a", first)
    prompt = first[:36] + [7, 8]
    hit = m.find_cached_prefix(prompt, m.block_hashes(prompt, EXTRA)[:2], EXTRA, partial=True)
    assert hit.partial_tokens == 4
    assert m.drop_unreferenced_where(lambda b: b.partial) == 1
    with pytest.raises(StaleCacheHitError, match="partial"):
        m.allocate("b", len(prompt), hit)
    m.check_invariants()


def test_a_failing_copy_changes_nothing() -> None:
    m, fkv = manager()
    first = toks(16, 40)
    run(m, fkv, "a", first)
    prompt = first[:36] + [7, 8]
    hit = m.find_cached_prefix(prompt, m.block_hashes(prompt, EXTRA)[:2], EXTRA, partial=True)
    before = (m.usage(), list(m.pool.free_ids()), sorted(m.pool.evictable_ids()))

    def broken(src: int, dst: int, n: int) -> None:
        raise RuntimeError("copy failed")

    m.set_slot_copier(broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        m.allocate("b", len(prompt), hit)
    assert "b" not in m
    assert (m.usage()["blocks_used"], sorted(m.pool.evictable_ids())) == (before[0]["blocks_used"], before[2])
    m.check_invariants()


def test_many_random_requests_leak_no_block() -> None:
    rng = random.Random(0)
    m, fkv = manager(num_blocks=40)
    heads = [toks(100 + i, rng.randrange(5, 60)) for i in range(5)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 3):
            rid = rng.choice(sorted(live))
            prompt = live.pop(rid)
            m.free(rid, prompt, rng.randrange(len(prompt) + 1), EXTRA)
        else:
            head = rng.choice(heads)
            cut = rng.randrange(1, len(head) + 1)
            prompt = head[:cut] + toks(rng.randrange(1 << 30), rng.randrange(1, 20))
            hashes = m.block_hashes(prompt, EXTRA)
            hit = m.find_cached_prefix(prompt, hashes[: (len(prompt) - 1) // BS], EXTRA, partial=True)
            table = m.allocate(f"r{step}", len(prompt), hit)
            if table is None:
                continue
            fkv.check(table, prompt, hit.num_tokens)
            fkv.compute(table, prompt, hit.num_tokens, len(prompt))
            m.cache_full_blocks(f"r{step}", prompt, len(prompt), hashes, EXTRA)
            live[f"r{step}"] = prompt
        m.check_invariants()
    for rid, prompt in live.items():
        m.free(rid, prompt, len(prompt), EXTRA)
    m.check_invariants()
    assert m.blocks_used == 0 and m.blocks_cached + m.blocks_free == m.blocks_total
    assert m.reset_prefix_cache()
    assert m.blocks_free == m.blocks_total and m.partial_entries == 0
