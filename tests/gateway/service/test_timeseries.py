"""The stats history behind the dashboard's charts: one sample per interval at most, bounded memory, rates
between samples, and nothing but counters taken from the stats document."""

from __future__ import annotations

import copy

import pytest

from gateway.service.timeseries import StatsHistory, sample_of


def stats_doc(requests: int, prompt: int, cached: int, rules: int = 0, misses: int = 0) -> dict:
    """A minimal ``/admin/stats`` document of one embedded model ``m``."""
    return {
        "prefill_tokens_saved": cached,
        "prefill_seconds_saved": cached / 1000,
        "cost_saved_usd": 0.5 * requests,
        "costs": {"by_model": {"m": {"write_waste_usd": 0.25}}},
        "models": {
            "m": {
                "requests": requests,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "rules_requests": rules,
                "blocks": {"total": 10, "used": 2, "cached": 3, "free": 5},
                "evictions": 1,
                "engine": {
                    "decode_tokens": 10 * requests,
                    "decode_seconds": 0.5 * requests,
                    "tier_counters": {"disk.bytes": 4096, "disk.evicted": 2, "disk.expired.system": 1},
                },
            }
        },
        "cache_misses": {"models": {"m": {"by_cause": {"cold": misses, "volatile": 0}}}},
        "learned": {"slots": [{"state": "slot"}, {"state": "candidate"}]},
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_at_most_one_sample_per_interval_and_bounded_memory():
    clock = Clock()
    calls = []

    def snapshot() -> dict:
        calls.append(clock.now)
        return stats_doc(0, 0, 0)

    history = StatsHistory(snapshot, interval_s=1.0, capacity=3, clock=clock)
    assert history.maybe_sample() is True
    clock.now += 0.5
    assert history.maybe_sample() is False and len(calls) == 1  # no snapshot taken inside the interval
    for _ in range(5):
        clock.now += 1.0
        assert history.maybe_sample() is True
    assert len(history) == 3 and [s.t for s in history.samples()] == [1003.5, 1004.5, 1005.5]


def test_series_are_rates_between_samples():
    clock = Clock()
    docs = [stats_doc(0, 0, 0), stats_doc(4, 400, 300, rules=1, misses=2), stats_doc(4, 400, 300, misses=2)]
    feed = iter(docs)
    history = StatsHistory(lambda: next(feed), interval_s=2.0, clock=clock)
    for _ in docs:
        history.maybe_sample()
        clock.now += 2.0
    series = history.series()
    assert series["t"] == [1002.0, 1004.0]
    m = series["models"]["m"]
    assert m["rps"] == [2.0, 0.0]
    assert m["hit_rate"] == [0.75, None]  # no prompt tokens in the second interval: no hit rate
    assert m["rules_share"] == [0.25, None]
    assert m["decode_tps"] == [20.0, None]
    assert series["misses_per_s"] == {"cold": [1.0, 0.0], "volatile": [0.0, 0.0]}
    assert series["blocks"] == {"used": [2, 2], "cached": [3, 3], "free": [5, 5]}
    assert series["tier_bytes"] == {"disk": [4096, 4096]}
    assert series["evictions"] == {"pool": [1, 1], "disk": [2, 2]}
    assert series["expirations"] == {"disk.system": [1, 1]}
    assert series["usd_saved"] == [2.0, 2.0] and series["write_waste_usd"] == [0.25, 0.25]
    assert series["learned_slots"] == [1, 1]


def test_a_counter_that_went_down_gives_no_negative_rate():
    clock = Clock()
    feed = iter([stats_doc(5, 500, 100), stats_doc(2, 200, 50)])
    history = StatsHistory(lambda: next(feed), interval_s=1.0, clock=clock)
    history.maybe_sample()
    clock.now += 1.0
    history.maybe_sample()
    assert history.series()["models"]["m"]["rps"] == [0.0]


def test_upstream_models_without_engine_counters_are_sampled():
    doc = stats_doc(1, 10, 0)
    upstream = copy.deepcopy(doc["models"]["m"])
    del upstream["engine"]
    doc["models"]["u"] = upstream
    sample = sample_of(doc, 1.0)
    assert sample.models["u"].decode_tokens == 0 and sample.models["m"].decode_tokens == 10


@pytest.mark.parametrize("kwargs", [{"interval_s": 0}, {"capacity": 1}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        StatsHistory(lambda: stats_doc(0, 0, 0), **kwargs)
