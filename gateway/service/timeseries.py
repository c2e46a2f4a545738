"""Stats over time for the dashboard: a bounded ring of periodic samples of the ``/admin/stats`` document.

Owns ``StatsHistory``. A sample keeps only counters and gauges already in the stats document (no counter of
its own, never prompt text): per model requests, prompt / cached tokens, requests rules rewrote, decode tokens
and seconds, block gauges and evictions; totals of savings, write waste, misses by cause, tier bytes, tier
bytes held, tier evictions and expirations per level. ``series()`` turns consecutive samples into rates.

Invariants: at most ``capacity`` samples are kept (oldest dropped first, ``collections.deque(maxlen=...)``);
samples are in time order; ``maybe_sample`` takes a new one only when the last is at least ``interval_s`` old,
so any number of open pages or a sampling task cannot add more than one sample per interval.

Rates between samples ``a`` and ``b`` (``dt = b.t - a.t`` seconds): ``rps = Δrequests / dt``;
``hit_rate = Δcached_tokens / Δprompt_tokens`` and ``rules_share = Δrules_requests / Δrequests`` (None when the
denominator did not move); ``decode_tps = Δdecode_tokens / Δdecode_seconds`` (the engine's own decode rate,
None when it did not decode); ``misses_per_s[cause] = Δmisses / dt``. Counters that went down (a restart
cannot happen in-process, but a model's stats could be rebuilt) give a delta of 0, never a negative rate.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("prefixgate.timeseries")

DEFAULT_INTERVAL_S = 1.0
"""Seconds between samples (the page polls at most once per second)."""

DEFAULT_CAPACITY = 900
"""Samples kept: 15 minutes at one per second."""


@dataclass(frozen=True)
class ModelSample:
    """One model's counters at a sample (tokens, seconds, blocks; cumulative unless named a gauge)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    rules_requests: int
    decode_tokens: int
    decode_seconds: float
    blocks_used: int  # gauge
    blocks_cached: int  # gauge
    blocks_free: int  # gauge
    evictions: int


@dataclass(frozen=True)
class Sample:
    """The stats document reduced to what the dashboard plots over time.

    Attributes:
        t: Unix time of the sample (seconds).
        models: model name -> its counters.
        tokens_saved: prompt tokens not prefilled thanks to the cache (all models).
        prefill_seconds_saved: estimated prefill seconds saved (``gateway.service.stats``).
        usd_saved / write_waste_usd: dollars saved by cache reads / paid for cache writes never read.
        misses: miss cause -> misses (all models, ``gateway.service.miss_counters``).
        tier_bytes: tier -> bytes it holds (gauge, ``{t}.bytes`` of ``engine.kv_tiers.stack``); tier_evicted: tier -> entries evicted;
        tier_expired: ``"<tier>.<level>"`` -> entries expired.
        learned_slots: learned volatile slots awaiting review (state ``slot``).
    """

    t: float
    models: dict[str, ModelSample]
    tokens_saved: int = 0
    prefill_seconds_saved: float = 0.0
    usd_saved: float = 0.0
    write_waste_usd: float = 0.0
    misses: dict[str, int] = field(default_factory=dict)
    tier_bytes: dict[str, int] = field(default_factory=dict)
    tier_evicted: dict[str, int] = field(default_factory=dict)
    tier_expired: dict[str, int] = field(default_factory=dict)
    learned_slots: int = 0


def sample_of(doc: Mapping[str, Any], t: float) -> Sample:
    """Reduce one ``/admin/stats`` document (``Gateway.stats_snapshot``) to a ``Sample`` taken at ``t``."""
    models: dict[str, ModelSample] = {}
    tier_bytes: dict[str, int] = {}
    tier_evicted: dict[str, int] = {}
    tier_expired: dict[str, int] = {}
    for name, m in doc["models"].items():
        engine = m.get("engine") or {}
        models[name] = ModelSample(
            requests=m["requests"],
            prompt_tokens=m["prompt_tokens"],
            cached_tokens=m["cached_tokens"],
            rules_requests=m.get("rules_requests", 0),
            decode_tokens=engine.get("decode_tokens", 0),
            decode_seconds=engine.get("decode_seconds", 0.0),
            blocks_used=m["blocks"]["used"],
            blocks_cached=m["blocks"]["cached"],
            blocks_free=m["blocks"]["free"],
            evictions=m["evictions"],
        )
        for counter, value in (engine.get("tier_counters") or {}).items():
            parts = counter.split(".")
            if len(parts) == 2 and parts[1] == "bytes":
                tier_bytes[parts[0]] = tier_bytes.get(parts[0], 0) + value
            elif len(parts) == 2 and parts[1] == "evicted":
                tier_evicted[parts[0]] = tier_evicted.get(parts[0], 0) + value
            elif len(parts) == 3 and parts[1] == "expired":
                level = f"{parts[0]}.{parts[2]}"
                tier_expired[level] = tier_expired.get(level, 0) + value
    misses: dict[str, int] = {}
    for counters in ((doc.get("cache_misses") or {}).get("models") or {}).values():
        for cause, count in counters["by_cause"].items():
            misses[cause] = misses.get(cause, 0) + count
    costs = doc.get("costs") or {}
    learned = (doc.get("learned") or {}).get("slots") or []
    return Sample(
        t=t,
        models=models,
        tokens_saved=doc.get("prefill_tokens_saved", 0),
        prefill_seconds_saved=doc.get("prefill_seconds_saved") or 0.0,
        usd_saved=doc.get("cost_saved_usd", 0.0),
        write_waste_usd=sum(m.get("write_waste_usd", 0.0) for m in (costs.get("by_model") or {}).values()),
        misses=misses,
        tier_bytes=tier_bytes,
        tier_evicted=tier_evicted,
        tier_expired=tier_expired,
        learned_slots=sum(1 for row in learned if row.get("state") == "slot"),
    )


class StatsHistory:
    """The last ``capacity`` samples of the stats document, one per ``interval_s`` at most. Thread-safe.

    Args:
        snapshot: returns the ``/admin/stats`` document.
        interval_s: least seconds between two samples, > 0.
        capacity: samples kept, >= 2.
        clock: Unix seconds (tests pass a fake one).

    Raises:
        ValueError: ``interval_s <= 0`` or ``capacity < 2``.
    """

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Any]],
        interval_s: float = DEFAULT_INTERVAL_S,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        if capacity < 2:
            raise ValueError("capacity must be >= 2 (rates need two samples)")
        self._snapshot = snapshot
        self.interval_s = float(interval_s)
        self.capacity = capacity
        self._clock = clock
        self._samples: deque[Sample] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._samples)

    def maybe_sample(self) -> bool:
        """Take a sample when none was taken in the last ``interval_s`` seconds; True when one was taken."""
        now = self._clock()
        with self._lock:
            if self._samples and now - self._samples[-1].t < self.interval_s:
                return False
        sample = sample_of(self._snapshot(), now)
        with self._lock:
            if self._samples and sample.t - self._samples[-1].t < self.interval_s:
                return False
            self._samples.append(sample)
        return True

    def samples(self) -> list[Sample]:
        """The kept samples, oldest first."""
        with self._lock:
            return list(self._samples)

    def series(self) -> dict[str, Any]:
        """Columns for the dashboard's charts (uPlot's ``[x, y1, y2, ...]`` layout), one row per sample after
        the first: ``t`` (Unix seconds); per model ``rps``, ``hit_rate``, ``rules_share``, ``decode_tps``,
        ``blocks_used`` / ``blocks_cached`` / ``blocks_free`` (gauges, all models summed in ``blocks``);
        ``tokens_saved``, ``prefill_seconds_saved``, ``usd_saved``, ``write_waste_usd`` (cumulative);
        ``misses_per_s`` by cause; ``tier_bytes`` (gauge), ``evictions`` (the pool's, and each tier's) and
        ``expirations`` (per ``tier.level``), cumulative; ``learned_slots``. Rates and None rules in the
        module docstring."""
        samples = self.samples()
        pairs = list(zip(samples, samples[1:], strict=False))
        models = sorted({name for s in samples for name in s.models})
        causes = sorted({cause for s in samples for cause in s.misses})
        tiers = sorted({tier for s in samples for tier in (*s.tier_bytes, *s.tier_evicted)})
        levels = sorted({level for s in samples for level in s.tier_expired})
        per_model: dict[str, dict[str, list[float | None]]] = {}
        for name in models:
            rows = [(a.models.get(name), b.models.get(name), b.t - a.t) for a, b in pairs]
            per_model[name] = {
                "rps": [_rate(_delta(a, b, "requests"), dt) for a, b, dt in rows],
                "hit_rate": [
                    _ratio(_delta(a, b, "cached_tokens"), _delta(a, b, "prompt_tokens")) for a, b, _ in rows
                ],
                "rules_share": [
                    _ratio(_delta(a, b, "rules_requests"), _delta(a, b, "requests")) for a, b, _ in rows
                ],
                "decode_tps": [
                    _ratio(_delta(a, b, "decode_tokens"), _delta(a, b, "decode_seconds")) for a, b, _ in rows
                ],
            }
        after = [b for _, b in pairs]
        return {
            "interval_s": self.interval_s,
            "t": [s.t for s in after],
            "models": per_model,
            "blocks": {
                state: [sum(getattr(m, f"blocks_{state}") for m in s.models.values()) for s in after]
                for state in ("used", "cached", "free")
            },
            "tokens_saved": [s.tokens_saved for s in after],
            "prefill_seconds_saved": [s.prefill_seconds_saved for s in after],
            "usd_saved": [s.usd_saved for s in after],
            "write_waste_usd": [s.write_waste_usd for s in after],
            "misses_per_s": {
                cause: [
                    _rate(max(b.misses.get(cause, 0) - a.misses.get(cause, 0), 0), b.t - a.t)
                    for a, b in pairs
                ]
                for cause in causes
            },
            "tier_bytes": {tier: [s.tier_bytes.get(tier, 0) for s in after] for tier in tiers},
            "evictions": {
                "pool": [sum(m.evictions for m in s.models.values()) for s in after],
                **{tier: [s.tier_evicted.get(tier, 0) for s in after] for tier in tiers},
            },
            "expirations": {level: [s.tier_expired.get(level, 0) for s in after] for level in levels},
            "learned_slots": [s.learned_slots for s in after],
        }


def _delta(a: ModelSample | None, b: ModelSample | None, name: str) -> float:
    if a is None or b is None:
        return 0.0
    return max(getattr(b, name) - getattr(a, name), 0)


def _rate(delta: float, dt: float) -> float | None:
    return delta / dt if dt > 0 else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


async def sample_every(history: StatsHistory) -> None:
    """Sample ``history`` every ``interval_s`` seconds until cancelled (the app's lifespan runs it). A failing
    snapshot is logged and retried at the next interval, never raised."""
    while True:
        try:
            history.maybe_sample()
        except Exception:  # the sampler must outlive a bad snapshot; the page shows the gap
            logger.exception("stats history sample failed")
        await asyncio.sleep(history.interval_s)
