"""The vocabulary of a miss explanation: its causes, the prompt's segments, the explanation itself and the
``x-prefixgate-cache`` header that carries it.

Owns ``MISS_CAUSES`` and ``SEGMENT_NAMES``, the input types ``PromptSegment`` and ``VolatileSpan`` (token
ranges), ``MissExplanation`` (the answer ``gateway.service.miss_explain.MissExplainer`` gives), the header
format (``format_cache_header``), and the mapping of a provider's own diagnostic onto the same causes
(``map_provider_cause``, keywords, first match wins).

Invariants: every value here holds counts, offsets, names and slot ids, never prompt text; a
``MissExplanation`` with ``miss`` has a ``cause`` in ``MISS_CAUSES``. Pure Python, no HTTP.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MISS_CAUSES: tuple[str, ...] = (
    "volatile",
    "tools_changed",
    "system_changed",
    "history_rewritten",
    "reply_cut",
    "evicted",
    "other_replica",
    "cold",
    "below_minimum",
)
"""Every cause a miss may have."""

SEGMENT_NAMES: tuple[str, ...] = ("tools", "system", "documents", "history", "tail")
"""Segment names a prompt's token ranges may carry (``rules`` levels: tools+system split, documents,
history, volatile tail)."""

HEADER = "x-prefixgate-cache"
"""The response header ``format_cache_header`` writes the value of."""

# Provider diagnostics: (keywords, cause), first match wins; an exact cause name maps to itself.
_PROVIDER_KEYWORDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("below", "minimum", "too short", "min_tokens", "insufficient", "too few"), "below_minimum"),
    (("expired", "ttl", "evict"), "evicted"),
    (("tool",), "tools_changed"),
    (("system", "instruction"), "system_changed"),
    (("history", "conversation", "compact", "rewrit"), "history_rewritten"),
    (("volatile", "dynamic", "timestamp"), "volatile"),
    (("cold", "not found", "no cache", "first request", "not cached", "new prefix"), "cold"),
)


class MissExplainError(ValueError):
    """Bad input to the explainer (token ids that are not 32-bit non-negative integers, segments that are
    not contiguous ranges with known names, a negative count, an unknown model/tenant type); the message
    names the argument. The gateway treats it as "no explanation", never as a failed request."""


@dataclass(frozen=True)
class PromptSegment:
    """A token range ``[start, end)`` of the prompt and its segment name (one of ``SEGMENT_NAMES``)."""

    name: str
    start: int
    end: int


@dataclass(frozen=True)
class VolatileSpan:
    """A token range ``[start, end)`` holding a known volatile value: a learned slot's match (``slot`` is its
    rule id, e.g. ``learned.1a2b3c4d5e6f``), a configured rule's match (``slot`` is the rule's id), or another
    known volatile span (``slot`` None)."""

    start: int
    end: int
    slot: str | None = None


@dataclass(frozen=True)
class MissExplanation:
    """What the explainer concluded for one request.

    Attributes:
        cached: tokens reported cached (clamped to the prompt length).
        stable: the stable prefix the cache could have served, in tokens (rounded down to the cache
            granularity, and short of the last prompt token, which is always computed).
        miss: ``cached < stable``.
        cause: one of ``MISS_CAUSES`` when ``miss``, else None.
        segment, offset: where the miss starts: the divergence from the nearest earlier prompt, the first
            uncached token (``evicted``, ``other_replica``, ``cold``), or the end of the stable prefix
            (``below_minimum``, whose segment is the one holding the last stable token); None on a hit. Never
            inside the cached span: ``offset >= cached``.
        slot: the learned slot or rule that knows the volatile value at the divergence (``volatile`` only),
            or None.
        cached_ago: ``evicted`` and ``other_replica``: seconds since the prefix was last known cached (there,
            or on the other replica); else None.
        source: ``local``, or ``provider`` when the upstream's diagnostic gave the cause; None on a hit.
    """

    cached: int
    stable: int
    miss: bool
    cause: str | None = None
    segment: str | None = None
    offset: int | None = None
    slot: str | None = None
    cached_ago: float | None = None
    source: str | None = None

    @property
    def missed_tokens(self) -> int:
        """Stable tokens that were not served from the cache (0 on a hit)."""
        return max(0, self.stable - self.cached)

    def header_value(self) -> str:
        """The ``x-prefixgate-cache`` value (see ``format_cache_header``)."""
        return format_cache_header(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields plus ``missed_tokens``."""
        return {
            "cached": self.cached,
            "stable": self.stable,
            "miss": self.miss,
            "cause": self.cause,
            "segment": self.segment,
            "offset": self.offset,
            "slot": self.slot,
            "cached_ago": self.cached_ago,
            "source": self.source,
            "missed_tokens": self.missed_tokens,
        }


def volatile_spans_from_chars(
    spans: Iterable[tuple[int, int, str | None]], token_starts: Sequence[int]
) -> list[VolatileSpan]:
    """Character ranges of volatile values in the rendered prompt (e.g. ``SlotLearner.match_slots`` ranges
    shifted by where that message's text begins in the prompt) as token ranges.

    Args:
        spans: ``(start, end, slot id or None)`` character ranges, ``start <= end``.
        token_starts: the start character of every prompt token, ascending (a tokenizer's offsets).

    Returns:
        ``VolatileSpan``s from the token holding ``start`` to the first token at or after ``end`` (at least one
        token each).
    """
    out = []
    for start, end, slot in spans:
        first = max(0, bisect.bisect_right(token_starts, start) - 1)
        last = max(first + 1, bisect.bisect_left(token_starts, end))
        out.append(VolatileSpan(first, last, slot))
    return out


def format_cache_header(explanation: MissExplanation) -> str:
    """``cached=<n>; miss=<cause>; at=<segment>:<offset>``, then ``; slot=<id>`` for a volatile value a learned
    slot or a rule knows (docs/cache-explanations.md) and ``; cached_ago=<seconds>`` for ``evicted`` and
    ``other_replica``; a hit is ``cached=<n>; miss=none``.
    Holds no prompt text."""
    if not explanation.miss:
        return f"cached={explanation.cached}; miss=none"
    parts = [f"cached={explanation.cached}", f"miss={explanation.cause}"]
    if explanation.segment is not None and explanation.offset is not None:
        parts.append(f"at={explanation.segment}:{explanation.offset}")
    if explanation.slot is not None:
        parts.append(f"slot={explanation.slot}")
    if explanation.cached_ago is not None:
        parts.append(f"cached_ago={int(explanation.cached_ago)}")
    return "; ".join(parts)


def map_provider_cause(text: str | None) -> str | None:
    """One of ``MISS_CAUSES`` for a provider's own cache diagnostic (an exact cause name, or a phrase such as
    ``"cache expired"``, ``"prompt below minimum length"``, ``"tools changed"``), or None when it says
    nothing we know (or is not a string)."""
    if not isinstance(text, str) or not text.strip():
        return None
    lowered = text.strip().lower()
    if lowered in MISS_CAUSES:
        return lowered
    for keywords, cause in _PROVIDER_KEYWORDS:
        if any(k in lowered for k in keywords):
            return cause
    return None
