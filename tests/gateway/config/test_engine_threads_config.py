"""``engine.num_threads`` and ``engine.small_step_threads`` in the gateway's YAML: parsed into ``EngineConfig``,
every bad value a ``ConfigError`` naming the file, key path and expectation (``engine.step_threads``)."""

from __future__ import annotations

import pytest

from gateway.config.loader import parse_config
from gateway.config.schema import ConfigError


def engine_of(section: dict):
    config = parse_config({"models": [{"name": "m", "path": "default", "engine": section}]}, source="c.yaml")
    return config.models[0].engine


@pytest.mark.parametrize(("value", "parsed"), [("auto", "auto"), ("off", "off"), (1, 1), (3, 3)])
def test_small_step_threads_values(value, parsed):
    engine = engine_of({"num_threads": 2, "small_step_threads": value})
    assert (engine.num_threads, engine.small_step_threads) == (2, parsed)


def test_small_step_threads_defaults_to_auto():
    assert engine_of({}).small_step_threads == "auto"


@pytest.mark.parametrize(
    ("section", "key", "problem"),
    [
        ({"small_step_threads": "fast"}, "small_step_threads", "expected 'auto', 'off' or an integer >= 1"),
        ({"small_step_threads": 0}, "small_step_threads", "expected 'auto', 'off' or an integer >= 1"),
        ({"small_step_threads": -1}, "small_step_threads", "got -1"),
        ({"small_step_threads": None}, "small_step_threads", "got null"),
        ({"small_step_threads": 1.5}, "small_step_threads", "expected"),
        ({"num_threads": 0}, "num_threads", "expected an integer >= 1 or null"),
    ],
)
def test_bad_thread_settings_name_file_key_and_expectation(section: dict, key: str, problem: str):
    with pytest.raises(ConfigError) as caught:
        engine_of(section)
    assert caught.value.source == "c.yaml"
    assert caught.value.key == f"models[0].engine.{key}"
    assert problem in caught.value.problem
