"""A least-recently-used memo bounded by its entries and by named costs (characters, token ids, ...).

The rule memos (``rules.text_cache``) and the gateway's per-message token memo
(``gateway.service.canonicalize.token_memo``) keep what they computed for texts that repeat from request to
request; what they hold must stay bounded whatever clients send. ``BoundedLRU`` owns that bookkeeping once:
each entry has a cost vector (``cost(key, value)``, one non-negative int per limit), and after every store the
least recently used entries go until every summed cost is within its limit and the entries within
``max_entries``.

Invariants: ``totals[i] == sum(cost(k, v)[i] for all entries)``; ``totals[i] <= limits[i]`` and
``len(self) <= max_entries`` after every ``put``; a stored value is never replaced (the first one stays: the
memos store pure functions of the key, so any later value is equal). Safe to share between threads: lookups take
no lock (one dict read under the GIL), stores and evictions take one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """``key -> value``, least recently used first out, bounded by entries and by summed costs.

    Args:
        max_entries: most entries held.
        limits: most summed cost held, one per component of ``cost``'s result.
        cost: ``(key, value) -> costs`` (as many non-negative ints as ``limits``), e.g. characters held.

    Raises:
        ValueError: a limit or ``max_entries`` is negative.
    """

    def __init__(
        self, max_entries: int, limits: Sequence[int], cost: Callable[[K, V], Sequence[int]]
    ) -> None:
        if max_entries < 0 or any(limit < 0 for limit in limits):
            raise ValueError(f"limits must be >= 0, got max_entries={max_entries}, limits={list(limits)}")
        self.max_entries = max_entries
        self.limits = tuple(limits)
        self._cost = cost
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._totals = [0] * len(self.limits)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def totals(self) -> tuple[int, ...]:
        """Summed costs held now, one per limit."""
        return tuple(self._totals)

    def get(self, key: K) -> V | None:
        """The stored value (now the most recently used), or None; counts a hit or a miss."""
        found = self._entries.get(key)  # one atomic step under the GIL: no lock on the hit path
        if found is None:
            self.misses += 1
            return None
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile: the value is still right
            pass
        self.hits += 1
        return found

    def put(self, key: K, value: V) -> None:
        """Store ``value`` under ``key`` unless it is there already, then evict down to the limits (the new
        entry too, when its own cost is over a limit)."""
        costs = self._cost(key, value)
        with self._lock:
            entries = self._entries
            if key in entries:
                return
            entries[key] = value
            totals, limits = self._totals, self.limits
            for i, c in enumerate(costs):
                totals[i] += c
            # a full memo evicts about one entry per store (~40 stores per new user question under the default
            # rules): the limit test is a plain loop, not a generator per test (docs/overhead.md, session 7)
            while entries:
                if len(entries) <= self.max_entries:
                    for total, limit in zip(totals, limits):  # noqa: B905 - one total per limit (__init__)
                        if total > limit:
                            break
                    else:
                        return
                old_key, old = entries.popitem(last=False)
                for i, c in enumerate(self._cost(old_key, old)):
                    totals[i] -= c

    def get_or_compute(self, key: K, compute: Callable[[], V], store: bool = True) -> V:
        """The stored value, or ``compute()``, stored when ``store`` (a caller's size rule, e.g. texts over a
        length are never kept).

        Raises:
            whatever ``compute`` raises (nothing is stored then).
        """
        found = self.get(key)
        if found is not None:
            return found
        value = compute()
        if store:
            self.put(key, value)
        return value

    def keys(self) -> list[K]:
        """The keys held, least recently used first (a copy)."""
        return list(self._entries)

    def check(self) -> None:
        """Assert the invariants (tests)."""
        sums = [0] * len(self.limits)
        for k, v in self._entries.items():
            for i, c in enumerate(self._cost(k, v)):
                sums[i] += c
        assert sums == self._totals, (sums, self._totals)
        assert all(t <= limit for t, limit in zip(self._totals, self.limits, strict=True))
        assert len(self._entries) <= self.max_entries


class MemoCounters:
    """What the memos built on one ``BoundedLRU`` (``self._memo``) report alike: entries held, hits, misses."""

    _memo: BoundedLRU

    def __len__(self) -> int:
        return len(self._memo)

    @property
    def hits(self) -> int:
        """Lookups answered from the memo (cumulative)."""
        return self._memo.hits

    @property
    def misses(self) -> int:
        """Lookups computed (cumulative)."""
        return self._memo.misses
