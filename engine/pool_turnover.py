"""How long the block pool keeps a block released now: the residency rule of the idle reply prefill
(``EngineConfig.idle_prefill_min_residency_s``, ``engine.scheduler``, "Idle prefills").

A block released now goes to the most recently used end of the pool's LRU queue (``engine.block_pool``). It is
evicted once the pool has handed out the free blocks and every cached entry ahead of it, so at the rate the pool
handed blocks out lately it stays cached for about ``(free + cached - need) / rate`` seconds, where ``need`` is
what the new work takes first. ``rate`` is measured over the last ``window_s`` seconds from samples of
``BlockPool.allocations`` taken at each plan; with less than ``min_span_s`` of history, or no allocation in it,
the residency is unbounded (``math.inf``): nothing says the pool turns over.

Invariant: reads counters only; nothing here changes the pool.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from engine.block_pool import BlockPool

WINDOW_S = 30.0
"""Seconds of allocation history the rate is measured over."""


class PoolTurnover:
    """Allocation-rate samples of one block pool, and the residency they imply.

    Args:
        pool: the block pool (its ``allocations``, ``blocks_free``, ``blocks_cached`` are read).
        clock: monotonic seconds (the scheduler's; tests pass a fake one).
        window_s: history the rate is measured over (> 0).
        min_span_s: least history for a rate (>= 0); less gives an unbounded residency.
        sample_every_s: least time between two kept samples (>= 0), so a busy engine keeps few.

    Raises:
        ValueError: ``window_s`` <= 0, or a negative ``min_span_s`` or ``sample_every_s``.
    """

    def __init__(
        self,
        pool: BlockPool,
        clock: Callable[[], float],
        window_s: float = WINDOW_S,
        min_span_s: float = 1.0,
        sample_every_s: float = 0.25,
    ) -> None:
        if not window_s > 0 or min_span_s < 0 or sample_every_s < 0:
            raise ValueError("window_s must be > 0, min_span_s and sample_every_s >= 0")
        self.pool = pool
        self.clock = clock
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.sample_every_s = sample_every_s
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self) -> None:
        """Record the pool's allocation count now (at most one sample per ``sample_every_s``), dropping
        samples older than the window but the newest of those (the rate's start)."""
        now = self.clock()
        if self._samples and now - self._samples[-1][0] < self.sample_every_s:
            return
        self._samples.append((now, self.pool.allocations))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Blocks handed out per second over the history kept, up to now; None with less than ``min_span_s``
        of it."""
        if not self._samples:
            return None
        t0, a0 = self._samples[0]
        span = self.clock() - t0
        if span < self.min_span_s or span <= 0:
            return None
        return (self.pool.allocations - a0) / span

    def residency_s(self, need: int) -> float:
        """Seconds a block released now stays cached if ``need`` blocks are taken first (``math.inf`` when the
        rate is unknown or zero; 0 when the pool has no room past ``need``)."""
        rate = self.rate()
        if not rate:
            return math.inf
        ahead = self.pool.blocks_free + self.pool.blocks_cached - need
        return max(0, ahead) / rate
