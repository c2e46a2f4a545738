"""Tenant isolation through the tiers below the block pool (issue 14, "also for the disk and Redis tiers"):
entries written for tenant A are never found by tenant B's lookups (block keys and tier hits counted, on the
same engine and on a second engine sharing the tier), while A's own repeat is a tier hit; layered sharing's
public blocks *are* shared through a tier, its private blocks are not. Exact counts, no timing."""

from __future__ import annotations

import pytest

from engine.kv_tiers.entry import entry_meta
from tests.engine.engine_helpers import greedy, random_tokens
from tests.engine.tiers.test_engine_tiers import run, tiered

BS = 16


def demote(eng) -> None:
    """Write every cached block down to the tiers and drop it from the pool: the tiers now hold it alone."""
    assert eng.flush_tiers(write_cached=True)
    assert eng.kv.reset_prefix_cache()


def hits(eng, tier: str) -> int:
    return eng.tier_stats().get(f"{tier}.hit_tokens", 0)


def salts_in_tier(eng, tier: str) -> dict:
    """Entries per cache salt (the second extra key each entry claims; ``("shared", salt)`` for a layered
    request's public blocks) in one tier."""
    stack = eng.tiers.stack
    (store,) = [t for t in stack.tiers if t.name == tier]
    out: dict = {}
    for _, head in store.scan_heads():
        meta = entry_meta(head)
        assert meta is not None
        salt = (tuple(meta.extra_keys) + ("", ""))[1]
        salt = tuple(salt) if isinstance(salt, list | tuple) else salt
        out[salt] = out.get(salt, 0) + 1
    return out


def layered(eng, prompt, salt: str, public: int):
    eng.check_prompt(prompt, greedy(2))
    req = eng.add_checked_request(
        prompt, greedy(2), cache_salt=salt, shared_prefix_tokens=public, shared_salt="public"
    )
    eng.run_to_completion()
    return req


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_tenant_b_never_finds_tenant_a_entries_in_a_tier(tmp_path, redis_prefix, tier):
    eng = tiered(tmp_path, (tier,), redis_prefix)
    secret = random_tokens(200, 11)  # 12 full blocks; 12 usable ((200 - 1) // 16)
    run(eng, secret, cache_salt="tenant-a")
    demote(eng)
    assert salts_in_tier(eng, tier) == {"tenant-a": 12}
    # B's chain over the same tokens has other keys: the tier holds none of them
    b_hashes = eng.kv.block_hashes(secret, (eng.model_id, "tenant-b"))
    a_hashes = eng.kv.block_hashes(secret, (eng.model_id, "tenant-a"))
    assert not set(b_hashes) & set(a_hashes)
    assert eng.tiers.stack.presence(b_hashes)[tier] == (0, None)
    assert eng.tiers.stack.presence(a_hashes)[tier][0] == 12

    before = hits(eng, tier)
    b = run(eng, secret, cache_salt="tenant-b")
    assert b.num_cached_tokens == 0 and hits(eng, tier) == before
    eng.kv.reset_prefix_cache()  # B's blocks go (unwritten); A's prefix is still only in the tier
    a = run(eng, secret, cache_salt="tenant-a")
    assert a.num_cached_tokens == 12 * BS
    assert hits(eng, tier) - before == 12 * BS
    eng.kv.check_invariants()
    eng.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_second_engine_on_the_same_tier_keeps_tenants_apart(tmp_path, redis_prefix, tier):
    """What a second gateway of the deployment (or a restart) sees: the entries are shared, the salts hold."""
    first = tiered(tmp_path, (tier,), redis_prefix)
    secret = random_tokens(130, 12)  # 8 full blocks
    run(first, secret, cache_salt="tenant-a")
    first.close()  # writes its cached blocks down
    second = tiered(tmp_path, (tier,), redis_prefix)
    b = run(second, secret, cache_salt="tenant-b")
    assert b.num_cached_tokens == 0 and hits(second, tier) == 0
    assert second.tier_stats()[f"{tier}.miss_tokens"] >= BS
    a = run(second, secret, cache_salt="tenant-a")
    assert a.num_cached_tokens == 8 * BS and hits(second, tier) == 8 * BS
    second.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_layered_public_blocks_are_shared_through_a_tier_and_private_ones_are_not(
    tmp_path, redis_prefix, tier
):
    eng = tiered(tmp_path, (tier,), redis_prefix)
    public = random_tokens(64, 13)  # 4 public blocks
    a_prompt = public + random_tokens(40, 14)  # + 2 full private blocks of tenant a, 8 tokens over
    layered(eng, a_prompt, "tenant-a", len(public))
    demote(eng)
    assert salts_in_tier(eng, tier) == {("shared", "public"): 4, "tenant-a": 2}

    # tenant b sends a's exact prompt: only the 4 public blocks come back from the tier
    before = hits(eng, tier)
    b = layered(eng, a_prompt, "tenant-b", len(public))
    assert b.num_cached_tokens == 4 * BS and hits(eng, tier) - before == 4 * BS
    eng.kv.reset_prefix_cache()
    # a's own repeat: public and private blocks, all from the tier
    before = hits(eng, tier)
    a = layered(eng, a_prompt, "tenant-a", len(public))
    assert a.num_cached_tokens == 6 * BS and hits(eng, tier) - before == 6 * BS
    # a plain request of tenant a (no public declaration) hits nothing: other keys from block 0 on
    eng.kv.reset_prefix_cache()
    before = hits(eng, tier)
    assert run(eng, a_prompt, cache_salt="tenant-a").num_cached_tokens == 0
    assert hits(eng, tier) == before
    eng.kv.check_invariants()
    eng.close()
