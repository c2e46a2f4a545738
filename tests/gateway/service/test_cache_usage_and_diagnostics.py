"""Provider usage shapes -> CacheUsage (typed error on a wrong type), and provider miss reasons -> miss causes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.core.cache_usage import CacheUsage
from gateway.protocols.provider_usage import (
    UpstreamUsageError,
    anthropic_cache_usage,
    deepseek_cache_usage,
    gemini_cache_usage,
    openai_cache_usage,
)
from gateway.service.miss_counters import MissCounters
from gateway.service.provider_diagnostics import (
    ANTHROPIC_MISS_REASONS,
    anthropic_diagnostic,
    count_provider_miss,
    openai_diagnostic,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "provider_caching"


def _load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_anthropic_usage_with_the_ttl_split():
    usage = anthropic_cache_usage(_load("anthropic_write_1h.json")["usage"])
    assert usage == CacheUsage(6_050, 0, {"1h": 5_000, "5m": 1_000})
    assert anthropic_cache_usage(_load("anthropic_read.json")["usage"]) == CacheUsage(6_080, 6_000, {})
    # without the split, creation is the default 5m TTL
    assert anthropic_cache_usage({"input_tokens": 1, "cache_creation_input_tokens": 9}) == CacheUsage(
        10, 0, {"5m": 9}
    )


def test_openai_deepseek_and_gemini_usage():
    assert openai_cache_usage(_load("openai_gpt56_write.json")["usage"], "24h") == CacheUsage(
        4_000, 2_048, {"24h": 1_024}
    )
    responses = {"input_tokens": 3000, "input_tokens_details": {"cached_tokens": 1024}, "output_tokens": 5}
    assert openai_cache_usage(responses) == CacheUsage(3_000, 1_024, {})
    assert deepseek_cache_usage(_load("deepseek_usage.json")["usage"]) == CacheUsage(3_000, 2_944, {})
    assert gemini_cache_usage(_load("gemini_usage.json")["usageMetadata"]) == CacheUsage(5_000, 4_096, {})


@pytest.mark.parametrize(
    ("parse", "usage", "field"),
    [
        (anthropic_cache_usage, _load("anthropic_bad_usage.json")["usage"], "input_tokens"),
        (anthropic_cache_usage, {"cache_read_input_tokens": True}, "cache_read_input_tokens"),
        (anthropic_cache_usage, {"cache_creation": [1]}, "cache_creation"),
        (
            anthropic_cache_usage,
            {"cache_creation_input_tokens": 1, "cache_creation": {"ephemeral_1h_input_tokens": 5}},
            "cache_creation",
        ),
        (anthropic_cache_usage, "usage", "(usage)"),
        (openai_cache_usage, _load("openai_bad_usage.json")["usage"], "prompt_tokens_details.cached_tokens"),
        (openai_cache_usage, {"prompt_tokens": -3}, "prompt_tokens"),
        (
            openai_cache_usage,
            {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}},
            "prompt_tokens_details",
        ),
        (deepseek_cache_usage, {"prompt_cache_hit_tokens": 1.5}, "prompt_cache_hit_tokens"),
        (
            gemini_cache_usage,
            {"promptTokenCount": 10, "cachedContentTokenCount": "all"},
            "cachedContentTokenCount",
        ),
    ],
)
def test_a_usage_field_of_the_wrong_type_is_a_typed_error(parse, usage, field):
    with pytest.raises(UpstreamUsageError) as info:
        parse(usage)
    assert info.value.field == field
    assert str(info.value).startswith(f"upstream usage.{field}: expected an integer >= 0")


def test_anthropic_diagnostics_map_onto_miss_causes():
    diag = anthropic_diagnostic(_load("anthropic_miss_system_changed.json"))
    assert (diag.reason, diag.cause, diag.missed_tokens) == ("system_changed", "system_changed", 5200)
    assert anthropic_diagnostic(_load("anthropic_write_1h.json")).cause is None  # previous_message_not_found
    assert anthropic_diagnostic(_load("anthropic_read.json")) is None  # no diagnostics
    assert anthropic_diagnostic({"diagnostics": {"cache_miss_reason": None}}) is None  # still running
    assert anthropic_diagnostic({"diagnostics": "x"}) is None
    assert ANTHROPIC_MISS_REASONS["messages_changed"] == "history_rewritten"
    assert (
        anthropic_diagnostic({"diagnostics": {"cache_miss_reason": {"type": "model_changed"}}}).cause
        == "cold"
    )
    assert (
        anthropic_diagnostic({"diagnostics": {"cache_miss_reason": {"type": "cache expired"}}}).cause
        == "evicted"
    )
    assert openai_diagnostic({"diagnostics": {"cache_miss_reason": "tools changed"}}).cause == "tools_changed"
    assert openai_diagnostic({"usage": {}}) is None


def test_provider_diagnostics_are_counted_in_the_gateway_miss_counters():
    counters = MissCounters()
    diag = anthropic_diagnostic(_load("anthropic_miss_system_changed.json"))
    explanation = count_provider_miss(counters, diag, cached=0, stable=5_200)
    assert explanation.source == "provider"
    assert counters.by_cause["system_changed"] == 1
    assert counters.missed_tokens_by_cause["system_changed"] == 5_200
    # a hit, or a reason that maps to nothing, is not counted
    assert count_provider_miss(counters, diag, cached=5_200, stable=5_200) is None
    unknown = anthropic_diagnostic(_load("anthropic_write_1h.json"))
    assert count_provider_miss(counters, unknown, cached=0, stable=5_000) is None
    assert counters.misses == 1
