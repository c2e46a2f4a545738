"""The miss vocabulary: provider diagnostics mapped onto causes, the header, character spans as token spans."""

from __future__ import annotations

from gateway.service.miss_explanation import (
    MISS_CAUSES,
    MissExplanation,
    VolatileSpan,
    format_cache_header,
    map_provider_cause,
    volatile_spans_from_chars,
)


def test_map_provider_cause() -> None:
    assert {c: map_provider_cause(c) for c in MISS_CAUSES} == {c: c for c in MISS_CAUSES}
    assert map_provider_cause("  Tools_Changed ") == "tools_changed"
    assert map_provider_cause("prompt is below the minimum cacheable length") == "below_minimum"
    assert map_provider_cause("cache TTL expired") == "evicted"
    assert map_provider_cause("tool definitions changed") == "tools_changed"
    assert map_provider_cause("system prompt changed") == "system_changed"
    assert map_provider_cause("conversation history was modified") == "history_rewritten"
    assert map_provider_cause("dynamic content in prefix") == "volatile"
    assert map_provider_cause("no cache entry found") == "cold"
    assert map_provider_cause("weather") is None
    assert map_provider_cause("") is None
    assert map_provider_cause(None) is None
    assert map_provider_cause(42) is None


def test_format_cache_header_never_holds_more_than_counts_and_names() -> None:
    e = MissExplanation(0, 64, True, "cold", "tail", 64, None, None, "local")
    assert format_cache_header(e) == "cached=0; miss=cold; at=tail:64"


def test_volatile_spans_from_character_ranges() -> None:
    starts = [0, 4, 9, 10, 16, 20]  # six tokens
    assert volatile_spans_from_chars([(9, 16, "learned.a"), (5, 6, None), (20, 25, "b")], starts) == [
        VolatileSpan(2, 4, "learned.a"),
        VolatileSpan(1, 2, None),
        VolatileSpan(5, 6, "b"),
    ]
