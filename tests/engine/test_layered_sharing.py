"""Layered cache salts (``LayeredKeys``): a declared public prefix is cached once for every tenant, each
tenant's blocks after it stay its own."""

from __future__ import annotations

from engine.block_hash import LayeredKeys, block_extra_keys, hash_request_blocks
from engine.kv_cache_manager import KVCacheManager

BS = 4
SHARED = ("m", ("shared", "segment:1"))


def tenant(name: str, shared_blocks: int = 2) -> LayeredKeys:
    return LayeredKeys(SHARED, shared_blocks, ("m", name))


def run(m: KVCacheManager, rid: str, prompt: list[int], keys) -> int:
    """Look up, allocate, compute and cache ``prompt``; return the hit in tokens."""
    hashes = m.block_hashes(prompt, keys)
    hit = m.find_cached_prefix(prompt, hashes[: (len(prompt) - 1) // BS], keys)
    assert m.allocate(rid, len(prompt), hit) is not None
    m.cache_full_blocks(rid, prompt, len(prompt), hashes, keys)
    return hit.num_tokens


def test_block_keys_switch_once_at_the_boundary():
    keys = tenant("a")
    assert [block_extra_keys(keys, i) for i in range(4)] == [SHARED, SHARED, ("m", "a"), ("m", "a")]
    tokens = list(range(16))
    whole = hash_request_blocks(tokens, BS, keys)
    # hashing a continuation from block 2 on gives the same chain (the index picks the keys)
    assert hash_request_blocks(tokens[8:], BS, keys, parent=whole[1], first_block=2) == whole[2:]
    # the shared blocks hash alike for every tenant; the private ones do not
    other = hash_request_blocks(tokens, BS, tenant("b"))
    assert other[:2] == whole[:2] and not set(other[2:]) & set(whole[2:])


def test_public_prefix_is_computed_once_and_private_suffixes_never_leak():
    m = KVCacheManager(num_blocks=64, block_size=BS)
    public = list(range(100, 108))  # two blocks
    a_prompt = public + [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert run(m, "a1", a_prompt, tenant("a")) == 0
    # tenant b: the public blocks hit, a's private blocks (same tokens) do not
    assert run(m, "b1", a_prompt, tenant("b")) == 8
    # a's own repeat hits everything up to its last token's block
    assert run(m, "a2", a_prompt, tenant("a")) == 16
    # a plain (non-layered) request of tenant a does not hit the public blocks: another salt
    assert run(m, "a3", a_prompt, ("m", "a")) == 0
    shared_ids = m.block_table("a1")[:2]
    assert m.block_table("b1")[:2] == shared_ids and m.block_table("a2")[:2] == shared_ids
    assert not set(m.block_table("b1")[2:]) & set(m.block_table("a1")[2:])
    # 256 tenants: the public prefix stays two blocks
    for i in range(256):
        assert run(m, f"t{i}", public + [i % 7] * 4 + [0], tenant(f"t{i}")) == 8
        m.free(f"t{i}")
    m.check_invariants()
