"""Engine settings the engine itself checks only when the model loads (``dtype``, ``max_model_len``): refused
at config load where the config alone can tell, and a load failure named by its key path where only the
checkpoint can (``gateway.config.engine_section.model_start_error``)."""

from __future__ import annotations

import pytest

from engine.errors import UnsupportedModelError
from engine.kv_tiers.disk import TierConfigError
from gateway.config.engine_section import DTYPES, model_start_error
from gateway.config.loader import parse_config
from tests.gateway.config.test_tier_config import engine_of, error_of


def test_dtype_names_are_the_engines():
    from engine.async_engine import DTYPES as ENGINE_DTYPES  # torch: the config may not import it

    assert set(DTYPES) == set(ENGINE_DTYPES)


def test_an_unknown_dtype_is_refused_at_config_load():
    # Before: accepted here; AsyncEngine.from_config raised ValueError at start (a traceback, exit 3)
    error = error_of({"dtype": "float8"})
    assert (error.source, error.key) == ("c.yaml", "models[0].engine.dtype")
    assert error.problem == "expected one of float32, bfloat16, float16, got 'float8'"
    assert [engine_of({"dtype": name}).dtype for name in DTYPES] == list(DTYPES)


def test_max_model_len_below_one_is_refused_at_config_load():
    error = error_of({"max_model_len": 0})
    assert error.key == "models[0].engine.max_model_len"
    assert error.problem.startswith("expected an integer >= 1 or null")
    assert engine_of({"max_model_len": 99_999_999}).max_model_len == 99_999_999  # the checkpoint's to bound
    assert engine_of({"max_model_len": None}).max_model_len is None


@pytest.mark.parametrize(
    ("exc", "key", "problem"),
    [
        (
            ValueError("max_model_len 99999999 is not in [1, 8192] (the checkpoint's context window)"),
            "models[1].engine.max_model_len",
            "99999999 is not in [1, 8192] (the checkpoint's context window)",
        ),
        (
            ValueError("engine.kv_dtype must be one of float32, bfloat16, got 'x'"),
            "models[1].engine.kv_dtype",
            "must be one of float32, bfloat16, got 'x'",
        ),
        (
            TierConfigError("engine.tier_disk.directory", "/x is not writable"),
            "models[1].engine.tier_disk.directory",
            "/x is not writable",
        ),
        (UnsupportedModelError("no such model file or folder: /m"), "models[1].path", "no such model file"),
        (ValueError("something else"), "models[1]", "something else"),
    ],
)
def test_a_load_failure_names_the_models_key(tmp_path, exc, key, problem):
    config = parse_config(
        {
            "models": [
                {"name": "up", "backend": "openai", "base_url": "http://x"},
                {"name": "m", "path": str(tmp_path)},
            ]
        },
        source="c.yaml",
    )
    error = model_start_error(config, "m", exc)
    assert (error.source, error.key) == ("c.yaml", key)
    assert error.problem.startswith(problem)
    assert model_start_error(config, "up", exc) is None  # not an embedded model: left as it is
    assert model_start_error(config, "unknown", exc) is None
