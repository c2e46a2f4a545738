"""The shipped price table, its validation (file + key in every error) and config overrides."""

from __future__ import annotations

import math

import pytest
import yaml

from gateway.config.price_table import (
    PriceTableError,
    load_price_table,
    override_prices,
    parse_price_table,
)


def _table(**model: object) -> dict:
    entry = {"input": 3.0, "cache_read": 0.3, "output": 15.0, "cache_write": {"5m": 3.75, "1h": 6.0}}
    entry.update(model)
    return {
        "checked": "2026-12-01",
        "providers": {
            "anthropic": {
                "source": "https://example.invalid/pricing",
                "retentions": {"5m": 300, "1h": 3600},
                "default_retention": "5m",
                "models": {"claude-x": entry},
            }
        },
    }


def test_shipped_table_loads_with_its_date_and_anthropic_multipliers():
    table = load_price_table()
    assert table.checked == "2026-12-01"
    assert set(table.providers()) >= {"anthropic", "openai", "deepseek", "gemini", "bedrock"}
    for prices in table.models["anthropic"].values():
        # The page rounds the old Haiku 3 prices ($0.30 for 1.25 x $0.25), hence the tolerance.
        assert math.isclose(prices.write_price("5m"), 1.25 * prices.input, rel_tol=0.05)
        assert math.isclose(prices.write_price("1h"), 2.0 * prices.input, rel_tol=0.05)
        assert prices.cache_read <= 0.12 * prices.input
        assert 512 <= prices.min_cacheable_tokens <= 4096
    # Claude Fable 5.1 reads are cheaper than 0.1x (0.025x), per the pricing page.
    assert math.isclose(table.lookup("claude-fable-5-1").cache_read, 0.25)


def test_every_shipped_model_prices_output_above_input():
    """Output prices are in the table for every model (issue 14: spend prices output too); on every listed
    model a generated token costs 4x to 8x an uncached input token (the providers' pages)."""
    table = load_price_table()
    for provider, models in table.models.items():
        for name, prices in models.items():
            assert prices.output is not None, (provider, name)
            ratio = prices.output / prices.input
            assert 3.9 <= ratio <= 24.0, (provider, name, ratio)
    assert (table.lookup("claude-sonnet-4-5").output, table.lookup("gpt-4o-mini").output) == (15.0, 0.6)
    assert table.lookup("claude-opus-4-1-20250805").output == 75.0


def test_lookup_takes_the_longest_model_prefix_and_ignores_a_provider_prefix():
    table = load_price_table()
    assert table.lookup("claude-opus-4-5-20251101").model == "claude-opus-4-5"
    assert table.lookup("claude-opus-4-20250514").model == "claude-opus-4"
    assert table.lookup("anthropic/claude-haiku-4-5").model == "claude-haiku-4-5"
    assert table.lookup("gpt-5.6-sol").cache_write == {"in_memory": 6.25, "24h": 6.25}
    assert table.lookup("gpt-4o-mini").retentions == {"in_memory": 300.0}
    assert table.lookup("claude-opus-4-5", provider="openai") is None
    assert table.lookup("no-such-model") is None


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"input": -1.0}, "providers.anthropic.models.claude-x.input"),
        ({"cache_read": "cheap"}, "providers.anthropic.models.claude-x.cache_read"),
        ({"cache_write": {"5m": 3.75, "1h": -6.0}}, "providers.anthropic.models.claude-x.cache_write.1h"),
        ({"cache_write": {"5m": 3.75, "2h": 6.0}}, "providers.anthropic.models.claude-x.cache_write.2h"),
        ({"cache_write": {"1h": 6.0}}, "providers.anthropic.models.claude-x.cache_write.5m"),
        ({"input": True}, "providers.anthropic.models.claude-x.input"),
        ({"input": float("nan")}, "providers.anthropic.models.claude-x.input"),
        ({"bogus": 1}, "providers.anthropic.models.claude-x"),
        ({"output": -15.0}, "providers.anthropic.models.claude-x.output"),
        ({"output": "a lot"}, "providers.anthropic.models.claude-x.output"),
    ],
)
def test_a_bad_price_names_the_file_and_the_key(change, key):
    with pytest.raises(PriceTableError) as info:
        parse_price_table(_table(**change), "conf/prices.yaml")
    assert str(info.value).startswith(f"conf/prices.yaml: {key}")


def test_a_missing_price_names_the_file_and_the_key(tmp_path):
    raw = _table()
    del raw["providers"]["anthropic"]["models"]["claude-x"]["cache_read"]
    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(
        PriceTableError, match=r"prices.yaml: providers.anthropic.models.claude-x.cache_read: missing"
    ):
        load_price_table(path)


def test_a_missing_output_price_stops_the_table():
    raw = _table()
    del raw["providers"]["anthropic"]["models"]["claude-x"]["output"]
    with pytest.raises(
        PriceTableError, match=r"^p.yaml: providers.anthropic.models.claude-x.output: missing"
    ):
        parse_price_table(raw, "p.yaml")


def test_missing_date_bad_lifetime_and_unreadable_file(tmp_path):
    raw = _table()
    del raw["checked"]
    with pytest.raises(PriceTableError, match="checked: missing"):
        parse_price_table(raw, "p.yaml")
    raw = _table()
    raw["providers"]["anthropic"]["retentions"]["5m"] = 0
    with pytest.raises(PriceTableError, match=r"retentions.5m: expected a lifetime > 0"):
        parse_price_table(raw, "p.yaml")
    with pytest.raises(PriceTableError, match="cannot read"):
        load_price_table(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("checked: [\n")
    with pytest.raises(PriceTableError, match="not valid YAML"):
        load_price_table(tmp_path / "bad.yaml")


def test_override_in_the_table_shape_and_in_the_old_config_shape():
    base = parse_price_table(_table()).lookup("claude-x")
    new = override_prices(
        base, {"cache_read": 0.2, "cache_write": {"1h": 5.0}}, "cfg", provider="anthropic", model="m"
    )
    assert (new.input, new.cache_read, dict(new.cache_write)) == (3.0, 0.2, {"5m": 3.75, "1h": 5.0})
    assert new.source == "config"
    old = override_prices(
        base,
        {"input": 2.0, "cached_input": 0.2, "cache_write": 2.5, "cache_write_1h": 4.0},
        "cfg",
        provider="anthropic",
        model="m",
    )
    assert (old.input, old.cache_read, dict(old.cache_write)) == (2.0, 0.2, {"5m": 2.5, "1h": 4.0})
    assert old.output == 15.0  # kept from the table
    assert override_prices(base, {"output": 12.0}, "cfg", provider="anthropic", model="m").output == 12.0
    assert override_prices(base, {"input": 2.0, "output": 9.0}, "cfg", provider="a", model="m").output == 9.0
    with pytest.raises(PriceTableError, match=r"^cfg.output: expected a number >= 0"):
        override_prices(base, {"output": -1}, "cfg", provider="anthropic", model="m")


def test_override_errors_name_the_config_place():
    base = parse_price_table(_table()).lookup("claude-x")
    with pytest.raises(PriceTableError, match=r"^models.a.prices.cache_read: expected a number >= 0"):
        override_prices(base, {"cache_read": -0.1}, "models.a.prices", provider="anthropic", model="a")
    with pytest.raises(PriceTableError, match=r"^models.a.prices: unknown key"):
        override_prices(
            base, {"cached_input": 0.1, "discount": 3}, "models.a.prices", provider="anthropic", model="a"
        )
    with pytest.raises(PriceTableError, match=r"cache_write.24h: unknown retention"):
        override_prices(
            base, {"cache_write": {"24h": 1.0}}, "models.a.prices", provider="anthropic", model="a"
        )
    with pytest.raises(PriceTableError, match=r"^models.b.prices.input: missing"):
        override_prices(None, {"cache_read": 1.0}, "models.b.prices", provider="openai", model="b")
    with pytest.raises(PriceTableError, match=r"^models.b.prices.input: expected a number >= 0"):
        override_prices(None, {"input": -1}, "models.b.prices", provider="openai", model="b")
    assert override_prices(None, {"input": 2}, "m", provider="openai", model="b").cache_read == 2.0


def test_override_of_a_model_the_table_lacks():
    prices = override_prices(
        None, {"input": 1.0, "cached_input": 0.25}, "cfg", provider="openai", model="local"
    )
    assert (prices.input, prices.cache_read, prices.write_price(None)) == (1.0, 0.25, 1.0)
    assert prices.output is None  # not given: output not priced
    priced = override_prices(None, {"input": 1.0, "output": 4.0}, "cfg", provider="openai", model="local")
    assert priced.output == 4.0


def test_override_errors_list_names_without_python_lists():
    # Before: "this model has no 1h retention (['default'])" and "unknown key(s) ['discount']; expected [...]"
    with pytest.raises(PriceTableError) as caught:
        override_prices(None, {"input": 1.0, "cache_write_1h": 2.0}, "cfg", provider="openai", model="local")
    assert str(caught.value) == "cfg.cache_write_1h: this model has no 1h retention (its retentions: default)"
    with pytest.raises(PriceTableError) as caught:
        override_prices(None, {"input": 1.0, "discount": 3}, "cfg", provider="openai", model="local")
    assert "unknown key(s) discount; expected cache_read, cache_write, input" in str(caught.value)
    assert "[" not in str(caught.value)
