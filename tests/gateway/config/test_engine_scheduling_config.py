"""``engine.long_prefill_token_threshold`` in the gateway's YAML: parsed into ``EngineConfig`` (null = half the step
budget, resolved by the scheduler), every bad value a ``ConfigError`` naming the file, key path and expectation."""

from __future__ import annotations

import pytest

from gateway.config.loader import parse_config
from gateway.config.schema import ConfigError


def engine_of(section: dict):
    config = parse_config({"models": [{"name": "m", "path": "default", "engine": section}]}, source="c.yaml")
    return config.models[0].engine


@pytest.mark.parametrize(
    ("section", "parsed"),
    [
        ({}, None),
        ({"long_prefill_token_threshold": None}, None),
        ({"long_prefill_token_threshold": 0}, 0),
        ({"long_prefill_token_threshold": 128}, 128),
        ({"long_prefill_token_threshold": 511}, 511),
        ({"max_num_batched_tokens": 2048, "long_prefill_token_threshold": 1024}, 1024),
    ],
)
def test_long_prefill_threshold_values(section: dict, parsed):
    assert engine_of(section).long_prefill_token_threshold == parsed


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ({"long_prefill_token_threshold": -1}, "expected null, 0 (off) or an integer in [1, 511]"),
        ({"long_prefill_token_threshold": 512}, "below max_num_batched_tokens 512), got 512"),
        ({"max_num_batched_tokens": 64, "long_prefill_token_threshold": 100}, "in [1, 63]"),
        ({"long_prefill_token_threshold": "half"}, "expected"),
        ({"long_prefill_token_threshold": 1.5}, "expected"),
    ],
)
def test_bad_long_prefill_threshold_names_file_key_and_expectation(section: dict, problem: str):
    with pytest.raises(ConfigError) as caught:
        engine_of(section)
    assert caught.value.source == "c.yaml"
    assert caught.value.key == "models[0].engine.long_prefill_token_threshold"
    assert problem in caught.value.problem
