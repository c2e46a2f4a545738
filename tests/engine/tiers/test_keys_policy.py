"""The deployment-keyed block hash (stable across processes, secret-dependent) and per-level policies."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_hash import hash_block
from engine.kv_tiers.keys import keyed_block_hash, load_or_create_secret
from engine.kv_tiers.policy import LEVELS, TierPolicies, TierPolicy, level_of_blocks

SECRET = b"s" * 32


def test_keyed_hash_is_stable_across_processes_and_depends_on_the_secret():
    fn = keyed_block_hash(SECRET)
    h = fn(None, [1, 2, 3, 4], ("m", "t"))
    code = (
        "from engine.kv_tiers.keys import keyed_block_hash;"
        f"print(keyed_block_hash({SECRET!r})(None, [1, 2, 3, 4], ('m', 't')).hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == h.hex()
    assert keyed_block_hash(b"t" * 32)(None, [1, 2, 3, 4], ("m", "t")) != h
    assert hash_block(None, [1, 2, 3, 4], ("m", "t")) != h  # the per-process seed is not the secret
    assert fn(h, [1, 2, 3, 4], ("m", "t")) != h and fn(None, [1, 2, 3, 4], ("m", "u")) != h


def test_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        keyed_block_hash(b"short")


def test_secret_file_is_made_once_and_kept(tmp_path):
    a = load_or_create_secret(tmp_path / "d")
    assert len(a) == 32 and load_or_create_secret(tmp_path / "d") == a
    assert (tmp_path / "d" / "deployment-secret").stat().st_mode & 0o777 == 0o600
    assert load_or_create_secret(tmp_path / "e") != a


def test_a_block_shared_by_levels_keeps_the_longest_policy():
    p = TierPolicies({"disk": {"history": TierPolicy(60.0, 0.2), "system": TierPolicy(None, 0.4)}})
    assert p.resolve("disk", {"history", "documents"}) == ("documents", p.policy("disk", "documents"))
    assert p.resolve("disk", {"history", "system"})[0] == "system"  # no TTL is the longest
    assert p.resolve("disk", set()) == ("history", TierPolicy(60.0, 0.2))
    assert p.resolve("redis", {"history"})[1].ttl_s == 600.0  # the default policy of that level


def test_policies_are_checked():
    with pytest.raises(ValueError, match="sum to"):
        TierPolicies({"disk": {lv: TierPolicy(1.0, 0.5) for lv in LEVELS}})
    with pytest.raises(ValueError, match="unknown level"):
        TierPolicies({"disk": {"tools": TierPolicy(1.0, 0.1)}})
    with pytest.raises(ValueError, match="ttl_s"):
        TierPolicy(0.0, 0.1)
    with pytest.raises(ValueError, match="budget_share"):
        TierPolicy(1.0, 0.0)


def test_level_of_blocks():
    got = level_of_blocks(5, 4, [(6, "system"), (12, "documents")], "history")
    assert got == [
        {"system"},
        {"system", "documents"},
        {"documents"},
        {"history"},
        {"history"},
    ]
    assert level_of_blocks(2, 4, None, "history") == [{"history"}, {"history"}]
    with pytest.raises(ValueError, match="unknown level"):
        level_of_blocks(1, 4, [(4, "tools")], "history")
    with pytest.raises(ValueError, match="increase"):
        level_of_blocks(1, 4, [(4, "system"), (2, "documents")], "history")


def test_shares_over_one_name_the_defaults_that_make_up_the_rest():
    """Before: ``budget shares sum to 1.500 > 1`` for ``system: 0.9`` alone, without saying that documents and
    history keep their default shares (0.35, 0.25)."""
    with pytest.raises(ValueError) as e:
        TierPolicies({"disk": {"system": TierPolicy(None, 0.9)}})
    assert str(e.value) == (
        "tier 'disk': budget shares sum to 1.500 > 1 (system 0.9, documents 0.35 (default), history 0.25 "
        "(default)); levels not set keep their default share, so lower the shares or set documents, history too"
    )
