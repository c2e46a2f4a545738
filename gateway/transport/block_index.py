"""The cache-aware router's view of what each replica holds: block hashes per replica, LRU-aged and bounded
(``BlockIndex``). Invariant: at most ``capacity_blocks`` hashes per replica; a chain's parent is touched after its
tail, so it ages out after it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockIndex:
    """Per replica, the block hashes believed cached there, LRU-aged and bounded.

    Args:
        capacity_blocks: most hashes kept per replica (llm-d's ``LRUCapacityPerServer`` default is 31,250).

    Raises:
        ValueError: ``capacity_blocks < 1``.
    """

    def __init__(self, capacity_blocks: int = 31_250) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def add(self, replica: str, blocks: Iterable[int]) -> None:
        """Record ``blocks`` on ``replica`` as most recently used; the oldest past the capacity are dropped.

        Touched in reverse (tail first), so a chain's parent is younger than its tail and ages out after it.
        """
        lru = self._lru.setdefault(replica, OrderedDict())
        for block in reversed(list(blocks)):
            lru[block] = None
            lru.move_to_end(block)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def remove(self, replica: str, blocks: Iterable[int]) -> None:
        """Forget ``blocks`` on ``replica`` (absent ones are ignored)."""
        lru = self._lru.get(replica)
        if lru is not None:
            for block in blocks:
                lru.pop(block, None)

    def clear(self, replica: str) -> None:
        """Forget everything on ``replica`` (it restarted, or said ``AllBlocksCleared``)."""
        self._lru.pop(replica, None)

    def match(self, replica: str, blocks: Sequence[int]) -> int:
        """Number of leading ``blocks`` present on ``replica`` (a prefix match: hashes are chained)."""
        lru = self._lru.get(replica)
        if not lru:
            return 0
        n = 0
        for block in blocks:
            if block not in lru:
                break
            n += 1
        return n

    def size(self, replica: str) -> int:
        """Hashes held for ``replica``."""
        return len(self._lru.get(replica, ()))
