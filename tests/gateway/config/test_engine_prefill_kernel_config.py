"""``engine.prefill_kernel`` in the gateway's YAML: ``auto | native | amx | torch`` parsed into ``EngineConfig``, anything
else a ``ConfigError`` naming the file, the key path and the choices (``engine.attention_kernels.resolve_prefill_kernel``)."""

from __future__ import annotations

import pytest

from gateway.config.loader import parse_config
from gateway.config.schema import ConfigError


def engine_of(section: dict):
    config = parse_config({"models": [{"name": "m", "path": "default", "engine": section}]}, source="c.yaml")
    return config.models[0].engine


@pytest.mark.parametrize("value", ["auto", "native", "amx", "torch"])
def test_prefill_kernel_values(value):
    assert engine_of({"prefill_kernel": value}).prefill_kernel == value


def test_prefill_kernel_defaults_to_auto():
    assert engine_of({}).prefill_kernel == "auto"


@pytest.mark.parametrize(("value", "problem"), [("fast", "got 'fast'"), (3, "expected"), (None, "expected")])
def test_a_bad_prefill_kernel_names_file_key_and_choices(value, problem):
    with pytest.raises(ConfigError) as caught:
        engine_of({"prefill_kernel": value})
    assert caught.value.source == "c.yaml"
    assert caught.value.key == "models[0].engine.prefill_kernel"
    assert problem in caught.value.problem
    if value == "fast":
        assert "expected one of auto, native, amx, torch" in caught.value.problem
