"""The result of one prefix lookup (``PrefixHit``, vLLM v1's ``KVCacheBlocks``) and its error.

A hit is a chain of whole cached blocks and, optionally, a *partial* part: the first ``partial_tokens`` slots
of one more cached block (a full entry or a partial entry with the same parent) that ``allocate`` copies into
a fresh block of the request (copy-on-write; the source is never written).

Callers of ``engine.kv_cache_manager`` see a hit's block ids, hashes and counts, never a ``KVBlock``, so the
pool's internals stay private to the manager and ``block_pool``. A ``PrefixHit`` is valid until the next call
that can evict (``allocate``, ``append_slots``, ``reset_prefix_cache``); ``allocate`` checks it and raises
``StaleCacheHitError`` rather than serve a block that was evicted in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.block_hash import BlockHash
from engine.block_pool import KVBlock


class BlockIdentity(Protocol):
    """What identifies a block's content (``engine.kv_tiers.entry.BlockMeta`` is one)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple


class StaleCacheHitError(ValueError):
    """A ``PrefixHit`` given to ``allocate`` / ``can_allocate`` names a block no longer that cache entry.

    Raised before any change. Call ``find_cached_prefix`` again right before ``allocate``.
    """


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The result of one prefix lookup: the cached blocks serving a prompt's first ``num_tokens`` tokens.

    Built only by ``KVCacheManager.find_cached_prefix``; pass it unchanged (or its ``whole_blocks()``) to
    ``allocate`` / ``can_allocate``.
    Holders read block ids, hashes and counts; the blocks themselves stay private (``_blocks``).
    """

    _blocks: tuple[KVBlock, ...] = ()
    num_tokens: int = 0
    """Tokens served by the hit: ``num_blocks * block_size + partial_tokens``."""
    _partial: KVBlock | None = None
    _partial_gen: int | None = None
    partial_tokens: int = 0
    """Leading slots of ``_partial`` served by the hit (0 without a partial part; < block_size)."""

    @property
    def num_blocks(self) -> int:
        """Whole hit blocks (the partial part not counted)."""
        return len(self._blocks)

    @property
    def block_ids(self) -> list[int]:
        """Physical block ids of the hit, in token order."""
        return [b.block_id for b in self._blocks]

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Block hashes of the hit, in token order."""
        return [b.block_hash for b in self._blocks]

    @property
    def last_block_id(self) -> int | None:
        """Physical id of the hit's last block (where the cached prefix ends), or None for no hit."""
        return self._blocks[-1].block_id if self._blocks else None

    @property
    def partial_block_id(self) -> int | None:
        """Physical id of the block the partial part is copied from, or None."""
        return self._partial.block_id if self._partial is not None else None

    def whole_blocks(self) -> PrefixHit:
        """The same hit without its partial part (when holding the copy's source leaves too few blocks)."""
        if self._partial is None:
            return self
        return PrefixHit(self._blocks, self.num_tokens - self.partial_tokens)

    def __len__(self) -> int:
        """Whole hit blocks (as ``num_blocks``)."""
        return len(self._blocks)


NO_HIT = PrefixHit()
"""The empty lookup result (a new prompt, caching off)."""
