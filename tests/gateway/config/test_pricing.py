"""Cost saved by provider prompt caching (gateway.config.pricing)."""

from __future__ import annotations

import pytest

from gateway.config.pricing import Prices, PriceTableError, cost_saved_usd, input_cost_usd

# Claude Sonnet-like prices (USD per million tokens): input 3, cache read 0.30, 5m write 3.75, 1h write 6.
SONNET = Prices.from_mapping({"input": 3.0, "cached_input": 0.3, "cache_write": 3.75, "cache_write_1h": 6.0})


def test_defaults_mean_no_discount_and_no_premium():
    prices = Prices.from_mapping({"input": 2})
    assert prices == Prices(input=2.0, cached_input=2.0, cache_write=2.0, cache_write_1h=2.0)
    assert cost_saved_usd(prices, cached_tokens=10_000, cache_creation_tokens=10_000) == 0.0


def test_openai_style_prices_write_at_input_price():
    prices = Prices.from_mapping({"input": 0.15, "cached_input": 0.075})
    assert prices.cache_write == 0.15
    assert cost_saved_usd(prices, cached_tokens=2_000_000) == pytest.approx(0.15)


def test_formula_reads_minus_write_premium():
    # saved = 1e6 * (3 - 0.3) - 2e5 * (3.75 - 3) = 2.7e6 - 1.5e5 -> / 1e6
    assert cost_saved_usd(SONNET, 1_000_000, 200_000) == pytest.approx(2.55)


def test_writes_never_read_cost_money():
    assert cost_saved_usd(SONNET, cached_tokens=0, cache_creation_tokens=1_000_000) == pytest.approx(-0.75)


def test_one_hour_writes_use_their_price():
    # 400k written with 5m TTL (premium 0.75), 600k with 1h TTL (premium 3.0)
    saved = cost_saved_usd(SONNET, 0, cache_creation_tokens=1_000_000, cache_creation_1h_tokens=600_000)
    assert saved == pytest.approx(-(0.4 * 0.75 + 0.6 * 3.0))


def test_saved_equals_cost_without_cache_minus_cost_with_it():
    prompt, cached, written = 5000, 3072, 1024
    without = input_cost_usd(SONNET, prompt)
    with_cache = input_cost_usd(SONNET, prompt, cached, written)
    assert without - with_cache == pytest.approx(cost_saved_usd(SONNET, cached, written))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"cached_input": 1.0}, "prices.input: required"),
        ({"input": -1}, "prices.input: expected a number >= 0"),
        ({"input": True}, "prices.input: expected a number >= 0"),
        ({"input": "3"}, "prices.input: expected a number >= 0"),
        ({"input": 3, "output": 15}, "unknown key(s) ['output']"),
        ([3, 0.3], "expected a mapping"),
    ],
)
def test_bad_price_tables_name_the_field(raw, message):
    with pytest.raises(PriceTableError) as info:
        Prices.from_mapping(raw)
    assert message in str(info.value)


def test_bad_counts_raise():
    with pytest.raises(ValueError):
        cost_saved_usd(SONNET, -1)
    with pytest.raises(ValueError):
        cost_saved_usd(SONNET, 0, cache_creation_tokens=10, cache_creation_1h_tokens=11)
    with pytest.raises(ValueError):
        input_cost_usd(SONNET, prompt_tokens=10, cached_tokens=8, cache_creation_tokens=3)
