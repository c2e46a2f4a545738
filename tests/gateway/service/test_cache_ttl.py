"""Retention choice (5m vs 1h, in_memory vs 24h) from scripted reuse intervals: exact expected choices."""

from __future__ import annotations

import math

import pytest

from gateway.service.cache_ttl import (
    NO_CACHE,
    RetentionOption,
    ReuseTracker,
    Sample,
    choose_retention,
    expected_cost,
    options_for,
    reuse_share,
)
from gateway.service.price_table import load_price_table

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


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([MIN] * 4, "in_memory"),  # both hit: same price, the shorter retention
        ([20 * MIN] * 4, "24h"),  # beyond the in-memory lifetime, within 24 hours
        ([48 * HOUR] * 4, "in_memory"),  # both miss: same write price, the shorter retention
        ([MIN] * 9 + [3 * HOUR], "24h"),  # any interval between the lifetimes tips it (prices are equal)
    ],
)
def test_openai_retention_choice(intervals, expected):
    assert _choose(intervals, OPENAI, input_price=1.25, read_price=0.125).retention == expected


def test_censored_samples_count_as_misses_only_for_shorter_lifetimes():
    samples = [Sample(600, censored=True), Sample(60)]
    assert reuse_share(samples, 300) == pytest.approx(0.5)  # the 600 s wait is a miss for 5 minutes
    assert reuse_share(samples, 3600) == pytest.approx(1.0)  # and unknown for an hour
    assert reuse_share([Sample(100, censored=True)], 300) is None


def test_tracker_scripted_arrivals_give_exact_choices():
    tracker = ReuseTracker(min_samples=3, clock=lambda: 0.0)
    arrivals = [0, 60, 120, 1320, 2520, 2580]
    choices = []
    for t in arrivals:
        tracker.observe("prefix-a", "claude/tenant-1", now=t)
        choices.append(
            tracker.choose(
                "prefix-a", "claude/tenant-1", ANTHROPIC, input_price=1, read_price=0.1, default="5m", now=t
            ).retention
        )
    # no data; own 60 + pooled 60; own 60, 60 (+ pooled); own 60, 60, 1200: 0.483 vs 0.1; ...
    assert choices == ["5m", "5m", "5m", "1h", "1h", "1h"]


def test_a_new_key_borrows_what_first_arrivals_of_its_scope_did():
    tracker = ReuseTracker(min_samples=3, clock=lambda: 0.0)
    for i in range(5):  # five one-off prompts of the same scope
        tracker.observe(f"one-off-{i}", "scope", now=float(i))
    kwargs = {"input_price": 1.0, "read_price": 0.1, "default": "5m", "allow_none": True}
    tracker.observe("new", "scope", now=100.0)
    young = tracker.choose("new", "scope", ANTHROPIC, now=100.0, **kwargs)
    assert (young.retention, young.basis) == ("5m", "default")  # none of them is 5 minutes old yet
    tracker.observe("newer", "scope", now=4000.0)
    old = tracker.choose("newer", "scope", ANTHROPIC, now=4000.0, **kwargs)
    assert (old.retention, old.basis) == (NO_CACHE, "pooled")  # none came back within the hour
    strict = tracker.choose("newer", "scope", ANTHROPIC, now=4000.0, **{**kwargs, "allow_none": False})
    assert strict.retention == "5m"
    # another scope learned nothing from these
    tracker.observe("other", "scope-2", now=4000.0)
    assert tracker.choose("other", "scope-2", ANTHROPIC, now=4000.0, **kwargs).basis == "default"


def test_first_arrivals_past_the_horizon_become_never_returned_samples():
    tracker = ReuseTracker(horizon_s=1000.0, clock=lambda: 0.0)
    tracker.observe("a", "s", now=0.0)
    tracker.observe("b", "s", now=2000.0)
    samples, basis = tracker.samples("c", "s", now=2000.0)
    assert basis == "pooled"
    assert [s.seconds for s in samples if not s.censored] == [math.inf]


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
