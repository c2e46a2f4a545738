"""Engine counters and histograms, snapshotted into ``engine.api.EngineStats``.

Counting rules (see ``EngineStats``): prompt, prefix-query and prefix-hit tokens are counted once per request at
its first admission, and so is the prefill time its hit saved (``prefill_seconds_saved``: the hit tokens at the
mean prefill rate measured so far, never revised, so the sum only grows); a recompute after preemption adds to
``prefill_tokens`` (tokens actually computed) but never to the hit counters. Block gauges are read from the KV cache manager's own counters, so they cannot drift.

The time of a step that mixes prefill and decode rows is split between ``prefill_seconds`` and
``decode_seconds`` in proportion to their token counts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.api import EngineStats, Histogram

TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
"""Upper bounds of the TTFT histogram (seconds; vLLM's buckets)."""

TPOT_BUCKETS_S: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
"""Upper bounds of the TPOT histogram (seconds; vLLM's buckets)."""


class HistogramBuilder:
    """A cumulative histogram (Prometheus style) being filled.

    Args:
        buckets: increasing upper bounds, seconds. Observations above the last bound count only in ``count``
            (the implicit ``+Inf`` bucket).
    """

    def __init__(self, buckets: tuple[float, ...]) -> None:
        if list(buckets) != sorted(buckets):
            raise ValueError("histogram buckets must increase")
        self.buckets = buckets
        self._per_bucket = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Record one observation (seconds)."""
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            self._per_bucket[i] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> Histogram:
        """Frozen cumulative view: ``counts[i]`` = observations <= ``buckets[i]``."""
        counts, total = [], 0
        for n in self._per_bucket:
            total += n
            counts.append(total)
        return Histogram(self.buckets, tuple(counts), self.count, self.sum)


@dataclass
class EngineCounters:
    """Monotonic counters of one engine (tokens, seconds). Gauges come from the scheduler at snapshot time."""

    requests: int = 0
    prompt_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_seconds_saved: float = 0.0
    inflight_shared_tokens: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    preemptions: int = 0
    forks: int = 0
    forked_prefill_tokens_saved: int = 0
    idle_prefills: int = 0
    idle_prefill_tokens: int = 0
    idle_prefills_yielded: int = 0
    idle_prefills_dropped: int = 0
    ttft: HistogramBuilder = field(default_factory=lambda: HistogramBuilder(TTFT_BUCKETS_S))
    tpot: HistogramBuilder = field(default_factory=lambda: HistogramBuilder(TPOT_BUCKETS_S))

    def record_admission(self, prompt_tokens: int, cached_tokens: int, inflight_shared_tokens: int) -> None:
        """A request's first admission: its prompt was looked up once (``cached_tokens`` of it hit, which saved
        ``cached_tokens`` at the mean prefill rate measured until now; 0 before any prefill was measured)."""
        self.prompt_tokens += prompt_tokens
        self.prefix_query_tokens += prompt_tokens
        self.prefix_hit_tokens += cached_tokens
        if cached_tokens > 0 and self.prefill_tokens > 0 and self.prefill_seconds > 0:
            self.prefill_seconds_saved += cached_tokens * self.prefill_seconds / self.prefill_tokens
        self.inflight_shared_tokens += inflight_shared_tokens

    def record_step(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One forward step: prefill tokens and decode rows computed, and its wall time (split by tokens)."""
        total = prefill_tokens + decode_rows
        if total == 0:
            return
        self.prefill_tokens += prefill_tokens
        self.prefill_seconds += seconds * prefill_tokens / total
        self.decode_seconds += seconds * decode_rows / total

    def snapshot(
        self,
        *,
        blocks_total: int,
        blocks_used: int,
        blocks_cached: int,
        blocks_free: int,
        evictions: int,
        running: int,
        waiting: int,
    ) -> EngineStats:
        """Frozen ``EngineStats`` with the given gauges."""
        return EngineStats(
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            prefill_tokens=self.prefill_tokens,
            prefill_seconds=self.prefill_seconds,
            prefill_seconds_saved=self.prefill_seconds_saved,
            inflight_shared_tokens=self.inflight_shared_tokens,
            decode_tokens=self.decode_tokens,
            decode_seconds=self.decode_seconds,
            blocks_total=blocks_total,
            blocks_used=blocks_used,
            blocks_cached=blocks_cached,
            blocks_free=blocks_free,
            evictions=evictions,
            preemptions=self.preemptions,
            running=running,
            waiting=waiting,
            ttft=self.ttft.snapshot(),
            tpot=self.tpot.snapshot(),
            forks=self.forks,
            forked_prefill_tokens_saved=self.forked_prefill_tokens_saved,
            idle_prefills=self.idle_prefills,
            idle_prefill_tokens=self.idle_prefill_tokens,
            idle_prefills_yielded=self.idle_prefills_yielded,
            idle_prefills_dropped=self.idle_prefills_dropped,
        )
