"""Chained block hashing for the prefix cache.

A prompt is cut into full blocks of ``block_size`` tokens. Block ``i`` is keyed by

    hash_i = sha256(seed || parent || tokens_i || extra_keys),   parent = hash_{i-1} (none for block 0)

so a block's key depends on every token before it (the chain), on its own tokens and on the extra keys
(model id, cache salt / tenant, adapter) that isolate unrelated prompts. This is the scheme of vLLM v1's
``kv_cache_utils.hash_block_tokens``; we use sha256 over a canonical byte encoding (never Python's
``hash()``, which is neither stable across types nor collision resistant).

The seed is 16 random bytes drawn from ``os.urandom`` once per process, so block hashes cannot be predicted
(or collided on purpose) by a client, and are never comparable across processes. Anything shared across
processes (a Redis tier) must key by content, not by these hashes.

Only *full* blocks are hashed: a partial tail block can still change and is never cached.

Layered sharing: a request's extra keys may be a ``LayeredKeys``, which switches them once, at a block
boundary: its first ``shared_blocks`` blocks are keyed by the ``shared`` keys (a public prefix cached once for
every tenant: shared salt), every later block by the ``private`` keys (the tenant's salt). The chain runs on
across the switch, so a private block still depends on every token before it. ``block_extra_keys`` gives a
block's own keys; the KV cache manager stores and compares those per block.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes
"""32 bytes of sha256 output (a weak test hash may return any ``bytes``)."""

HashFn = Callable[[BlockHash | None, Sequence[int], tuple], BlockHash]
"""Signature of a block hash function: ``(parent hash or None, token ids of the block, extra keys) -> hash``."""


@dataclass(frozen=True)
class LayeredKeys:
    """Extra keys that switch at a block boundary: ``shared`` for blocks ``[0, shared_blocks)``, ``private``
    for every later block (see the module docstring).

    Attributes:
        shared: extra keys of the public prefix's blocks, e.g. ``(model_id, ("shared", salt))``.
        shared_blocks: full blocks of the public prefix (>= 0).
        private: extra keys of every later block, e.g. ``(model_id, tenant)``.
    """

    shared: tuple
    shared_blocks: int
    private: tuple

    def for_block(self, index: int) -> tuple:
        """The extra keys of block ``index`` (0-based)."""
        return self.shared if index < self.shared_blocks else self.private


ExtraKeys = tuple | LayeredKeys
"""A request's extra keys: one tuple for every block, or ``LayeredKeys``."""


def block_extra_keys(extra_keys: ExtraKeys, index: int) -> tuple:
    """The extra keys of block ``index`` of a request whose extra keys are ``extra_keys``."""
    if isinstance(extra_keys, LayeredKeys):
        return extra_keys.for_block(index)
    return tuple(extra_keys)


_SEED: bytes = os.urandom(16)

_TAG_NONE = b"N"
_TAG_STR = b"S"
_TAG_BYTES = b"B"
_TAG_INT = b"I"
_TAG_BOOL = b"T"
_TAG_FLOAT = b"F"
_TAG_TUPLE = b"U"


def _encode_key(value: object, out: bytearray) -> None:
    """Append a type-tagged, length-prefixed encoding of one extra key to ``out`` (injective per type)."""
    if value is None:
        out += _TAG_NONE
    elif isinstance(value, bool):
        out += _TAG_BOOL + (b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        raw = str(value).encode("ascii")
        out += _TAG_INT + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, float):
        out += _TAG_FLOAT + struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += _TAG_STR + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, bytes | bytearray):
        out += _TAG_BYTES + struct.pack("<I", len(value)) + bytes(value)
    elif isinstance(value, tuple | list):
        out += _TAG_TUPLE + struct.pack("<I", len(value))
        for item in value:
            _encode_key(item, out)
    else:
        raise TypeError(
            f"extra key of type {type(value).__name__} cannot be hashed; use str, bytes, int, float, bool, "
            "None or tuples of those"
        )


def _encode_extra_keys_uncached(extra_keys: tuple) -> bytes:
    out = bytearray()
    _encode_key(tuple(extra_keys), out)
    return bytes(out)


_encode_extra_keys_cached = functools.lru_cache(maxsize=4096)(_encode_extra_keys_uncached)


def encode_extra_keys(extra_keys: tuple) -> bytes:
    """Canonical bytes of ``extra_keys`` (memoized: the same few tuples recur for every block).

    Raises:
        TypeError: an extra key is not a str, bytes, int, float, bool, None or tuple/list of those.
    """
    try:
        return _encode_extra_keys_cached(tuple(extra_keys))
    except TypeError:  # unhashable: encode without the memo (raises a clear TypeError if unsupported)
        return _encode_extra_keys_uncached(tuple(extra_keys))


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian signed 64-bit integers, prefixed by their count.

    Raises:
        TypeError: a token id is not an int.
        OverflowError: a token id does not fit in 64 bits.
    """
    packed = array("q", token_ids)
    if packed.itemsize != 8:  # pragma: no cover - 'q' is 8 bytes on every CPython platform
        raise RuntimeError("array('q') is not 64-bit on this platform")
    return struct.pack("<I", len(packed)) + packed.tobytes()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple) -> BlockHash:
    """Hash of one full block, chained on its parent's hash.

    Args:
        parent: hash of the previous block of the same prompt, or None for the first block.
        token_ids: the block's token ids (``block_size`` of them).
        extra_keys: keys that isolate unrelated prompts: model id, cache salt (tenant), adapter.

    Returns:
        32 bytes: sha256(process seed, parent, token ids, extra keys) over a canonical encoding.

    Raises:
        TypeError: a token id or extra key has an unsupported type.
    """
    h = hashlib.sha256(_SEED)
    if parent is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + struct.pack("<I", len(parent)) + parent)
    h.update(encode_token_ids(token_ids))
    h.update(encode_extra_keys(tuple(extra_keys)))
    return h.digest()


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys,
    hash_fn: HashFn = hash_block,
    parent: BlockHash | None = None,
    first_block: int = 0,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids`` (a partial tail block gets none).

    Args:
        token_ids: the prompt (or prompt + output) token ids.
        block_size: tokens per block (> 0).
        extra_keys: model id, cache salt, ...: one tuple mixed into every block, or ``LayeredKeys``.
        hash_fn: the block hash function (tests swap in a weak one to force collisions).
        parent: hash of the block before ``token_ids[0]`` when hashing a continuation; None from the start.
        first_block: index of the block ``token_ids[0]`` starts (for ``LayeredKeys``); 0 from the start.

    Returns:
        ``len(token_ids) // block_size`` hashes; element i keys tokens ``[i*block_size, (i+1)*block_size)``.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for n, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        keys = block_extra_keys(extra_keys, first_block + n)
        parent = hash_fn(parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)
    return hashes


def block_hasher(
    block_size: int, extra_keys: ExtraKeys, hash_fn: HashFn = hash_block
) -> Callable[..., list[BlockHash]]:
    """``hash_request_blocks`` with the block size, extra keys and hash function bound: the ``BlockHasher``
    one request extends its ``block_hashes`` with, ``(whole-block token ids, parent hash or None) -> hashes``
    (an optional third argument: the index of the first of those blocks, 0 by default, for ``LayeredKeys``;
    a request extending its hashes past its prompt binds ``block_extra_keys(keys, index)`` instead).
    """
    return lambda tokens, parent, first_block=0: hash_request_blocks(
        tokens, block_size, extra_keys, hash_fn, parent, first_block
    )
