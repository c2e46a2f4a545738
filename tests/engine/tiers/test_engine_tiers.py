"""The engine with tiers, on the tiny checkpoint: spill and load-back give the logits of a run that never
evicted; a restarted engine loads instead of prefilling (exact cached-token counts); two engines share one
Redis; TTLs expire per level on an injected clock; byte budgets hold under a flood; pins hold; an unreachable
Redis costs no request."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.errors import PinCapError
from engine.kv_tiers.config import entry_nbytes
from engine.kv_tiers.disk import EMPTY_LEVEL_BYTES, TierConfigError
from engine.kv_tiers.policy import TierPolicies, TierPolicy
from engine.kv_tiers.settings import DiskTierConfig, RedisTierConfig
from tests.engine.engine_helpers import greedy, make_engine, random_tokens
from tests.engine.tiers.conftest import REDIS_URL, FakeClock, free_port

SECRET = "engine-tier-tests-secret-0123456789"
N_NEW = 4


def tiered(tmp_path, tiers=("disk",), redis_prefix="pg-unused", **kw):
    kw.setdefault("num_blocks", 64)
    return make_engine(
        tiers=tiers,
        tier_disk=DiskTierConfig(str(tmp_path / "disk"), kw.pop("disk_budget", 1 << 26)),
        tier_redis=RedisTierConfig(
            url=kw.pop("redis_url", REDIS_URL), prefix=redis_prefix, budget_bytes=1 << 26
        ),
        deployment_secret=SECRET,
        record_logits=True,
        **kw,
    )


def reference(prompt, n_new=N_NEW):
    eng = make_engine(enable_prefix_caching=False, record_logits=True, max_num_batched_tokens=4096)
    req = eng.add_request(prompt, greedy(n_new))
    eng.run_to_completion()
    return req.output_token_ids, torch.stack(eng.logits_log[req.request_id])


def assert_logits_close(got, ref):
    """Within 1e-5 of the reference's magnitude: fp32 GEMMs round differently with the number of rows."""
    torch.testing.assert_close(got, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)


def run(eng, prompt, n_new=N_NEW, **kw):
    req = eng.add_request(prompt, greedy(n_new), **kw)
    eng.run_to_completion()
    return req


def test_spill_and_load_back_give_the_logits_of_a_run_that_never_evicted(tmp_path):
    eng = tiered(tmp_path, num_blocks=40)
    base = random_tokens(300, 1)
    run(eng, base)
    for seed in (2, 3, 4):  # 19 blocks each in a 40-block pool: base's blocks are evicted and written down
        run(eng, random_tokens(300, seed))
    assert eng.tier_stats()["writeback.queued"] > 0
    eng.flush_tiers()
    prompt = base[:288] + random_tokens(20, 9)
    req = run(eng, prompt)
    assert req.num_cached_tokens == 288  # 18 blocks, all from the disk tier
    assert eng.tier_stats()["disk.hit_tokens"] == 288
    ref_tokens, ref_logits = reference(prompt)
    assert req.output_token_ids == ref_tokens
    assert_logits_close(torch.stack(eng.logits_log[req.request_id]), ref_logits)
    eng.kv.check_invariants()
    eng.close()


def test_a_tier_read_that_ends_after_the_step_gave_up_waiting_is_not_a_stuck_scheduler(tmp_path):
    # on a loaded machine the step's wait for a tier read can time out and the read finish just after the
    # scheduler looked again: the step produced nothing, yet the request runs next step
    first = tiered(tmp_path, num_blocks=40)
    base = random_tokens(200, 5)
    run(first, base)
    first.close()  # writes its cached blocks down
    eng = tiered(tmp_path, num_blocks=40)
    eng.prefetch_wait_s = 0.0
    schedule = eng.scheduler.schedule
    lookup = eng.tiers.stack.lookup
    release = threading.Event()
    calls = []

    def gated_lookup(metas):  # the read cannot end before the step's second look, however fast the disk is
        assert release.wait(30.0)
        return lookup(metas)

    def schedule_then_read_finishes():
        sched = schedule()
        calls.append(sched.is_empty)
        if len(calls) == 2:  # the step's second look (after its wait) found nothing: the read ends now
            release.set()
            eng.tiers.wait_pending(30.0)
        return sched

    eng.tiers.stack.lookup = gated_lookup

    eng.scheduler.schedule = schedule_then_read_finishes
    req = run(eng, base[:192] + random_tokens(10, 6))
    assert calls[:2] == [True, True]  # the read was pending at both looks of the first step
    assert req.num_cached_tokens == 192 and len(req.output_token_ids) == N_NEW
    eng.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_restarted_engine_loads_instead_of_prefilling(tmp_path, redis_prefix, tier):
    first = tiered(tmp_path, (tier,), redis_prefix)
    base = random_tokens(200, 5)
    run(first, base)
    first.close()  # writes its cached blocks down
    second = tiered(tmp_path, (tier,), redis_prefix)
    prompt = base[:192] + random_tokens(10, 6)
    req = run(second, prompt)
    assert req.num_cached_tokens == 192
    stats = second.stats()
    assert stats.prefill_tokens == len(prompt) - 192
    assert second.tier_stats()[f"{tier}.hit_tokens"] == 192
    ref_tokens, ref_logits = reference(prompt)
    assert req.output_token_ids == ref_tokens
    assert_logits_close(torch.stack(second.logits_log[req.request_id]), ref_logits)
    second.close()


def test_a_restart_serves_the_head_of_a_prompt_longer_than_the_disk_tier(tmp_path):
    """The fresh-user trial's case, scaled down: a disk tier whose level holds fewer blocks than the cached
    prompt. Before: the shutdown wrote the chain head first, the tier kept its tail, and after the restart the
    same request got ``cached=0`` (block 0 missing) while the tier was full."""
    probe = tiered(tmp_path / "probe")
    entry = entry_nbytes(probe.tiers.stack.layout)
    probe.close()
    budget = (EMPTY_LEVEL_BYTES + 8 * entry) * 4  # the history level (a quarter) holds about 8 entries
    prompt = random_tokens(20 * 16 + 1, 13)  # 20 whole blocks
    first = tiered(tmp_path, disk_budget=budget)
    run(first, prompt)
    first.close()  # the write-down of every cached block
    second = tiered(tmp_path, disk_budget=budget)
    disk = second.tiers.stack.tiers[0]
    kept = sum(1 for _ in disk.keys())
    assert 0 < kept < 20
    req = run(second, prompt)
    assert req.num_cached_tokens == kept * 16 == second.tier_stats()["disk.hit_tokens"]
    second.close()


def test_two_engines_on_one_redis(tmp_path, redis_prefix):
    a = tiered(tmp_path / "a", ("redis",), redis_prefix)
    b = tiered(tmp_path / "b", ("redis",), redis_prefix)
    base = random_tokens(130, 7)
    run(a, base)
    a.flush_tiers()  # A writes what it holds; it keeps serving
    req = run(b, base[:128] + random_tokens(5, 8))
    assert req.num_cached_tokens == 128 and b.tier_stats()["redis.hit_tokens"] == 128
    other_tenant = run(b, base[:128] + random_tokens(5, 8), cache_salt="tenant-b")
    assert other_tenant.num_cached_tokens == 0  # another tenant's chain hashes differ
    a.close()
    b.close()


def test_ttl_expires_per_level_on_the_injected_clock(tmp_path):
    clock = FakeClock()
    policies = TierPolicies({"disk": {"system": TierPolicy(86_400.0, 0.4), "history": TierPolicy(60.0, 0.2)}})
    kw = dict(tier_policies=policies, tier_clock=clock)
    first = tiered(tmp_path, **kw)
    prompt = random_tokens(130, 11)
    run(first, prompt, level_ends=[(64, "system")])  # blocks 0-3 system, the rest history
    first.close()
    clock.advance(61)
    second = tiered(tmp_path, **kw)
    req = run(second, prompt[:128] + random_tokens(3, 12))
    assert req.num_cached_tokens == 64  # history blocks expired, system blocks kept
    assert second.tier_stats()["disk.expired.history"] == 1  # the walk stops at the first expired block
    second.close()


def test_disk_budget_holds_under_a_flood(tmp_path):
    budget = 600_000
    eng = tiered(tmp_path, num_blocks=24, disk_budget=budget)
    for seed in range(30):
        run(eng, random_tokens(120, 100 + seed), n_new=1)
    eng.flush_tiers()
    disk = eng.tiers.stack.tiers[0]
    for level in ("system", "documents", "history"):
        assert disk.level_bytes(level) <= disk.level_limit(level)
    assert eng.tier_stats()["disk.evicted"] > 0
    eng.close()


def test_pins_hold_and_are_capped(tmp_path):
    eng = tiered(tmp_path, num_blocks=32, max_pinned_fraction=0.25)
    system = random_tokens(129, 21)
    warm = eng.warm(system, pin=True)
    assert warm.cached_tokens == 128 and warm.pinned_blocks == 8
    for seed in range(6):  # flood the pool: pinned blocks are never evicted
        run(eng, random_tokens(150, 300 + seed), n_new=1)
    req = run(eng, system[:128] + random_tokens(4, 22))
    assert req.num_cached_tokens == 128 and eng.tier_stats().get("disk.hit_tokens", 0) == 0  # from RAM
    with pytest.raises(PinCapError):
        eng.warm(random_tokens(40, 23), pin=True)  # 8 + 2 blocks > 25% of 32
    eng.unpin(warm.pin_id)
    eng.kv.check_invariants()
    eng.close()


def test_unreachable_redis_costs_no_request(tmp_path):
    eng = tiered(tmp_path, ("redis",), redis_url=f"redis://127.0.0.1:{free_port()}/0", num_blocks=24)
    for seed in range(4):
        req = run(eng, random_tokens(120, 400 + seed))
        assert req.num_output_tokens == N_NEW
    eng.flush_tiers()
    stats = eng.tier_stats()
    assert stats.get("redis.writes", 0) == 0 and stats["redis.skipped_down"] > 0
    eng.close()


def test_tier_misconfiguration_stops_the_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TierConfigError) as e:
        make_engine(tiers=("disk",), tier_disk=DiskTierConfig(str(blocker / "d")), deployment_secret=SECRET)
    assert e.value.key == "engine.tier_disk.directory"
    with pytest.raises(TierConfigError) as e:
        make_engine(tiers=("redis",), tier_redis=RedisTierConfig(url="nope://"), deployment_secret=SECRET)
    assert e.value.key == "engine.tier_redis.url"
    with pytest.raises(TierConfigError) as e:
        make_engine(tiers=("redis",))
    assert e.value.key == "engine.deployment_secret"
    with pytest.raises(TierConfigError) as e:
        make_engine(tiers=("tape",), deployment_secret=SECRET)
    assert e.value.key == "engine.tiers"
    with pytest.raises(TierConfigError) as e:  # before: accepted, and the tiers never saw a block
        tiered(tmp_path, enable_prefix_caching=False)
    assert e.value.key == "engine.tiers" and "enable_prefix_caching" in e.value.reason


@pytest.mark.parametrize("tiers", [("disk",), ("redis",), ("disk", "redis")])
def test_a_restarted_engine_lists_and_drops_by_prefix_key_what_its_tiers_kept(tmp_path, redis_prefix, tiers):
    """Before: the prefix catalog lived in memory only, so after a restart ``list_cached`` was empty and
    ``drop_cached(prefix_key=...)`` dropped nothing while the tiers still served the prefix. The records are
    now kept in the tiers beside their blocks and read back at start."""
    eng = tiered(tmp_path, tiers, redis_prefix)
    system = random_tokens(130, 41)
    eng.warm(system, cache_salt="t1", prefix_key="pk-a")
    run(eng, random_tokens(70, 42), cache_salt="t2", prefix_key="pk-b")
    before = {r.prefix_key: (r.tenant, r.tokens, r.level) for r in eng.list_cached()}
    assert set(before) == {"pk-a", "pk-b"}
    assert eng.flush_tiers()
    eng.close()

    again = tiered(tmp_path, tiers, redis_prefix)  # a restart: an empty pool, the same tiers
    rows = {r.prefix_key: r for r in again.list_cached()}
    assert {k: (r.tenant, r.tokens, r.level) for k, r in rows.items()} == before
    assert rows["pk-a"].tiers["ram"] == 0 and all(rows["pk-a"].tiers[t] == 128 for t in tiers)
    assert run(again, system[:128] + random_tokens(3, 43), cache_salt="t1").num_cached_tokens == 128
    dropped = again.drop_cached(prefix_key="pk-a")
    assert dropped["prefixes"] == 1 and all(dropped[t] == 8 for t in tiers), dropped
    assert run(again, system[:128] + random_tokens(3, 44), cache_salt="t1").num_cached_tokens == 0
    assert again.flush_tiers()
    again.close()

    third = tiered(tmp_path, tiers, redis_prefix)  # a dropped prefix stays dropped
    assert [r.prefix_key for r in third.list_cached()] == ["pk-b"]
    third.close()


def test_the_records_kept_down_are_bounded_by_the_catalog(tmp_path, redis_prefix):
    """A record the catalog's bound pushes out is forgotten in the tiers too: a start never reads more."""
    eng = tiered(tmp_path, ("disk", "redis"), redis_prefix)
    eng.catalog.max_entries = 2
    for i in range(3):
        eng.warm(random_tokens(40, 60 + i), cache_salt="t", prefix_key=f"pk-{i}")
    assert eng.flush_tiers()
    assert [r.prefix_key for r in eng.tiers.stack.load_records(eng.model_id)] == ["pk-1", "pk-2"]
    eng.close()
    again = tiered(tmp_path, ("disk", "redis"), redis_prefix)
    assert sorted(r.prefix_key for r in again.list_cached()) == ["pk-1", "pk-2"]
    again.close()


def test_list_and_drop_cached_prefixes(tmp_path, redis_prefix):
    eng = tiered(tmp_path, ("disk", "redis"), redis_prefix)
    system = random_tokens(130, 31)
    w = eng.warm(system, cache_salt="t1", prefix_key="pk-1")
    assert (w.prefix_key, w.cached_tokens, w.pin_id) == ("pk-1", 128, None)
    run(eng, random_tokens(100, 32), cache_salt="t2", prefix_key="pk-2", level_ends=[(64, "documents")])
    rows = {r.prefix_key: r for r in eng.list_cached()}
    assert rows["pk-1"].tiers == {"ram": 128, "disk": 0, "redis": 0} and rows["pk-1"].tenant == "t1"
    assert rows["pk-2"].tokens == 64 and rows["pk-2"].level == "documents"
    eng.flush_tiers()
    (one,) = eng.list_cached(tenant="t1")
    assert one.tiers == {"ram": 128, "disk": 128, "redis": 128} and one.expires_at["disk"] is not None
    assert not one.pinned and one.model_id == eng.model_id
    # RAM: the 8 whole blocks and the partial entry of the warm's last 2 tokens, chained on the 8th
    assert eng.drop_cached(prefix_key="pk-1") == {"prefixes": 1, "ram": 9, "disk": 8, "redis": 8}
    assert run(eng, system[:128] + random_tokens(3, 33), cache_salt="t1").num_cached_tokens == 0
    dropped = eng.drop_cached(tenant="t2")
    assert dropped["prefixes"] == 1 and dropped["ram"] >= 6 and dropped["disk"] >= 4 and dropped["redis"] >= 4
    assert [r.prefix_key for r in eng.list_cached()] == []
    with pytest.raises(ValueError, match="give a prefix key"):
        eng.drop_cached()
    eng.kv.check_invariants()
    eng.close()


async def test_async_engine_warms_pins_and_flushes_at_shutdown(tmp_path):
    from engine.api import GenerationRequest, SamplingParams
    from engine.async_engine import AsyncEngine
    from tests.engine.engine_helpers import tiny_checkpoint

    core = tiered(tmp_path)
    eng = AsyncEngine(core, tiny_checkpoint().tokenizer)
    system = [{"role": "system", "content": "You are a cache test. " * 12}]
    w = await eng.warm(GenerationRequest(messages=system, prefix_key="sys"), pin=True)
    assert w.cached_tokens >= 64 and w.pinned_blocks == w.cached_tokens // 16 and w.pin_id
    assert eng.stats().pinned_blocks == w.pinned_blocks
    (row,) = eng.list_cached(prefix_key="sys")
    assert row.pinned and row.tiers["ram"] == w.cached_tokens
    messages = system + [{"role": "user", "content": "hello"}]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    events = [e async for e in eng.generate(GenerationRequest(messages=messages, params=params))]
    assert events[-1].usage.cached_tokens > 0
    assert eng.unpin(w.pin_id) and not eng.list_cached(prefix_key="sys")[0].pinned
    await eng.shutdown()
    assert core.tiers is None  # closed: cached blocks were written down
    again = tiered(tmp_path)
    req = run(again, eng.render_chat(messages))
    assert req.num_cached_tokens > 0 and again.tier_stats()["disk.hit_tokens"] == req.num_cached_tokens
    again.close()
