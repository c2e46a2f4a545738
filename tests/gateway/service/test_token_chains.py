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


def _reference(tokens: list[int], block_size: int, root: bytes) -> list[bytes]:
    """The chain without any memo: BLAKE2b-128 of the parent and the block as uint32 little-endian."""
    import hashlib
    import struct

    out, parent = [], root
    for i in range(len(tokens) // block_size):
        block = struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


def test_memoized_steps_give_the_reference_chain(monkeypatch) -> None:
    import random

    import gateway.service.token_chains as chains

    monkeypatch.setattr(chains, "BLOCK_MEMO_ENTRIES", 7)  # cleared often: hits, misses and clears all met
    rng = random.Random(5)
    system = [rng.randrange(2**32) for _ in range(50)]
    for n in range(40):
        tokens = system + [rng.randrange(100_000) for _ in range(rng.randrange(0, 40))]
        root = (b"root-a", b"root-b")[n % 2]
        for block_size in (4, 16):
            assert chains.chain_hashes(tokens, block_size, root) == _reference(tokens, block_size, root)
        assert len(chains._BLOCK_MEMO) <= 7


def test_memo_is_scoped_by_root() -> None:
    """The same blocks under another root (model, tenant) give other hashes, memo or not."""
    tokens = list(range(64))
    a = chain_hashes(tokens, 16, b"tenant-a")
    b = chain_hashes(tokens, 16, b"tenant-b")
    assert not set(a) & set(b)
    assert chain_hashes(tokens, 16, b"tenant-a") == a
