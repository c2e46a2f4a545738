"""``engine.dense_gemm`` in the gateway's YAML: ``auto | amx | onednn`` parsed into ``EngineConfig``, anything
else a ``ConfigError`` naming the file, the key path and the choices (``engine.amx_gemm``)."""

from __future__ import annotations

import pytest

from gateway.config.loader import parse_config
from gateway.config.schema import ConfigError


def engine_of(section: dict):
    config = parse_config({"models": [{"name": "m", "path": "default", "engine": section}]}, source="c.yaml")
    return config.models[0].engine


@pytest.mark.parametrize("value", ["auto", "amx", "onednn"])
def test_dense_gemm_values(value):
    assert engine_of({"dense_gemm": value}).dense_gemm == value


def test_dense_gemm_defaults_to_auto():
    assert engine_of({}).dense_gemm == "auto"


@pytest.mark.parametrize(("value", "problem"), [("fast", "got 'fast'"), (3, "expected"), (None, "expected")])
def test_a_bad_dense_gemm_names_file_key_and_choices(value, problem):
    with pytest.raises(ConfigError) as caught:
        engine_of({"dense_gemm": value})
    assert caught.value.source == "c.yaml"
    assert caught.value.key == "models[0].engine.dense_gemm"
    assert problem in caught.value.problem
    if value == "fast":
        assert "expected one of auto, amx, onednn" in caught.value.problem
