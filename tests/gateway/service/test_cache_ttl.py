"""Retention choice (5m vs 1h, in_memory vs 24h) from scripted reuse intervals: exact expected choices."""

from __future__ import annotations

import math

import pytest

from gateway.config.price_table import load_price_table
from gateway.service.cache_ttl import (
    NO_CACHE,
    RetentionOption,
    ReuseTracker,
    Sample,
    choose_retention,
    expected_cost,
    never_share,
    options_for,
    reuse_share,
)

MIN, HOUR = 60.0, 3600.0
# Claude Haiku 4.5: input 1, read 0.1, 5m write 1.25, 1h write 2 (USD per million tokens).
ANTHROPIC = [RetentionOption("5m", 300, 1.25), RetentionOption("1h", 3600, 2.0)]
OPENAI = [RetentionOption("in_memory", 300, 1.5625), RetentionOption("24h", 86400, 1.5625)]


def _choose(intervals, options=ANTHROPIC, *, allow_none=False, input_price=1.0, read_price=0.1, default=None):
    return choose_retention(
        [Sample(s) for s in intervals],
        options,
        input_price=input_price,
        read_price=read_price,
        default=default or options[0].name,
        allow_none=allow_none,
    )


@pytest.mark.parametrize(
    ("intervals", "allow_none", "expected"),
    [
        ([MIN] * 5, True, "5m"),  # F5 = F1 = 1: tie at the read price; the shorter TTL wins the tie
        ([20 * MIN] * 3, True, "1h"),  # F5 = 0, F1 = 1: 1.25 vs 0.1
        ([2 * HOUR] * 3, True, NO_CACHE),  # never within an hour: 1.25, 2.0 vs plain input 1.0
        ([2 * HOUR] * 3, False, "5m"),  # same, where "none" is not allowed: the cheaper write
        ([MIN] * 8 + [20 * MIN] * 2, True, "1h"),  # F5 .8, F1 1: 0.33 vs 0.10
        ([MIN] * 6 + [20 * MIN] + [2 * HOUR] * 3, True, "5m"),  # F5 .6, F1 .7: 0.56 vs 0.67
        ([MIN] * 4 + [20 * MIN] * 3 + [2 * HOUR] * 3, True, "1h"),  # F5 .4, F1 .7: 0.79 vs 0.67
        ([MIN] + [2 * HOUR] * 4, True, NO_CACHE),  # F5 = F1 = .2: 1.02, 1.62 vs 1.0
        ([MIN] * 3 + [2 * HOUR] * 7, True, "5m"),  # F5 = F1 = .3: 0.905 vs 1.0
    ],
)
def test_anthropic_ttl_choice_for_scripted_intervals(intervals, allow_none, expected):
    assert _choose(intervals, allow_none=allow_none).retention == expected


def test_the_expected_costs_follow_the_formula():
    choice = _choose([MIN] * 4 + [20 * MIN] * 3 + [2 * HOUR] * 3, allow_none=True)
    assert choice.reuse_share == {"5m": pytest.approx(0.4), "1h": pytest.approx(0.7)}
    assert choice.expected_cost["5m"] == pytest.approx(0.4 * 0.1 + 0.6 * 1.25)
    assert choice.expected_cost["1h"] == pytest.approx(0.7 * 0.1 + 0.3 * 2.0)
    assert choice.expected_cost[NO_CACHE] == 1.0
    # The closed form for Anthropic's multipliers: 1h wins iff 1.9 F(1h) - 1.15 F(5m) > 0.75.
    assert 1.9 * 0.7 - 1.15 * 0.4 > 0.75
    assert expected_cost(0.5, ANTHROPIC[1], 0.1) == pytest.approx(1.05)
    assert expected_cost(0.5, ANTHROPIC[1], 0.1, growth=0.5) == pytest.approx(2.05)


@pytest.mark.parametrize(
    "intervals",
    [[MIN] * 4, [20 * MIN] * 4, [48 * HOUR] * 4, [MIN] * 9 + [3 * HOUR], []],
)
def test_openai_24h_dominates_in_memory_at_equal_prices(intervals):
    choice = _choose(intervals, OPENAI, input_price=1.25, read_price=0.125)
    assert choice.retention == "24h"
    gpt4o = [RetentionOption("in_memory", 300, 2.5)]
    assert _choose(intervals, gpt4o, input_price=2.5, read_price=1.25).retention == "in_memory"


def test_growth_charges_the_dearer_write_on_every_new_token():
    twenty = [20 * MIN] * 3
    assert _choose(twenty).retention == "1h"  # 1.25 vs 0.10
    assert (
        choose_retention(
            [Sample(s) for s in twenty], ANTHROPIC, input_price=1, read_price=0.1, default="5m", growth=1.5
        ).retention
        == "1h"
    )  # 3.125 vs 3.10
    grown = {"input_price": 1, "read_price": 0.1, "default": "5m", "growth": 2.0}
    assert choose_retention([Sample(s) for s in twenty], ANTHROPIC, **grown).retention == "5m"  # 3.75 vs 4.10
    assert (
        choose_retention([Sample(s) for s in twenty], ANTHROPIC, allow_none=True, **grown).retention
        == NO_CACHE
    )
    with pytest.raises(ValueError, match="growth"):
        choose_retention([], ANTHROPIC, input_price=1, read_price=0.1, default="5m", growth=-1)


def test_samples_are_weighted_by_prefix_tokens():
    assert reuse_share([Sample(60, 1_000), Sample(1_200, 9_000)], 300) == pytest.approx(0.1)
    assert reuse_share([Sample(math.inf, 5)], 3600) == 0.0
    assert reuse_share([], 300) is None


def test_a_prefix_that_never_comes_back_costs_only_its_write():
    samples = [Sample(60)] * 3 + [Sample(math.inf)]
    assert never_share(samples) == pytest.approx(0.25)
    choice = choose_retention(
        samples, ANTHROPIC, input_price=1, read_price=0.1, default="5m", allow_none=True
    )
    # F5 = F1 = .75, N = .25: 5m .075, 1h .075 (tie: 5m), no marker .75
    assert choice.retention == "5m"
    assert choice.expected_cost == {"5m": pytest.approx(0.075), "1h": pytest.approx(0.075), NO_CACHE: 0.75}
    # the last step of an agent turn: a little growth, some returns after a review, some never
    steps = [Sample(10)] * 89 + [Sample(20 * 60)] * 6 + [Sample(math.inf)] * 5
    step = {"input_price": 1, "read_price": 0.1, "default": "5m", "growth": 0.08}
    assert choose_retention(steps, ANTHROPIC, **step).retention == "1h"  # .2640 vs .2550


def _pick(tracker, key, scope, t, allow_none=False):
    return tracker.choose(
        key, scope, ANTHROPIC, input_price=1, read_price=0.1, default="5m", allow_none=allow_none, now=t
    )


def test_tracker_scripted_arrivals_give_exact_choices():
    tracker = ReuseTracker(clock=lambda: 0.0)
    choices = []
    for t in [0, 60, 120, 1320, 2520, 2580]:
        tracker.observe("prefix-a", "claude/tenant-1", now=t)
        choices.append(_pick(tracker, "prefix-a", "claude/tenant-1", t).retention)
    # no data; 60 s; 60, 60; 60, 60, 1200: 0.483 vs 0.1; ...
    assert choices == ["5m", "5m", "5m", "1h", "1h", "1h"]


def test_growth_is_read_off_the_arrivals():
    tracker = ReuseTracker(clock=lambda: 0.0)
    tracker.observe("conv", "s", now=0.0, tokens=1_000)
    assert tracker.growth("conv", "s") == 1.0  # a first arrival: all of it is new
    tracker.observe("conv", "s", now=60.0, tokens=1_500)
    assert tracker.growth("conv", "s") == pytest.approx(1 / 3)  # 500 new tokens of 1,500
    tracker.observe("conv", "s", now=1_000.0, tokens=2_000)
    assert tracker.growth("conv", "s") == pytest.approx(1 / 4)
    tracker.observe("conv", "s", now=1_060.0, tokens=2_000)
    assert tracker.growth("conv", "s") == 0.0


def test_keys_that_never_come_back_teach_their_scope_to_skip_the_cache():
    tracker = ReuseTracker(horizon_s=3_600.0, clock=lambda: 0.0)
    for i in range(5):  # five one-off documents of one scope
        tracker.observe(f"doc-{i}", "batch/doc", now=float(i), tokens=5_000)
    tracker.observe("young", "batch/doc", now=100.0, tokens=5_000)
    young = _pick(tracker, "young", "batch/doc", 100.0, allow_none=True)
    assert (young.retention, young.basis) == ("5m", "default")  # nothing is known yet
    tracker.observe("late", "batch/doc", now=4_000.0, tokens=5_000)
    late = _pick(tracker, "late", "batch/doc", 4_000.0, allow_none=True)
    # six never came back (a first arrival: g = 1, N = 1): 5m costs 1.25, 1h 2, no marker 1 (per prefix token)
    assert (late.retention, late.basis) == (NO_CACHE, "pooled")
    assert late.expected_cost == {"5m": 1.25, "1h": 2.0, NO_CACHE: 1.0}
    assert _pick(tracker, "late", "batch/doc", 4_000.0).retention == "5m"  # where no marker is not allowed
    tracker.observe("other", "chat/history", now=4_000.0)
    assert (
        _pick(tracker, "other", "chat/history", 4_000.0).basis == "default"
    )  # another scope learned nothing


def test_a_key_is_judged_with_its_scope():
    tracker = ReuseTracker(prior_samples=3, clock=lambda: 0.0)
    for t in (0.0, 30.0, 1_230.0):  # another session of the scope: a 30 s step, then a 20 min review
        tracker.observe("s1", "agent/history", now=t, tokens=1_000)
    for t in (2_000.0, 2_030.0, 2_060.0):
        tracker.observe("s2", "agent/history", now=t, tokens=1_000)
    samples, basis = tracker.samples("s2", "agent/history", now=2_060.0)
    assert basis == "blend"
    # own: 30, 30 (weight 1,000 each); scope: 30, 1200, 30, 30 scaled to weigh as 3 own samples
    assert reuse_share(samples, 300) == pytest.approx((2 + 3 * 3 / 4) / 5)


def test_bounds_and_bad_arguments():
    tracker = ReuseTracker(max_keys=2, clock=lambda: 0.0)
    for key in "abc":
        tracker.observe(key, None, now=0.0)
    assert len(tracker) == 2
    with pytest.raises(ValueError):
        ReuseTracker(per_key=0)
    with pytest.raises(ValueError, match="default retention"):
        choose_retention([], ANTHROPIC, input_price=1, read_price=0.1, default="24h")
    with pytest.raises(ValueError, match="at least one"):
        choose_retention([], [], input_price=1, read_price=0.1, default="5m")


def test_options_from_the_price_table():
    prices = load_price_table().lookup("claude-sonnet-4-5")
    assert options_for(prices) == [RetentionOption("5m", 300.0, 3.75), RetentionOption("1h", 3600.0, 6.0)]
    assert options_for(load_price_table().lookup("gpt-4o")) == [RetentionOption("in_memory", 300.0, 2.5)]
