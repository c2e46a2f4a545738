"""PoolTurnover: the pool's allocation rate over a sliding window, and how long a block released now stays
cached at that rate (the idle reply prefill's residency rule)."""

from __future__ import annotations

import math

import pytest

from engine.block_pool import BlockPool
from engine.pool_turnover import PoolTurnover
from tests.engine.engine_helpers import ManualClock


def test_no_history_or_no_allocation_means_no_bound():
    pool, clock = BlockPool(10), ManualClock()
    turnover = PoolTurnover(pool, clock)
    assert turnover.rate() is None and turnover.residency_s(1) == math.inf
    turnover.sample()
    clock.now += 0.5  # less than min_span_s of history
    pool.allocate(2)
    assert turnover.rate() is None and turnover.residency_s(1) == math.inf
    clock.now += 4.5
    turnover.sample()
    assert turnover.rate() == pytest.approx(2 / 5)
    quiet = PoolTurnover(BlockPool(10), clock)
    quiet.sample()
    clock.now += 5
    assert quiet.rate() == 0 and quiet.residency_s(3) == math.inf


def test_residency_is_the_room_ahead_at_the_rate_blocks_went_out():
    pool, clock = BlockPool(10), ManualClock()
    turnover = PoolTurnover(pool, clock)
    turnover.sample()
    held = pool.allocate(4)
    clock.now += 2.0  # 4 blocks in 2 s
    assert turnover.rate() == pytest.approx(2.0)
    # 6 free blocks; taking 2 leaves 4 ahead of the new ones: 2 s
    assert turnover.residency_s(2) == pytest.approx(2.0)
    assert turnover.residency_s(8) == 0  # no room past what it takes
    pool.release(held)  # free again (no hash): 10 ahead of nothing taken
    assert turnover.residency_s(0) == pytest.approx(5.0)


def test_the_rate_forgets_what_is_older_than_the_window():
    pool, clock = BlockPool(100), ManualClock()
    turnover = PoolTurnover(pool, clock, window_s=10.0)
    turnover.sample()
    pool.allocate(50)  # a burst long ago
    for _ in range(30):
        clock.now += 1.0
        turnover.sample()
    clock.now += 1.0
    assert turnover.rate() == 0  # the burst left the window
    pool.allocate(10)
    assert turnover.rate() == pytest.approx(10 / 11)  # the kept start is the newest sample before the window


def test_samples_are_thinned_on_a_busy_engine():
    pool, clock = BlockPool(10), ManualClock()
    turnover = PoolTurnover(pool, clock, sample_every_s=0.25)
    for _ in range(100):
        clock.now += 0.01
        turnover.sample()
    assert len(turnover._samples) == 4


@pytest.mark.parametrize("kwargs", [{"window_s": 0}, {"min_span_s": -1}, {"sample_every_s": -0.1}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="window_s"):
        PoolTurnover(BlockPool(1), ManualClock(), **kwargs)
