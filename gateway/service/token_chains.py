"""Block-chain hashes and common-prefix lengths over prompt token ids.

Owns ``chain_hashes`` (the identity of a prompt's full blocks, as the paged KV cache sees them) and
``common_tokens`` (the length of the shared token prefix of two prompts). Invariants: a chain hash is
BLAKE2b-128 of its parent hash and the block's tokens as uint32 little-endian, so equal hashes mean equal
prefixes under the same root; ``common_tokens`` compares array slices (binary search), never token by token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_hashes(tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """BLAKE2b-128 chain hash of every full block: ``h[i] = H(h[i-1] || tokens of block i as uint32 LE)``,
    ``h[-1] = root``. Shape: ``len(tokens) // block_size`` digests of 16 bytes.

    Each step's digest is memoized by its input (``_BLOCK_MEMO``): a prompt's explanation and its marking as
    cached hash the same blocks, and a repeated system prompt's blocks recur in every request of its key. The
    input holds the parent hash, which holds the root (model and tenant), so a step only ever meets the
    memo entries of prompts with the same root and the same tokens before it."""
    out: list[bytes] = []
    parent = root
    data = array("I", tokens)
    if data.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit on this platform")
    raw = data.tobytes()
    width = 4 * block_size
    memo = _BLOCK_MEMO
    for i in range(len(tokens) // block_size):
        step = parent + raw[i * width : (i + 1) * width]
        digest = memo.get(step)
        if digest is None:
            digest = hashlib.blake2b(step, digest_size=16).digest()
            if len(memo) >= BLOCK_MEMO_ENTRIES:
                memo.clear()
            memo[step] = digest
        parent = digest
        out.append(parent)
    return out


BLOCK_MEMO_ENTRIES = 8_192
"""Chain steps kept by ``chain_hashes`` (cleared when full): ~200 bytes each with 16-token blocks, ~1.6 MB."""
_BLOCK_MEMO: dict[bytes, bytes] = {}
"""(parent hash || block tokens) -> the block's chain hash; a pure function's results (docs/overhead.md,
session 9)."""


def common_tokens(a: array, b: array, start: int) -> int:
    """How many tokens from ``start`` on are equal in both (binary search over slice compares)."""
    lo, hi = 0, max(0, min(len(a), len(b)) - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[start : start + mid] == b[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
