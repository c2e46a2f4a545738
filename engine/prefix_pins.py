"""Pins: prefixes held in the RAM pool on request (``/admin/cache`` warm with ``pin``), owned by the KV cache
manager (``engine.kv_cache_manager``, invariant 6).

Owns the pin table: pin id -> the blocks of the prefix hit it pinned. Invariants: a pin holds exactly one
reference on each of its blocks, like a request's block table, so a pinned block is never evicted; all pins
together hold at most ``max_blocks`` blocks (a block in two pins counts twice; ``engine.prefix_admin`` keeps one
pin per listed prefix, so a prefix warmed with ``pin`` again reuses or replaces its pin); ``unpin`` releases tail
first.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.block_pool import BlockPool, KVBlock
from engine.errors import PinCapError
from engine.prefix_chain import check_chain
from engine.prefix_hit import PrefixHit


class PrefixPins:
    """The pin table of one block pool.

    Args:
        pool: the pool whose blocks are pinned.
        max_blocks: most blocks all pins may hold (the engine sets ``max_pinned_fraction`` of the pool).
    """

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self._pins: dict[str, list[KVBlock]] = {}

    @property
    def blocks_held(self) -> int:
        """Blocks held by pins (a block in two pins counts twice)."""
        return sum(len(b) for b in self._pins.values())

    def distinct_block_ids(self) -> set[int]:
        """Ids of the blocks pins hold (each once, however many pins hold it)."""
        return {block.block_id for blocks in self._pins.values() for block in blocks}

    def tables(self) -> Iterator[list[KVBlock]]:
        """Each pin's blocks, in order (invariant checks)."""
        return iter(self._pins.values())

    def check_room(self, num_blocks: int) -> None:
        """Raise ``PinCapError`` unless ``num_blocks`` more blocks could be pinned now."""
        if self.blocks_held + num_blocks > self.max_blocks:
            raise PinCapError(num_blocks, self.blocks_held, self.max_blocks)

    def blocks_of(self, pin_id: str | None) -> list[KVBlock] | None:
        """The blocks pin ``pin_id`` holds, in order (None when there is no such pin)."""
        return None if pin_id is None else self._pins.get(pin_id)

    def pin(self, pin_id: str, hit: PrefixHit, replaces: str | None = None) -> int:
        """Hold the blocks of ``hit`` (a prefix found this step) under ``pin_id``: they stay in RAM until
        ``unpin``. With ``replaces``, that pin is released once the new one holds its blocks (a block in both
        is never unreferenced between them), and the cap counts the new pin in its place.

        Returns:
            Blocks pinned.

        Raises:
            ValueError: ``pin_id`` already in use.
            StaleCacheHitError: ``hit`` names a block evicted since it was found.
            PinCapError: the pins would hold more than ``max_blocks`` blocks (nothing pinned, nothing released).
        """
        check_chain(self.pool, hit._blocks)
        if pin_id in self._pins:
            raise ValueError(f"pin {pin_id!r} already exists")
        old = self._pins.get(replaces) if replaces is not None else None
        self.check_room(hit.num_blocks - (len(old) if old is not None else 0))
        blocks = list(hit._blocks)
        self.pool.touch(blocks)
        self._pins[pin_id] = blocks
        if old is not None:
            self.unpin(replaces)
        return len(blocks)

    def unpin(self, pin_id: str) -> bool:
        """Release a pin (its blocks become evictable unless a request holds them). False when unknown."""
        blocks = self._pins.pop(pin_id, None)
        if blocks is None:
            return False
        self.pool.release(reversed(blocks))
        return True
