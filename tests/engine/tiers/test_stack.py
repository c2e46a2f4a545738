"""The tier stack: write-back through the bounded queue, chain lookups across disk then Redis, refused
entries counted by cause and replaced by the next tier's copy, and a full queue that drops instead of waiting."""

from __future__ import annotations

import threading
import time

import torch

from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.entry import BlockMeta, encode_entry
from engine.kv_tiers.keys import keyed_block_hash
from engine.kv_tiers.policy import TierPolicies, TierPolicy
from engine.kv_tiers.redis_tier import RedisTier
from engine.kv_tiers.stack import TierStack
from tests.engine.tiers.conftest import REDIS_URL

HASH = keyed_block_hash(b"k" * 32)
EXTRA = ("tiny-model@abc", "")
LEVELS = frozenset({"system"})


def chain(layout, n: int, seed: int = 0) -> list[tuple[BlockMeta, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out, parent = [], None
    for i in range(n):
        tokens = tuple(range(seed * 100 + i * 4, seed * 100 + i * 4 + 4))
        h = HASH(parent, tokens, EXTRA)
        out.append((BlockMeta(h, parent, tokens, EXTRA), torch.randn(layout.block_shape, generator=g)))
        parent = h
    return out


def stack(layout, tmp_path, counters, clock, redis_prefix, *, capacity: int = 64) -> TierStack:
    policies = TierPolicies()
    tiers = [
        DiskTier(tmp_path / "disk", 1 << 22, policies, counters, clock),
        RedisTier(REDIS_URL, redis_prefix, 1 << 22, policies, counters, clock),
    ]
    return TierStack(layout, tiers, counters, writeback_capacity=capacity)


def test_write_back_then_lookup_the_chain(layout, tmp_path, counters, clock, redis_prefix):
    s = stack(layout, tmp_path, counters, clock, redis_prefix)
    blocks = chain(layout, 5)
    for meta, kv in blocks[:3]:
        assert s.write_back(meta, LEVELS, kv.clone())
    assert s.flush()
    found = s.lookup([m for m, _ in blocks])
    assert [b.meta for b in found] == [m for m, _ in blocks[:3]]  # stops at the first block no tier has
    assert all(torch.equal(b.kv, kv) and b.tier == "disk" for b, (_, kv) in zip(found, blocks, strict=False))
    assert counters.get("disk.hit_tokens") == 12 and counters.get("disk.miss_tokens") == 4
    assert counters.get("redis.miss_tokens") == 4 and counters.get("redis.writes") == 3
    assert s.prefetch([m for m, _ in blocks[:2]]).result(10)[1].meta == blocks[1][0]
    assert counters.load_histogram().count == 2
    stats = s.stats()
    assert stats["disk.bytes"] > 0 and stats["redis.bytes"] == sum(
        len(encode_entry(layout, m, kv)) for m, kv in blocks[:3]
    )
    s.close()


def test_a_bursts_last_writes_are_in_the_byte_gauges_without_a_flush(
    layout, tmp_path, counters, clock, redis_prefix
):
    """Before: sizes were measured on a write at most once a second, so a burst of evictions was measured
    after its first write and the gauges stayed there (one entry of 39) until the next burst. The writer now
    measures at a burst's end."""
    s = stack(layout, tmp_path, counters, clock, redis_prefix)
    blocks = chain(layout, 6, seed=3)
    for meta, kv in blocks:
        assert s.write_back(meta, LEVELS, kv.clone())
    expected = sum(len(encode_entry(layout, m, kv)) for m, kv in blocks)
    deadline = time.monotonic() + 10
    while s.stats()["redis.bytes"] != expected and time.monotonic() < deadline:
        time.sleep(0.05)  # no flush: flush measures itself
    stats = s.stats()
    assert stats["redis.bytes"] == expected and stats["disk.bytes"] == s.nbytes()["disk"]
    s.close()


def test_presence_reports_when_a_chain_starts_to_expire(layout, tmp_path, counters, clock):
    """A chain whose first block is kept a day (system) and the rest a minute (history): its expiry in the
    tier is the minute's, when the tier starts serving less of it (before: the first block's day)."""
    policies = TierPolicies(
        {
            "disk": {
                "system": TierPolicy(86400.0, 0.5),
                "history": TierPolicy(60.0, 0.3),
                "documents": TierPolicy(None, 0.2),
            }
        }
    )
    s = TierStack(layout, [DiskTier(tmp_path / "disk", 1 << 22, policies, counters, clock)], counters)
    blocks = chain(layout, 3, seed=5)
    for i, (meta, kv) in enumerate(blocks):
        s.write_now(meta, LEVELS if i == 0 else frozenset({"history"}), kv)
    assert s.presence([m.block_hash for m, _ in blocks])["disk"] == (3, clock() + 60.0)
    assert s.presence([blocks[0][0].block_hash])["disk"] == (1, clock() + 86400.0)
    s.close()


def test_refused_entry_is_counted_removed_and_the_next_tier_serves(
    layout, tmp_path, counters, clock, redis_prefix
):
    s = stack(layout, tmp_path, counters, clock, redis_prefix)
    (meta, kv), (meta2, kv2) = chain(layout, 2)
    s.write_now(meta, LEVELS, kv)
    s.write_now(meta2, LEVELS, kv2)
    disk, red = s.tiers
    good = disk.get(s.key(meta))
    disk.put(s.key(meta), good[:-7], LEVELS)  # truncated on disk
    bad = bytearray(disk.get(s.key(meta2)) or b"")
    bad[-100] ^= 0xFF
    disk.put(s.key(meta2), bytes(bad), LEVELS)  # corrupt on disk
    found = s.lookup([meta, meta2])
    assert [b.tier for b in found] == ["redis", "redis"]
    assert torch.equal(found[0].kv, kv) and torch.equal(found[1].kv, kv2)
    assert counters.get("rejected.truncated") == 1 and counters.get("rejected.corrupt") == 1
    assert disk.get(s.key(meta)) is None  # the bad copy is gone
    red.put(s.key(meta), good, LEVELS)
    foreign = chain(layout, 1, seed=3)[0][0]  # a block of another chain stored under meta's key
    red.put(s.key(meta), encode_entry(layout, foreign, kv), LEVELS)
    assert s.lookup([meta]) == [] and counters.get("rejected.collision") == 1
    s.close()


def test_full_queue_drops_and_never_waits(layout, tmp_path, counters, clock, redis_prefix):
    s = stack(layout, tmp_path, counters, clock, redis_prefix, capacity=2)
    gate = threading.Event()
    real_write = s._write

    def slow_write(item):
        gate.wait(10)
        real_write(item)

    s.queue._handler = slow_write
    blocks = chain(layout, 6)
    accepted = [s.write_back(m, LEVELS, kv) for m, kv in blocks]
    # one is being written (held at the gate), two wait, the rest are dropped
    assert accepted.count(True) in (2, 3) and counters.get("writeback.dropped") == accepted.count(False)
    gate.set()
    assert s.flush()
    assert counters.get("disk.writes") == accepted.count(True)
    s.close()


def test_a_failing_write_is_counted_and_the_writer_goes_on(layout, tmp_path, counters, clock, redis_prefix):
    s = stack(layout, tmp_path, counters, clock, redis_prefix)
    (meta, kv), (meta2, kv2) = chain(layout, 2)
    s.write_back(meta, LEVELS, kv[:1])  # wrong shape: encode raises on the writer thread
    s.write_back(meta2, LEVELS, kv2)
    assert s.flush()
    assert counters.get("writeback.errors") == 1 and counters.get("disk.writes") == 1
    s.close()


def test_drop_where_removes_a_tenants_entries_in_every_tier(layout, tmp_path, counters, clock, redis_prefix):
    s = stack(layout, tmp_path, counters, clock, redis_prefix)
    mine = chain(layout, 2)
    g = torch.Generator().manual_seed(5)
    theirs = BlockMeta(b"\x05" * 32, None, (9, 9, 9, 9), ("tiny-model@abc", "tenant-b"))
    for meta, kv in mine:
        s.write_now(meta, LEVELS, kv)
    s.write_now(theirs, LEVELS, torch.randn(layout.block_shape, generator=g))
    big = BlockMeta(b"\x06" * 32, None, (1, 2, 3, 4), ("tiny-model@abc", "tenant-b"))
    s.write_now(big, LEVELS, torch.randn(layout.block_shape, generator=g))
    assert s.drop_where(lambda m: m.extra_keys[1] == "tenant-b") == {"disk": 2, "redis": 2}
    assert s.lookup([theirs]) == [] and len(s.lookup([m for m, _ in mine])) == 2
    assert s.drop_where(lambda m: m.extra_keys[0] == "tiny-model@abc") == {"disk": 2, "redis": 2}
    assert s.lookup([m for m, _ in mine]) == []
    s.close()


def test_admin_operations_skip_a_redis_that_is_down_and_say_so(
    layout, tmp_path, counters, clock, private_redis
):
    """Before: with Redis unreachable, ``drop_where`` (``DELETE /admin/cache?tenant=``) raised the
    ``ConnectionError`` of its scan (a 500) after RAM was dropped, and the disk tier was never dropped. Every
    admin call on a tier now fails soft: the other tiers are done, the failed tier is named and counted."""
    policies = TierPolicies()
    disk = DiskTier(tmp_path / "disk", 1 << 22, policies, counters, clock)
    red = RedisTier(private_redis.url, "pg", 1 << 22, policies, counters, clock, retry_s=3600)
    s = TierStack(layout, [disk, red], counters)
    blocks = chain(layout, 3)
    for meta, kv in blocks:
        s.write_now(meta, LEVELS, kv)
    hashes = [m.block_hash for m, _ in blocks]
    private_redis.stop()

    skipped: dict[str, str] = {}
    assert s.drop_where(lambda m: m.extra_keys[0] == "tiny-model@abc", skipped) == {"disk": 3, "redis": 0}
    assert list(skipped) == ["redis"] and "ConnectionError" in skipped["redis"]
    assert counters.get("redis.admin_errors") == 1 and counters.get("disk.admin_errors") == 0
    assert red.is_down  # the failed scan marked it down: the next calls skip it at once

    for meta, kv in blocks:
        s.write_now(meta, LEVELS, kv)  # on disk only
    skipped = {}
    assert s.presence(hashes, skipped) == {"disk": (3, clock() + 86_400.0), "redis": (0, None)}
    assert s.delete_chain(hashes, skipped) == {"disk": 3, "redis": 0}
    assert s.delete_record("pk", skipped) == 0
    assert list(skipped) == ["redis"] and counters.get("redis.admin_errors") == 4
    assert counters.get("disk.admin_errors") == 0 and s.stats()["redis.admin_errors"] == 4
    s.close()


def test_every_counter_with_a_known_set_of_labels_is_reported_from_zero(layout, tmp_path, counters, clock):
    """Before: expirations, rejections, dropped writes and loaded blocks had no sample until their first
    event, although every per-tier counter is documented to start at 0 (a rate() over them was undefined)."""
    s = TierStack(layout, [DiskTier(tmp_path / "disk", 1 << 22, TierPolicies(), counters, clock)], counters)
    stats = s.stats()
    for name in (
        "disk.expired.system",
        "disk.expired.documents",
        "disk.expired.history",
        "rejected.truncated",
        "rejected.corrupt",
        "rejected.format",
        "rejected.model",
        "rejected.collision",
        "writeback.dropped",
        "loaded_blocks",
        "disk.admin_errors",
    ):
        assert stats[name] == 0, name
    assert not any(k.startswith("redis.") for k in stats)  # only configured tiers
    s.close()
