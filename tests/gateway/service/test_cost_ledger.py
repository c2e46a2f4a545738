"""Cost paid, saved, write premium and write waste per request and per model / key / tenant."""

from __future__ import annotations

import pytest

from gateway.config.price_table import load_price_table
from gateway.core.cache_usage import CacheUsage, CacheUsageError
from gateway.service.cost_ledger import CostLedger, request_cost

TABLE = load_price_table()
HAIKU = TABLE.lookup("claude-haiku-4-5")  # input 1, read 0.1, 5m write 1.25, 1h write 2 (USD / MTok)
OPUS = TABLE.lookup("claude-opus-4-5")  # input 5, read 0.5, 5m write 6.25, 1h write 10
GPT = TABLE.lookup("gpt-5.6")  # input 5, read 0.5, writes 6.25


@pytest.mark.parametrize(
    ("prices", "usage", "paid", "saved", "premium"),
    [
        (HAIKU, CacheUsage(10_000, 0, {"5m": 8_000}), 0.012, 0.0, 0.002),
        (HAIKU, CacheUsage(10_500, 8_000, {"5m": 2_000}), 0.0038, 0.0072, 0.0005),
        (HAIKU, CacheUsage(10_000, 0, {"1h": 6_000, "5m": 2_000}), 0.0165, 0.0, 0.0065),
        (OPUS, CacheUsage(20_000, 16_000, {}), 0.028, 0.072, 0.0),
        (GPT, CacheUsage(4_000, 2_048, {"24h": 1_024}), 0.012064, 0.009216, 0.00128),
    ],
)
def test_request_cost_arithmetic_per_model(prices, usage, paid, saved, premium):
    cost = request_cost(prices, usage)
    assert (cost.paid, cost.saved, cost.write_premium) == (
        pytest.approx(paid),
        pytest.approx(saved),
        pytest.approx(premium),
    )
    assert cost.paid == pytest.approx(cost.uncached - cost.saved + cost.write_premium)


def test_header_value():
    cost = request_cost(HAIKU, CacheUsage(10_500, 8_000, {"5m": 2_000}))
    assert cost.header_value() == (
        "paid=0.00380000; saved=0.00720000; write_premium=0.00050000; output=0.00000000"
    )
    with_output = request_cost(HAIKU, CacheUsage(10_500, 8_000, {"5m": 2_000}), completion_tokens=200)
    assert with_output.header_value().endswith("; output=0.00100000")


@pytest.mark.parametrize(
    ("prices", "usage", "completion", "spend"),
    [
        # Haiku 4.5: 500 plain x $1 + 8000 read x $0.1 + 2000 5m-write x $1.25 + 200 out x $5 (per MTok)
        (HAIKU, CacheUsage(10_500, 8_000, {"5m": 2_000}), 200, 0.0038 + 0.001),
        # Opus 4.5: 4000 plain x $5 + 16000 read x $0.5 + 1000 out x $25
        (OPUS, CacheUsage(20_000, 16_000, {}), 1_000, 0.028 + 0.025),
        # gpt-5.6: 928 plain x $5 + 2048 read x $0.5 + 1024 24h-write x $6.25 + 100 out x $30
        (GPT, CacheUsage(4_000, 2_048, {"24h": 1_024}), 100, 0.012064 + 0.003),
    ],
)
def test_spend_is_input_by_cache_class_plus_output(prices, usage, completion, spend):
    cost = request_cost(prices, usage, completion)
    assert cost.output == pytest.approx(completion * prices.output / 1e6)
    assert cost.spend == pytest.approx(spend)
    assert cost.spend == pytest.approx(cost.paid + cost.output)


def test_output_of_a_model_without_an_output_price_costs_nothing_and_negative_counts_are_refused():
    from dataclasses import replace

    unpriced = replace(HAIKU, output=None)
    assert request_cost(unpriced, CacheUsage(1_000), 500).output == 0.0
    with pytest.raises(CacheUsageError, match="completion tokens"):
        request_cost(HAIKU, CacheUsage(1_000), -1)


def test_ledger_totals_count_output_cost():
    ledger = CostLedger(clock=lambda: 0.0)
    ledger.record(
        model="haiku", prices=HAIKU, usage=CacheUsage(1_000), tenant="t", key="k", completion_tokens=400
    )
    snap = ledger.snapshot(now=0.0)
    assert snap["by_tenant"]["t"]["output_cost_usd"] == pytest.approx(0.002)
    assert snap["by_model"]["haiku"]["cost_paid_usd"] == pytest.approx(0.001)


@pytest.mark.parametrize(
    ("usage", "match"),
    [
        (CacheUsage(100, 80, {"5m": 30}), "exceed the prompt tokens"),
        (CacheUsage(-1), ">= 0"),
        (CacheUsage(100, 0, {"24h": 10}), "retention '24h'"),
    ],
)
def test_usage_that_cannot_be_priced(usage, match):
    with pytest.raises(CacheUsageError, match=match):
        request_cost(HAIKU, usage)


def test_write_waste_is_the_premium_of_writes_never_read_before_expiry():
    ledger = CostLedger(clock=lambda: 0.0)
    kw = {"model": "haiku", "prices": HAIKU, "tenant": "t1", "key": "k1", "entry_key": "p"}
    ledger.record(usage=CacheUsage(10_000, 0, {"5m": 8_000}), now=0.0, **kw)  # writes [0, 8000)
    ledger.record(
        usage=CacheUsage(10_500, 8_000, {"5m": 2_000}), now=100.0, **kw
    )  # reads it, writes [8000, 10000)
    snap = ledger.snapshot(now=1_000.0)  # the second write expired at 400 unread
    model = snap["by_model"]["haiku"]
    assert model["requests"] == 2
    assert model["cost_paid_usd"] == pytest.approx(0.0158)
    assert model["cost_saved_usd"] == pytest.approx(0.0072)
    assert model["write_premium_usd"] == pytest.approx(0.0025)
    assert model["wasted_write_tokens"] == 2_000
    assert model["write_waste_usd"] == pytest.approx(0.0005)
    assert snap["by_key"]["k1"] == model and snap["by_tenant"]["t1"] == model
    assert snap["outstanding_writes"] == 0


def test_a_1h_write_read_after_20_minutes_is_not_waste_and_a_5m_one_would_be():
    ledger = CostLedger(clock=lambda: 0.0)
    base = {"model": "haiku", "prices": HAIKU, "tenant": "t", "key": "k"}
    ledger.record(usage=CacheUsage(5_000, 0, {"1h": 5_000}), entry_key="a", now=0.0, **base)
    ledger.record(usage=CacheUsage(5_100, 5_000, {}), entry_key="a", now=1_200.0, **base)
    ledger.record(usage=CacheUsage(5_000, 0, {"5m": 5_000}), entry_key="b", now=0.0, **base)
    ledger.record(usage=CacheUsage(5_100, 0, {"5m": 5_000}), entry_key="b", now=1_200.0, **base)
    snap = ledger.snapshot(now=1_300.0)
    # only b's first write (expired at 300, never read) is waste; b's second is still live at 1300
    assert snap["by_model"]["haiku"]["wasted_write_tokens"] == 5_000
    assert snap["by_model"]["haiku"]["write_waste_usd"] == pytest.approx(5_000 * 0.25 / 1e6)
    assert snap["outstanding_writes"] == 1


def test_a_partial_read_leaves_the_rest_outstanding_and_owners_are_kept_apart():
    ledger = CostLedger(clock=lambda: 0.0)
    ledger.record(
        model="haiku", prices=HAIKU, usage=CacheUsage(9_000, 0, {"5m": 8_000}),
        tenant="t1", key="k1", entry_key="p", now=0.0,
    )  # fmt: skip
    ledger.record(
        model="haiku", prices=HAIKU, usage=CacheUsage(4_500, 4_000, {}),
        tenant="t2", key="k2", entry_key="p", now=10.0,
    )  # fmt: skip
    snap = ledger.snapshot(now=400.0)
    # t2's read is under another tenant: it does not consume t1's write (tenants never share a cache entry)
    assert snap["by_tenant"]["t1"]["wasted_write_tokens"] == 8_000
    assert snap["by_tenant"]["t2"]["wasted_write_tokens"] == 0
    ledger2 = CostLedger(clock=lambda: 0.0)
    for read, write, t in ((0, 8_000, 0.0), (4_000, 0, 10.0)):
        ledger2.record(
            model="m", prices=HAIKU, usage=CacheUsage(9_000, read, {"5m": write} if write else {}),
            tenant="t", key="k", entry_key="p", now=t,
        )  # fmt: skip
    assert ledger2.snapshot(now=400.0)["by_model"]["m"]["wasted_write_tokens"] == 4_000


def test_writes_of_one_request_are_laid_out_1h_first_and_the_clock_is_injected():
    now = [0.0]
    ledger = CostLedger(clock=lambda: now[0])
    ledger.record(
        model="m", prices=HAIKU, usage=CacheUsage(9_000, 0, {"5m": 3_000, "1h": 5_000}), entry_key="p"
    )
    now[0] = 200.0
    ledger.record(
        model="m", prices=HAIKU, usage=CacheUsage(9_000, 5_000, {}), entry_key="p"
    )  # reads the 1h part
    now[0] = 10_000.0
    snap = ledger.snapshot()
    assert snap["by_model"]["m"]["wasted_write_tokens"] == 3_000  # the 5m part, never read


def test_outstanding_regions_are_bounded():
    ledger = CostLedger(max_regions=2, clock=lambda: 0.0)
    for key in "abc":
        ledger.record(
            model="m", prices=HAIKU, usage=CacheUsage(2_000, 0, {"5m": 1_000}), entry_key=key, now=0.0
        )
    snap = ledger.snapshot(now=0.0)
    assert (snap["outstanding_writes"], snap["dropped_regions"]) == (2, 1)
    few_keys = CostLedger(max_keys=2, clock=lambda: 0.0)
    for key in "abc":
        few_keys.record(model="m", prices=HAIKU, usage=CacheUsage(10), key=key, now=0.0)
    snap = few_keys.snapshot(now=0.0)
    assert list(snap["by_key"]) == ["b", "c"] and snap["evicted_keys"] == 1
    assert snap["by_model"]["m"]["requests"] == 3
    with pytest.raises(ValueError):
        CostLedger(max_regions=0)
