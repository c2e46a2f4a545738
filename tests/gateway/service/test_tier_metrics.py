"""The KV tiers' counters as Prometheus families (``gateway.service.metrics.tier_metrics``) and the
``POST /admin/cache/warm`` body check (``gateway.service.cache_warm.warm_body``)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.api import Histogram
from gateway.core.errors import InvalidRequestError
from gateway.service.cache_warm import entry_messages, entry_tail_level, warm_body
from gateway.service.metrics import tier_metrics
from tests.gateway.service.test_stats import engine_stats

COUNTERS = {
    "disk.hit_tokens": 160,
    "disk.miss_tokens": 32,
    "redis.hit_tokens": 48,
    "disk.bytes_written": 4096,
    "redis.write_refused": 2,
    "disk.expired.history": 3,
    "redis.expired.system": 1,
    "rejected.corrupt": 4,
    "writeback.dropped": 5,
    "writeback.queued": 9,
    "loaded_blocks": 13,
}


def scrape() -> str:
    stats = engine_stats(
        tier_counters=COUNTERS,
        tier_load_seconds=Histogram(buckets=(0.01, float("inf")), counts=(2, 3), count=3, sum=0.05),
        pinned_blocks=7,
    )

    class Collector:
        def collect(self):
            return tier_metrics({"m": stats})

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


@pytest.mark.parametrize(
    "line",
    [
        'prefixgate_tier_hit_tokens_total{model="m",tier="disk"} 160.0',
        'prefixgate_tier_hit_tokens_total{model="m",tier="redis"} 48.0',
        'prefixgate_tier_miss_tokens_total{model="m",tier="disk"} 32.0',
        'prefixgate_tier_written_bytes_total{model="m",tier="disk"} 4096.0',
        'prefixgate_tier_write_refused_total{model="m",tier="redis"} 2.0',
        'prefixgate_tier_expired_total{level="history",model="m",tier="disk"} 3.0',
        'prefixgate_tier_expired_total{level="system",model="m",tier="redis"} 1.0',
        'prefixgate_tier_rejected_total{cause="corrupt",model="m"} 4.0',
        'prefixgate_tier_writes_dropped_total{model="m"} 5.0',
        'prefixgate_tier_loaded_blocks_total{model="m"} 13.0',
        'prefixgate_pinned_blocks{model="m"} 7.0',
        'prefixgate_tier_load_seconds_bucket{le="0.01",model="m"} 2.0',
        'prefixgate_tier_load_seconds_count{model="m"} 3.0',
    ],
)
def test_every_tier_counter_has_its_family(line: str):
    assert line in scrape().splitlines()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"system": "a", "prompt": "b"}, "prompt"),
        ({"system": 3}, "system"),
        ({"system": "a", "pin": "yes"}, "pin"),
        ({"system": "a", "tenant": 1}, "tenant"),
        ({"system": "a", "model": 1}, "model"),
        ({"messages": [], "documents": "d"}, "messages"),
    ],
)
def test_bad_warm_bodies_are_400s_naming_the_field(body: dict, param: str):
    with pytest.raises(InvalidRequestError) as caught:
        warm_body(body, "m")
    assert caught.value.param == param


def test_a_warm_body_becomes_its_prompt_and_level():
    entry = warm_body({"system": "s", "documents": "d", "tenant": "t", "pin": True}, "m")
    assert (entry.model, entry.tenant, entry.pin) == ("m", "t", True)
    assert entry_messages(entry) == [{"role": "system", "content": "s"}, {"role": "user", "content": "d"}]
    assert entry_tail_level(entry) == "documents"
    assert entry_tail_level(warm_body({"system": "s"}, "m")) == "system"
    assert entry_tail_level(warm_body({"messages": [{"role": "user", "content": "u"}]}, "m")) == "history"
