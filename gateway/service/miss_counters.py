"""Miss counters: requests explained, hits and misses, misses and missed tokens by cause and by segment.

Owns ``MissCounters``, the totals behind ``/admin/stats`` and ``/metrics`` (each cause a label value).
Invariants: every cause of ``MISS_CAUSES`` and every segment of ``SEGMENT_NAMES`` is present (zero when
unseen); ``requests == hits + misses``. Not thread-safe by itself: its owner serializes ``add``
(``gateway.service.cache_explain`` under its lock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.service.miss_explanation import MISS_CAUSES, SEGMENT_NAMES, MissExplanation


@dataclass
class MissCounters:
    """Counts by cause, for ``/admin/stats`` and ``/metrics`` (each cause a label value).

    Attributes:
        requests, hits, misses: requests explained, and how many were hits and misses.
        by_cause: cause -> misses (every cause present, zero when unseen).
        missed_tokens_by_cause: cause -> stable tokens not served from the cache.
        by_segment: segment name -> misses located there.
    """

    requests: int = 0
    hits: int = 0
    misses: int = 0
    by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_CAUSES, 0))
    missed_tokens_by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_CAUSES, 0))
    by_segment: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEGMENT_NAMES, 0))

    def add(self, explanation: MissExplanation) -> None:
        """Count one explanation."""
        self.requests += 1
        if not explanation.miss:
            self.hits += 1
            return
        self.misses += 1
        self.by_cause[explanation.cause] += 1
        self.missed_tokens_by_cause[explanation.cause] += explanation.missed_tokens
        if explanation.segment in self.by_segment:
            self.by_segment[explanation.segment] += 1

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "requests": self.requests,
            "hits": self.hits,
            "misses": self.misses,
            "by_cause": dict(self.by_cause),
            "missed_tokens_by_cause": dict(self.missed_tokens_by_cause),
            "by_segment": dict(self.by_segment),
        }
