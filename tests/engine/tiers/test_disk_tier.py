"""The disk tier on real diskcache directories: reads and writes, survival across a reopen, byte budgets per
level under a flood, TTL per level on an injected clock, an unwritable directory at start, a full disk."""

from __future__ import annotations

import logging
import resource
import signal
import time

import pytest

from engine.kv_tiers.disk import DiskTier, TierConfigError
from engine.kv_tiers.policy import TierPolicies, TierPolicy

POLICIES = TierPolicies(
    {
        "disk": {
            "system": TierPolicy(None, 0.5),
            "documents": TierPolicy(3600.0, 0.25),
            "history": TierPolicy(60.0, 0.25),
        }
    }
)
SYSTEM, DOCS, HISTORY = frozenset({"system"}), frozenset({"documents"}), frozenset({"history"})


def entry(i: int, n: int = 800) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def test_put_get_delete_and_reopen(tmp_path, counters, clock):
    tier = DiskTier(tmp_path / "kv", 1 << 20, POLICIES, counters, clock)
    assert tier.get("a") is None
    assert tier.put("a", entry(1), SYSTEM) and tier.put(
        "b", entry(2, 40_000), HISTORY
    )  # inline and as a file
    assert tier.get("a") == entry(1) and tier.get("b") == entry(2, 40_000)
    assert counters.get("disk.writes") == 2 and counters.get("disk.bytes_written") == 40_800
    tier.close()
    again = DiskTier(tmp_path / "kv", 1 << 20, POLICIES, counters, clock)  # a restart
    assert again.get("a") == entry(1) and again.get("b") == entry(2, 40_000)
    assert again.delete("a") and again.get("a") is None and not again.delete("a")
    assert sorted(again.keys()) == [("history", "b")]
    again.close()


def test_a_key_moves_to_its_longest_level(tmp_path, counters, clock):
    tier = DiskTier(tmp_path / "kv", 1 << 20, POLICIES, counters, clock)
    tier.put("k", entry(1), HISTORY)
    tier.put("k", entry(1), HISTORY | SYSTEM)
    assert list(tier.keys()) == [("system", "k")]
    tier.close()


def test_budget_per_level_holds_under_a_flood(tmp_path, counters, clock):
    budget = 1 << 20
    tier = DiskTier(tmp_path / "kv", budget, POLICIES, counters, clock)
    for i in range(1500):
        assert tier.put(f"h{i}", entry(i), HISTORY)
        if i % 100 == 0:
            assert tier.level_bytes("history") <= tier.level_limit("history") == budget // 4
    assert tier.level_bytes("history") <= budget // 4
    assert counters.get("disk.evicted") > 0
    assert tier.get("h1499") == entry(1499)  # the newest is kept, the oldest went first
    assert tier.get("h0") is None
    tier.put("s", entry(7), SYSTEM)  # other levels keep their own share
    assert tier.get("s") == entry(7)
    assert tier.nbytes() <= budget
    tier.close()


def test_ttl_per_level_on_the_injected_clock(tmp_path, counters, clock):
    tier = DiskTier(tmp_path / "kv", 1 << 20, POLICIES, counters, clock)
    tier.put("h", entry(1), HISTORY)
    tier.put("d", entry(2), DOCS)
    tier.put("s", entry(3), SYSTEM)
    clock.advance(59)
    assert tier.get("h") == entry(1)
    clock.advance(2)
    assert tier.get("h") is None and counters.get("disk.expired.history") == 1
    assert tier.get("d") == entry(2)
    clock.advance(3600)
    assert tier.get("d") is None and counters.get("disk.expired.documents") == 1
    assert tier.get("s") == entry(3)  # no TTL
    assert list(tier.keys()) == [("system", "s")]  # expired entries are deleted
    tier.close()


def test_ttl_on_the_real_clock_is_counted_once_when_swept(tmp_path, counters):
    """Before: on the real clock diskcache's own ``expire=`` hid an expired entry (a read found nothing), so
    ``disk.expired.{level}`` was never counted and the dashboard's disk expirations stayed empty."""
    short = TierPolicies(
        {
            "disk": {
                "history": TierPolicy(0.5, 0.4),
                "system": TierPolicy(None, 0.4),
                "documents": TierPolicy(None, 0.2),
            }
        }
    )
    tier = DiskTier(tmp_path / "kv", 1 << 20, short, counters)  # time.time
    tier.put("h", entry(1), HISTORY)
    tier.put("s", entry(2), SYSTEM)
    assert tier.get("h") == entry(1)
    time.sleep(0.6)
    assert tier.get("h") is None and counters.get("disk.expired.history") == 0  # not counted on the read
    assert tier.sweep_expired() == 1 and counters.get("disk.expired.history") == 1
    assert tier.sweep_expired() == 0 and counters.get("disk.expired.history") == 1  # counted once
    assert list(tier.keys()) == [("system", "s")]
    tier.put("h2", entry(3), HISTORY)  # a write sweeps too
    time.sleep(0.6)
    tier.put("s2", entry(4), SYSTEM)
    assert counters.get("disk.expired.history") == 2 and tier.get("s") == entry(2)
    tier.close()


def test_unwritable_directory_stops_the_start(tmp_path, counters):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TierConfigError) as e:
        DiskTier(blocker / "kv", 1 << 20, POLICIES, counters)
    assert e.value.key == "engine.tier_disk.directory" and "not writable" in e.value.reason
    with pytest.raises(TierConfigError, match="budget_bytes"):
        DiskTier(tmp_path / "kv", 0, POLICIES, counters)


def test_full_disk_skips_writes_and_the_tier_goes_on(tmp_path, counters, clock, caplog):
    caplog.set_level(logging.WARNING, logger="engine.kv_tiers.disk")
    tier = DiskTier(tmp_path / "kv", 64 << 20, POLICIES, counters, clock)
    tier.put("before", entry(1), SYSTEM)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))  # every file write past 4 KiB fails
    try:
        ok = [tier.put(f"big{i}", entry(i, 200_000), SYSTEM) for i in range(3)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert ok == [False, False, False]
    assert counters.get("disk.write_errors") == 3 and counters.get("disk.writes") == 1
    # one line for the first failure, not one per block (before: 191 lines when a disk filled)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("disk tier: write skipped: ")
    assert tier.get("big0") is None and tier.get("before") == entry(1)
    assert tier.put("after", entry(2), SYSTEM) and tier.get("after") == entry(2)
    tier.close()


@pytest.mark.parametrize("fits", [1, 3, 6, 12])
def test_a_small_level_keeps_as_many_of_the_newest_entries_as_fit(tmp_path, counters, clock, fits):
    # a chain written deepest first (the head last): a level too small for it keeps the head and the blocks
    # next to it, as many as fit (diskcache's own cull took ten per pass and emptied small levels)
    size = 40_000  # a file-backed entry, as a KV block is
    probe = DiskTier(tmp_path / "probe", 1 << 30, POLICIES, counters, clock)
    probe.put("x", entry(0, size), SYSTEM)
    overhead = probe._caches["system"].volume() - size
    probe.close()
    budget = int(2 * (overhead + fits * size + size // 2))  # the system level has half the budget
    tier = DiskTier(tmp_path / "kv", budget, POLICIES, counters, clock)
    for depth in range(20, -1, -1):  # depth 0 is the head, written last
        assert tier.put(f"b{depth}", entry(depth, size), SYSTEM)
    kept = sorted(int(key[1:]) for _, key in tier.keys())
    assert kept == list(range(len(kept))) and fits - 1 <= len(kept) <= fits  # the head and its neighbours
    tier.close()
