"""``EngineCounters.prefill_seconds_saved``: each admission's prefix-hit tokens at the mean prefill rate measured
until then, summed and never revised, so the ``prefixgate_prefill_seconds_saved_total`` counter it feeds only
grows (it was recomputed from the current mean rate and fell after a large, fast prefill)."""

from __future__ import annotations

import pytest

from engine.stats import EngineCounters

GAUGES = dict(
    blocks_total=8, blocks_used=0, blocks_cached=0, blocks_free=8, evictions=0, running=0, waiting=0
)


def test_saved_seconds_are_priced_at_the_rate_known_at_admission_and_only_grow():
    counters = EngineCounters()
    counters.record_admission(prompt_tokens=100, cached_tokens=32, inflight_shared_tokens=0)
    assert counters.prefill_seconds_saved == 0.0  # no prefill measured yet: no rate to price the hit at
    counters.record_step(prefill_tokens=68, decode_rows=0, seconds=0.34)  # 5 ms per prefill token
    counters.record_admission(prompt_tokens=100, cached_tokens=40, inflight_shared_tokens=0)
    assert counters.prefill_seconds_saved == pytest.approx(40 * 0.005)
    first = counters.snapshot(**GAUGES).prefill_seconds_saved

    # a large prompt prefilled fast drops the mean rate 50-fold: what was saved before stays saved
    counters.record_step(prefill_tokens=10_000, decode_rows=0, seconds=1.0)
    counters.record_admission(prompt_tokens=100, cached_tokens=0, inflight_shared_tokens=0)
    assert counters.snapshot(**GAUGES).prefill_seconds_saved == first

    counters.record_admission(prompt_tokens=200, cached_tokens=100, inflight_shared_tokens=0)
    rate = 1.34 / 10_068
    assert counters.snapshot(**GAUGES).prefill_seconds_saved == pytest.approx(40 * 0.005 + 100 * rate)
    assert counters.prefix_hit_tokens == 172
