"""The engine's kernel settings in the gateway's YAML, each a fixed set of choices parsed into ``EngineConfig``
and defaulting to ``auto``; anything else is a ``ConfigError`` naming the file, the key path and the choices.

``engine.linear_kernel`` (``engine.native_linear``), ``engine.decode_kernel`` (``engine.native_decode``),
``engine.prefill_kernel`` (``engine.attention_kernels.resolve_prefill_kernel``), ``engine.glue_kernel``
(``engine.native_glue``) and ``engine.dense_gemm`` (``engine.amx_gemm``).
"""

from __future__ import annotations

import pytest

from gateway.config.loader import parse_config
from gateway.config.schema import ConfigError

SETTINGS = {
    "linear_kernel": ("auto", "native", "int8-activations", "torch"),
    "decode_kernel": ("auto", "native", "avx512-bf16", "torch"),
    "prefill_kernel": ("auto", "native", "amx", "avx512-bf16", "torch"),
    "glue_kernel": ("auto", "native", "torch"),
    "dense_gemm": ("auto", "amx", "onednn"),
}
"""Each setting and its choices, in the order the error message lists them."""


def engine_of(section: dict):
    config = parse_config({"models": [{"name": "m", "path": "default", "engine": section}]}, source="c.yaml")
    return config.models[0].engine


@pytest.mark.parametrize(
    ("key", "value"), [(key, value) for key, choices in SETTINGS.items() for value in choices]
)
def test_each_choice_reaches_the_engine_config(key, value):
    assert getattr(engine_of({key: value}), key) == value


@pytest.mark.parametrize("key", SETTINGS)
def test_each_setting_defaults_to_auto(key):
    assert getattr(engine_of({}), key) == "auto"


@pytest.mark.parametrize("key", SETTINGS)
@pytest.mark.parametrize(("value", "problem"), [("fast", "got 'fast'"), (3, "expected"), (None, "expected")])
def test_a_bad_value_names_file_key_and_choices(key, value, problem):
    with pytest.raises(ConfigError) as caught:
        engine_of({key: value})
    assert caught.value.source == "c.yaml"
    assert caught.value.key == f"models[0].engine.{key}"
    assert problem in caught.value.problem
    if value == "fast":
        assert f"expected one of {', '.join(SETTINGS[key])}" in caught.value.problem
