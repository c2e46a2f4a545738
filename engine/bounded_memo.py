"""A least-recently-used memo bounded by its entries and by the summed size of its keys.

The tokenizer's memos (``engine.piece_memo``: encoded pieces between special tokens; ``engine.served_turns``: the
ids served for a generated turn) keep what they computed for texts that repeat from request to request, keyed
by ``(scope, text)``; what they hold must stay bounded whatever clients send. ``BoundedMemo`` owns that
bookkeeping once: each key has a size (``size_of(key)``, e.g. the characters of its text), and after every
store the least recently used entries go until the entries are within ``max_entries`` and the summed size
within ``max_size``. ``put`` returns the keys it evicted, oldest first, so a caller that keeps its own counts
per key (``ServedTurns`` counts the turns held per scope) keeps them in step.

(``rules.bounded_lru`` is the same idea for the rules and the gateway; the engine does not import ``rules``, and
those memos neither replace values nor report evictions.)

Invariants, after every call returns: ``size == sum(size_of(k) for k in memo)``; ``len(memo) <= max_entries``
and ``size <= max_size`` (an entry whose own size is over ``max_size`` is evicted by the ``put`` that stored
it); iteration yields the keys least recently used first, where ``get`` of a held key and ``put`` of a new key
(or a replaced one) make that key the most recently used. Not thread-safe: its callers hold their own lock
around every call (the same lock as the counters they keep beside it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedMemo(Generic[K, V]):
    """``key -> value``, least recently used first out, bounded by entries and by the summed size of the keys.

    Args:
        max_entries: most entries held (>= 0).
        max_size: most summed ``size_of(key)`` held (>= 0).
        size_of: ``key -> size`` (a non-negative int, the same every time for a key), e.g. a text's characters.

    Raises:
        ValueError: ``max_entries`` or ``max_size`` is negative.
    """

    __slots__ = ("max_entries", "max_size", "_size_of", "_entries", "_size")

    def __init__(self, max_entries: int, max_size: int, size_of: Callable[[K], int]) -> None:
        if max_entries < 0 or max_size < 0:
            raise ValueError(f"bounds must be >= 0, got max_entries={max_entries}, max_size={max_size}")
        self.max_entries = max_entries
        self.max_size = max_size
        self._size_of = size_of
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """The keys held, least recently used first (do not store or evict while iterating)."""
        return iter(self._entries)

    @property
    def size(self) -> int:
        """Summed ``size_of`` of the keys held now."""
        return self._size

    def get(self, key: K) -> V | None:
        """The value held under ``key``, now the most recently used, or None when ``key`` is not held."""
        entries = self._entries
        found = entries.get(key)
        if found is not None:
            entries.move_to_end(key)
        return found

    def put(self, key: K, value: V, *, replace: bool = False) -> list[K] | None:
        """Store ``value`` under ``key`` as the most recently used, then evict down to the bounds.

        Args:
            key: the key.
            value: its value (not None: ``get`` answers None for a key not held).
            replace: when ``key`` is held already, store ``value`` over the held one and make it the most
                recently used; otherwise (the default) leave the held entry as it is.

        Returns:
            None when ``key`` was held already (nothing is evicted then); otherwise the keys evicted, least
            recently used first: ``key`` itself last when its own size is over ``max_size``.

        Raises:
            ValueError: ``value`` is None.
        """
        if value is None:
            raise ValueError("a BoundedMemo value must not be None (get answers None for a key not held)")
        entries = self._entries
        if key in entries:
            if replace:
                entries[key] = value
                entries.move_to_end(key)
            return None
        entries[key] = value
        self._size += self._size_of(key)
        evicted: list[K] = []
        while entries and (self._size > self.max_size or len(entries) > self.max_entries):
            old, _ = entries.popitem(last=False)
            self._size -= self._size_of(old)
            evicted.append(old)
        return evicted

    def pop(self, key: K) -> V | None:
        """Remove ``key`` and answer its value, or None when it is not held."""
        found = self._entries.pop(key, None)
        if found is not None:
            self._size -= self._size_of(key)
        return found

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
        self._size = 0

    def check(self) -> None:
        """Assert the invariants of the module docstring (tests).

        Raises:
            AssertionError: the summed size drifted or a bound is exceeded.
        """
        assert self._size == sum(self._size_of(k) for k in self._entries), (self._size, list(self._entries))
        assert len(self._entries) <= self.max_entries and self._size <= self.max_size
