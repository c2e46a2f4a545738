"""Block-chain hashes: one per full block, rooted, equal exactly when the prefix is equal."""

from __future__ import annotations

from gateway.service.token_chains import chain_hashes


def test_chain_hashes_shape_and_rooting() -> None:
    a = chain_hashes(list(range(40)), 16, b"root-a")
    assert len(a) == 2 and all(len(h) == 16 for h in a)
    assert chain_hashes(list(range(40)), 16, b"root-b")[0] != a[0]
    assert chain_hashes(list(range(32)) + [0] * 8, 16, b"root-a") == a
    assert chain_hashes([0] + list(range(1, 40)), 16, b"root-a") == a
    assert chain_hashes([99] + list(range(1, 40)), 16, b"root-a")[1] != a[1]
