"""The prefix catalog's rows against what the tiers really hold and serve (a fresh-user trial of the KV tiers):
a record outlives the byte budget that trims its chain, a tier's tokens count the tail it serves below a head
still in RAM, a row stays listed while a tier cannot answer, and a drop a tier skipped can be made again."""

from __future__ import annotations

import time

import pytest
import redis

from engine.kv_tiers.catalog import RECORD_REFRESH_S, is_record_key
from engine.kv_tiers.config import entry_nbytes
from engine.kv_tiers.disk import EMPTY_LEVEL_BYTES
from engine.kv_tiers.settings import DiskTierConfig, RedisTierConfig
from tests.engine.engine_helpers import greedy, make_engine, random_tokens
from tests.engine.tiers.conftest import REDIS_URL, FakeClock

SECRET = "catalog-rows-tests-secret-0123456789"


def tiered(tmp_path, tiers, redis_prefix="pg-unused", *, budget=1 << 26, redis_url=REDIS_URL, **kw):
    kw.setdefault("num_blocks", 64)
    return make_engine(
        tiers=tiers,
        tier_disk=DiskTierConfig(str(tmp_path / "disk"), budget),
        tier_redis=RedisTierConfig(
            url=redis_url, prefix=redis_prefix, budget_bytes=budget, timeout_s=0.2, retry_s=0.2
        ),
        deployment_secret=SECRET,
        **kw,
    )


def run(eng, prompt, **kw):
    req = eng.add_request(prompt, greedy(2), **kw)
    eng.run_to_completion()
    return req


def entry_bytes(tmp_path) -> int:
    probe = tiered(tmp_path / "probe", ("disk",))
    n = entry_nbytes(probe.tiers.stack.layout)
    probe.close()
    return n


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_chain_the_budget_trimmed_is_listed_and_dropped_after_a_restart(tmp_path, redis_prefix, tier):
    """Before: the record was the level's oldest entry (written when the prompt was served, its blocks at
    shutdown), so the budget evicted it first; after the restart the tier served the chain's head with no row
    listed, and ``drop_cached(prefix_key=...)`` dropped nothing."""
    entry = entry_bytes(tmp_path)
    overhead = EMPTY_LEVEL_BYTES if tier == "disk" else 0
    budget = (overhead + 8 * entry) * 4  # the history level (a quarter) holds about 8 block entries
    prompt = random_tokens(20 * 16 + 1, 71)  # 20 whole blocks
    first = tiered(tmp_path, (tier,), redis_prefix, budget=budget)
    run(first, prompt, prefix_key="pk-long")
    first.close()  # writes every cached block down: the level keeps the head's blocks
    second = tiered(tmp_path, (tier,), redis_prefix, budget=budget)
    store = second.tiers.stack.tiers[0]
    kept = sum(1 for _, key in store.keys() if not is_record_key(key))
    assert 0 < kept < 20
    (row,) = second.list_cached()
    assert (row.prefix_key, row.tiers) == ("pk-long", {"ram": 0, tier: kept * 16})
    dropped = second.drop_cached(prefix_key="pk-long")
    assert (dropped["prefixes"], dropped[tier]) == (1, kept), dropped
    assert run(second, prompt).num_cached_tokens == 0
    second.close()


def test_a_tier_counts_the_tail_it_serves_below_a_head_in_ram(tmp_path):
    """Before: a tier counted only blocks from the chain's first, so the tail the pool evicted to disk below a
    head still in RAM was listed as ``disk: 0`` while the next request read it from there."""
    eng = tiered(tmp_path, ("disk",), num_blocks=24)
    a = random_tokens(16 * 16 + 1, 72)  # 16 whole blocks
    run(eng, a, prefix_key="pk-a")
    run(eng, random_tokens(14 * 16, 73))  # the pool evicts a's tail (a chain's tail goes before its head)
    assert eng.flush_tiers(write_cached=False)
    (row,) = eng.list_cached(prefix_key="pk-a")
    ram, disk = row.tiers["ram"], row.tiers["disk"]
    assert 0 < ram < 256 and ram + disk == 256, row.tiers
    assert row.expires_at["disk"] is not None
    hits_before = eng.tier_stats()["disk.hit_tokens"]
    req = run(eng, a)
    assert req.num_cached_tokens == 256
    assert eng.tier_stats()["disk.hit_tokens"] - hits_before == disk
    eng.close()


def pause(port: int, ms: int) -> None:
    """Make a Redis server unresponsive for ``ms`` (its data kept), as ``CLIENT PAUSE`` does."""
    client = redis.Redis(port=port)
    client.execute_command("CLIENT", "PAUSE", ms, "ALL")
    client.close()


def wait_unpaused(port: int) -> None:
    """Return once the server answers again (a ``PING`` waits out a pause)."""
    client = redis.Redis(port=port, socket_timeout=30)
    client.ping()
    client.close()


def test_a_row_stays_listed_and_a_skipped_drop_can_be_made_again(tmp_path, private_redis):
    """Before: while Redis did not answer, a row it alone held vanished from the listing; a drop that skipped
    Redis forgot the record, so the same drop made again once Redis was back dropped nothing and the prefix was
    served from Redis."""
    eng = tiered(tmp_path, ("redis",), "pg-rows", redis_url=private_redis.url)
    prompt = random_tokens(8 * 16 + 1, 74)
    run(eng, prompt, prefix_key="pk-r")
    assert eng.flush_tiers()
    eng.close()
    again = tiered(tmp_path, ("redis",), "pg-rows", redis_url=private_redis.url)
    assert [(r.prefix_key, r.tiers) for r in again.list_cached()] == [("pk-r", {"ram": 0, "redis": 128})]

    pause(private_redis.port, 4000)
    started = time.monotonic()
    assert [(r.prefix_key, r.tiers) for r in again.list_cached()] == [("pk-r", {"ram": 0, "redis": 0})]
    dropped = again.drop_cached(prefix_key="pk-r")
    assert "redis" in dropped["skipped_tiers"] and dropped["redis"] == 0
    assert time.monotonic() - started < 3.5  # all of it while Redis was paused
    wait_unpaused(private_redis.port)
    time.sleep(0.3)  # past the tier's retry_s

    assert [(r.prefix_key, r.tiers) for r in again.list_cached()] == [("pk-r", {"ram": 0, "redis": 128})]
    dropped = again.drop_cached(prefix_key="pk-r")
    assert dropped == {"prefixes": 1, "ram": 0, "redis": 8}, dropped
    assert again.list_cached() == []
    assert run(again, prompt).num_cached_tokens == 0
    again.close()


def test_a_record_in_use_is_written_down_again(tmp_path):
    """Its blocks are written down again each time the pool evicts them (their TTL renewed); a record written
    once expired with its level and took the row with it."""
    clock = FakeClock()
    eng = tiered(tmp_path, ("disk",), tier_clock=clock)
    prompt = random_tokens(4 * 16 + 1, 75)
    saves: list[str] = []
    real = eng.tiers.stack.save_record
    eng.tiers.stack.save_record = lambda rec: saves.append(rec.prefix_key) or real(rec)
    run(eng, prompt, prefix_key="pk-t")
    run(eng, prompt, prefix_key="pk-t")
    assert saves == ["pk-t"]  # new, then unchanged: not written again
    clock.advance(RECORD_REFRESH_S)
    run(eng, prompt, prefix_key="pk-t")
    assert saves == ["pk-t", "pk-t"]
    eng.close()


def test_a_tier_that_holds_nothing_of_a_prefix_costs_one_peek(tmp_path):
    """Listing asks the tiers in growing chunks (the dashboard lists every prefix on each refresh)."""
    eng = tiered(tmp_path, ("disk",))
    run(eng, random_tokens(8 * 16 + 1, 76), prefix_key="pk-ram")
    disk = eng.tiers.stack.tiers[0]
    asked: list[int] = []
    real = disk.peek_many
    disk.peek_many = lambda keys: asked.append(len(keys)) or real(keys)
    (row,) = eng.list_cached()
    assert row.tiers == {"ram": 128, "disk": 0} and asked == [1]
    assert eng.flush_tiers()  # every block written down: the copies of all 8 are counted
    asked.clear()
    (row,) = eng.list_cached()
    assert row.tiers == {"ram": 128, "disk": 128} and asked == [1, 4, 3]
    eng.close()
