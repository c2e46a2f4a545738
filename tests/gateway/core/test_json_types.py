"""``finite_json``: decoded JSON made writable as strict JSON (a number beyond the float range as the largest
float of its sign; NaN refused)."""

from __future__ import annotations

import json
import sys

import pytest

from gateway.core.json_types import finite_json

BIG = sys.float_info.max


def test_numbers_beyond_the_float_range_become_the_largest_float_of_their_sign():
    decoded = json.loads('{"a": 1e999, "b": [-1e999, 1.5, {"c": 1e400}], "d": "1e999", "e": null}')
    fixed = finite_json(decoded)
    assert fixed == {"a": BIG, "b": [-BIG, 1.5, {"c": BIG}], "d": "1e999", "e": None}
    json.dumps(fixed, allow_nan=False)  # strict JSON now


def test_a_value_without_infinity_is_returned_as_it_is():
    decoded = json.loads('{"a": [1, 2.5, true, "x"], "b": {"c": null}}')
    assert finite_json(decoded) is decoded


def test_nan_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        finite_json({"a": [float("nan")]})
