"""The Redis tier against real Redis servers: the machine's (unique key prefix per test) and a private one
that tests stop, restart and cap with maxmemory; a closed port and a server that never answers."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
import redis

from engine.kv_tiers.disk import TierConfigError
from engine.kv_tiers.policy import TierPolicies, TierPolicy
from engine.kv_tiers.redis_tier import RedisTier
from tests.engine.tiers.conftest import REDIS_URL, free_port

POLICIES = TierPolicies(
    {
        "redis": {
            "system": TierPolicy(None, 0.5),
            "documents": TierPolicy(3600.0, 0.25),
            "history": TierPolicy(60.0, 0.25),
        }
    }
)
SYSTEM, DOCS, HISTORY = frozenset({"system"}), frozenset({"documents"}), frozenset({"history"})


def entry(i: int, n: int = 800) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def make(prefix, counters, clock, url=REDIS_URL, budget=1 << 20, **kw) -> RedisTier:
    return RedisTier(url, prefix, budget, POLICIES, counters, clock, **kw)


def test_put_get_delete_and_a_second_gateway(redis_prefix, counters, clock):
    a = make(redis_prefix, counters, clock)
    assert a.get("k") is None
    assert a.put("k", entry(1), SYSTEM) and a.get("k") == entry(1)
    b = make(redis_prefix, counters, clock)  # another gateway of the same deployment
    assert b.get("k") == entry(1)
    other = make(redis_prefix + "-other", counters, clock)  # another deployment sees nothing
    assert other.get("k") is None
    assert a.level_bytes("system") == 800 and a.nbytes() == 800
    assert list(b.keys()) == [("system", "k")]
    assert b.delete("k") and a.get("k") is None and a.level_bytes("system") == 0
    for t in (a, b, other):
        t.close()


def test_budget_per_level_holds_under_a_flood(redis_prefix, counters, clock):
    budget = 64_000
    tier = make(redis_prefix, counters, clock, budget=budget)
    for i in range(300):
        clock.advance(0.01)
        assert tier.put(f"h{i}", entry(i), HISTORY)
        assert tier.level_bytes("history") <= budget // 4
    assert counters.get("redis.evicted") == 300 - (budget // 4) // 800
    assert tier.get("h299") == entry(299) and tier.get("h0") is None
    raw = redis.Redis.from_url(REDIS_URL)
    stored = sum(len(raw.get(k) or b"") for k in raw.scan_iter(match=f"{redis_prefix}:kv:*"))
    assert stored == tier.level_bytes("history") <= budget // 4  # the bookkeeping matches what is stored
    raw.close()
    tier.close()


def test_ttl_per_level_on_the_injected_clock(redis_prefix, counters, clock):
    tier = make(redis_prefix, counters, clock)
    tier.put("h", entry(1), HISTORY)
    tier.put("d", entry(2), DOCS)
    tier.put("s", entry(3), SYSTEM)
    raw = redis.Redis.from_url(REDIS_URL)
    assert (
        0 < raw.pttl(tier.entry_key("h")) <= 60_000 and raw.pttl(tier.entry_key("s")) == -1
    )  # Redis TTL too
    raw.close()
    clock.advance(61)
    assert tier.get("h") is None and counters.get("redis.expired.history") == 1
    assert tier.get("d") == entry(2) and tier.get("s") == entry(3)
    assert tier.level_bytes("history") == 0
    clock.advance(3600)
    assert tier.get("d") is None and counters.get("redis.expired.documents") == 1
    assert tier.get("s") == entry(3)
    tier.close()


def test_expired_entries_leave_the_budget_on_the_next_write(redis_prefix, counters, clock):
    tier = make(redis_prefix, counters, clock)
    for i in range(5):
        tier.put(f"h{i}", entry(i), HISTORY)
    clock.advance(61)
    tier.put("fresh", entry(9), HISTORY)
    assert tier.level_bytes("history") == 800 and counters.get("redis.expired.history") == 5
    tier.close()


def test_closed_port_costs_nothing_and_is_counted(counters, clock):
    tier = make("pgtest-closed", counters, clock, url=f"redis://127.0.0.1:{free_port()}/0", retry_s=60)
    assert tier.is_down  # unreachable at start: a warning, not an error
    assert tier.get("k") is None and not tier.put("k", entry(1), SYSTEM)
    assert counters.get("redis.skipped_down") == 2
    tier.close()


def test_slow_redis_times_out_and_is_counted(counters, clock):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        accepted = []
        stop = threading.Event()

        def accept_and_stay_silent():
            server.settimeout(0.1)
            while not stop.is_set():
                try:
                    accepted.append(server.accept()[0])
                except TimeoutError:
                    pass

        t = threading.Thread(target=accept_and_stay_silent, daemon=True)
        t.start()
        try:
            tier = make(
                "pgtest-slow", counters, clock, url=f"redis://127.0.0.1:{port}/0", timeout_s=0.1, retry_s=0
            )
            assert tier.get("k") is None
            assert not tier.put("k", entry(1), SYSTEM)
            assert counters.get("redis.read_errors") == 1 and counters.get("redis.write_errors") == 1
            tier.close()
        finally:
            stop.set()
            t.join()
            for c in accepted:
                c.close()


def test_redis_stopped_mid_run_comes_back(private_redis, counters, clock):
    tier = make("pg", counters, clock, url=private_redis.url, retry_s=0)
    assert tier.put("a", entry(1), SYSTEM)
    private_redis.stop()
    assert tier.get("a") is None and not tier.put("b", entry(2), SYSTEM)
    assert counters.get("redis.read_errors") == 1 and counters.get("redis.write_errors") == 1
    private_redis.start()  # same port, empty (no persistence)
    assert tier.put("b", entry(2), SYSTEM) and tier.get("b") == entry(2)
    tier.close()


def test_down_tier_waits_retry_s_before_trying_again(private_redis, counters, clock):
    tier = make("pg", counters, clock, url=private_redis.url, retry_s=3600)
    private_redis.stop()
    assert tier.get("a") is None and tier.is_down
    private_redis.start()
    assert tier.get("a") is None and counters.get("redis.skipped_down") == 1  # not tried again yet
    tier._down_until = 0.0  # the retry interval has passed
    assert tier.put("a", entry(1), SYSTEM) and tier.get("a") == entry(1)
    tier.close()


def test_maxmemory_refusal_is_counted_and_costs_nothing(private_redis, counters, clock):
    admin = redis.Redis.from_url(private_redis.url)
    tier = make("pg", counters, clock, url=private_redis.url, budget=64 << 20)
    assert tier.put("small", entry(1), SYSTEM)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + 50_000)
    refused = [tier.put(f"big{i}", entry(i, 100_000), SYSTEM) for i in range(3)]
    assert refused.count(False) >= 2 and counters.get("redis.write_refused") >= 2
    assert not tier.is_down and tier.get("small") == entry(1)
    admin.config_set("maxmemory", 0)
    assert tier.put("later", entry(5, 100_000), SYSTEM) and tier.get("later") == entry(5, 100_000)
    admin.close()
    tier.close()


def test_bad_config_stops_the_start(counters):
    with pytest.raises(TierConfigError) as e:
        RedisTier("http://nowhere", "p", 1 << 20, POLICIES, counters)
    assert e.value.key == "engine.tier_redis.url"
    with pytest.raises(TierConfigError, match="prefix"):
        RedisTier(REDIS_URL, "", 1 << 20, POLICIES, counters)
    with pytest.raises(TierConfigError, match="budget_bytes"):
        RedisTier(REDIS_URL, "p", 0, POLICIES, counters)


def test_a_database_the_server_refuses_or_that_is_not_a_number_stops_the_start(counters):
    """Before: ``/99`` raised the server's raw ``ResponseError: DB index is out of range`` out of the start
    (only connection errors were caught around ``ping``), and ``/abc`` silently used database 0."""
    with pytest.raises(TierConfigError) as e:
        RedisTier("redis://127.0.0.1:6379/99", "p", 1 << 20, POLICIES, counters)
    assert e.value.key == "engine.tier_redis.url"
    assert "refused the connection" in e.value.reason and "DB index is out of range" in e.value.reason
    for url in ("redis://127.0.0.1:6379/abc", "redis://127.0.0.1:6379/-1", "redis://127.0.0.1:6379/0?db=x"):
        with pytest.raises(TierConfigError) as e:
            RedisTier(url, "p", 1 << 20, POLICIES, counters)
        assert e.value.key == "engine.tier_redis.url" and "non-negative integer" in e.value.reason


def test_expired_bookkeeping_leaves_without_a_write_of_its_level(redis_prefix, counters, clock):
    """Before: the bookkeeping of entries Redis expired by TTL (sorted set, byte counter, meta hash) stayed
    until their own level was written again, so ``redis.bytes`` overstated usage and other levels' expiries
    were never counted. The writer's housekeeping sweeps every level, and a read that finds a key gone
    removes its bookkeeping."""
    tier = make(redis_prefix, counters, clock)
    tier.sweep_interval_s = 0.0  # every call sweeps (the writer's housekeeping sweeps at most once a second)
    for i in range(3):
        tier.put(f"h{i}", entry(i), HISTORY)
    tier.put("d", entry(7), DOCS)
    tier.put("gone-early", entry(8), DOCS)
    tier.put("s", entry(9), SYSTEM)
    clock.advance(61)  # past history's TTL (60 s) only
    assert tier.sweep_expired() == 3
    assert tier.level_bytes("history") == 0 and counters.get("redis.expired.history") == 3
    assert tier.sweep_expired() == 0 and counters.get("redis.expired.history") == 3  # counted once
    assert tier.level_bytes("documents") == 1600 and tier.level_bytes("system") == 800

    raw = redis.Redis.from_url(REDIS_URL)
    raw.delete(tier.entry_key("gone-early"))  # dropped by Redis before its expiry (e.g. maxmemory)
    assert tier.get("gone-early") is None and tier.level_bytes("documents") == 800
    assert counters.get("redis.expired.documents") == 0  # gone, but not expired
    clock.advance(3600)
    raw.delete(tier.entry_key("d"))  # what Redis does at the key's TTL
    raw.close()
    assert tier.get("d") is None and tier.level_bytes("documents") == 0
    assert counters.get("redis.expired.documents") == 1
    assert tier.sweep_expired() == 0 and tier.nbytes() == 800 and list(tier.keys()) == [("system", "s")]
    tier.close()


def test_failed_writes_log_one_line_then_a_summary(private_redis, counters, clock, caplog):
    """Before: every refused write logged its own WARNING (79 lines for one request at maxmemory)."""
    admin = redis.Redis.from_url(private_redis.url)
    tier = make("pg", counters, clock, url=private_redis.url, budget=64 << 20)
    ticks = [0.0]
    tier.failures.clock = lambda: ticks[0]
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 10_000)
    caplog.set_level(logging.WARNING, logger="engine.kv_tiers.redis_tier")
    assert not any(tier.put(f"big{i}", entry(i, 100_000), SYSTEM) for i in range(20))
    assert counters.get("redis.write_refused") == 20
    (first,) = [r.getMessage() for r in caplog.records]
    assert first.startswith("redis tier: write refused (maxmemory): ")
    caplog.clear()
    tier.sweep_expired()  # the writer's housekeeping: the interval has not passed, nothing to say
    assert caplog.records == []
    ticks[0] = 61.0
    tier.sweep_expired()
    (summary,) = [r.getMessage() for r in caplog.records]
    assert "write refused (maxmemory): 19 more in the last 61s" in summary
    admin.config_set("maxmemory", 0)
    admin.close()
    tier.close()
