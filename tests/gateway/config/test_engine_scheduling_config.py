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


def test_idle_reply_prefill_settings_parse_with_their_defaults():
    assert (engine_of({}).idle_reply_prefill, engine_of({}).idle_prefill_chunk_tokens) == (True, 64)
    assert engine_of({}).idle_prefill_min_residency_s == 5.0
    parsed = engine_of(
        {"idle_reply_prefill": False, "idle_prefill_chunk_tokens": 32, "idle_prefill_min_residency_s": 0}
    )
    assert (parsed.idle_reply_prefill, parsed.idle_prefill_chunk_tokens) == (False, 32)
    assert parsed.idle_prefill_min_residency_s == 0


@pytest.mark.parametrize(
    ("section", "key", "problem"),
    [
        ({"idle_prefill_chunk_tokens": 0}, "idle_prefill_chunk_tokens", "expected an integer >= 1, got 0"),
        ({"idle_prefill_chunk_tokens": "64"}, "idle_prefill_chunk_tokens", "expected"),
        ({"idle_reply_prefill": "yes"}, "idle_reply_prefill", "expected"),
        (
            {"idle_prefill_min_residency_s": -1},
            "idle_prefill_min_residency_s",
            "expected a finite number >= 0, got -1",
        ),
        ({"idle_prefill_min_residency_s": float("inf")}, "idle_prefill_min_residency_s", "finite"),
    ],
)
def test_bad_idle_prefill_settings_name_their_key(section: dict, key: str, problem: str):
    with pytest.raises(ConfigError) as caught:
        engine_of(section)
    assert caught.value.key == f"models[0].engine.{key}"
    assert problem in caught.value.problem
