"""Counters of the tiers, written from the step thread, the write-back thread and the prefetch thread.

Names (all monotonic, tokens / bytes / counts as named), per tier ``t`` in ``disk``, ``redis``:

- ``{t}.hit_tokens``: prompt tokens a lookup found in the tier;
- ``{t}.miss_tokens``: tokens of the blocks a lookup asked the tier for and it did not serve: the blocks a
  lower tier then served, and the one block where the lookup stopped (no tier had it). The rest of the
  prompt past that block is never asked for, so this is not "prompt tokens not found" and
  ``hit / (hit + miss)`` is not a hit rate of prompt tokens;
- ``{t}.writes`` / ``{t}.bytes_written``: entries written and their bytes;
- ``{t}.write_errors``: writes that failed (disk full, unwritable, Redis down or slow);
- ``{t}.write_refused``: writes Redis refused (``maxmemory``);
- ``{t}.read_errors``: reads that failed (the lookup stops: a miss);
- ``{t}.skipped_down``: operations skipped while the tier waits to retry an unreachable backend;
- ``{t}.evicted``: entries dropped to keep a level inside its byte budget;
- ``{t}.expired.{level}``: entries found older than their level's TTL;
- ``{t}.admin_errors``: admin operations (listing, dropping) the tier could not complete (Redis down, a
  failed scan or delete): the answer names the tier as skipped;
- ``rejected.{cause}``: entries refused by ``engine.kv_tiers.entry.decode_entry``;
- ``writeback.queued`` / ``writeback.dropped``: blocks offered to the write-back queue / dropped because
  it was full;
- ``loaded_blocks``: blocks copied back into the pool.

Load-back latency (seconds from a prefetch's start to its blocks being read) is a histogram.
"""

from __future__ import annotations

import threading
from collections import Counter

from engine.api import Histogram
from engine.stats import HistogramBuilder

LOAD_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
"""Upper bounds of the load-back latency histogram, seconds."""


TIER_COUNTERS: tuple[str, ...] = (
    "hit_tokens",
    "miss_tokens",
    "writes",
    "bytes_written",
    "write_errors",
    "write_refused",
    "read_errors",
    "skipped_down",
    "evicted",
    "admin_errors",
)
"""The per-tier counters above (``{t}.<name>``), reported from 0 for every configured tier (with each level's
``{t}.expired.{level}``, each ``rejected.{cause}``, ``writeback.dropped`` and ``loaded_blocks``:
``TierStack.stats``)."""


class TierCounters:
    """Thread-safe named counters and the load-back latency histogram."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._load = HistogramBuilder(LOAD_BUCKETS_S)

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self._counts[name] += n

    def observe_load(self, seconds: float) -> None:
        """Record one load-back's latency."""
        with self._lock:
            self._load.observe(seconds)

    def get(self, name: str) -> int:
        """Current value of ``name`` (0 if never counted)."""
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._counts)

    def load_histogram(self) -> Histogram:
        """The load-back latency histogram."""
        with self._lock:
            return self._load.snapshot()
