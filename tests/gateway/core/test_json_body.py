"""gateway.core.json_body: the depth limit and the lone-surrogate check, with their fast paths."""

from __future__ import annotations

import json

import pytest

from gateway.core.errors import InvalidRequestError
from gateway.core.json_body import MAX_JSON_DEPTH, json_depth_exceeds, loads_request_json


def test_depth_limit_counts_brackets_outside_strings_only():
    assert not json_depth_exceeds(b"[" * 5 + b"]" * 5, 5)
    assert json_depth_exceeds(b"[" * 6 + b"]" * 6, 5)
    assert not json_depth_exceeds(b'{"a": "' + b"[" * 50 + b'"}', 5)  # brackets inside a string
    assert not json_depth_exceeds(b"[" + b"[]," * 10 + b"[]]", 5)  # many brackets, shallow


def test_too_deep_body_is_refused():
    raw = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(InvalidRequestError) as info:
        loads_request_json(raw)
    assert info.value.code == "json_too_deep"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "x\\ud800"}',  # an escaped lone high surrogate
        b'{"a": "\\uDC00y"}',  # an escaped lone low surrogate, upper case
        b'{"\\udfff": 1}',  # in a key
        '{"a": "\ud800"}'.encode("utf-8", "surrogatepass"),  # the UTF-8 form of a surrogate
        '{"a": "\ud800"}'.encode("utf-16-le", "surrogatepass"),  # a UTF-16 body
    ],
)
def test_lone_surrogates_are_refused_however_they_arrive(raw):
    with pytest.raises(InvalidRequestError) as info:
        loads_request_json(raw)
    assert info.value.code == "invalid_unicode"


@pytest.mark.parametrize(
    "value",
    [{"a": "plain"}, {"a": "😀 한국어 é"}, {"a": "\\ud800 as text"}],
)
def test_valid_bodies_parse_as_json_does(value):
    for raw in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
        assert loads_request_json(raw) == value  # ensure_ascii=True sends 😀 as an escaped surrogate pair


@pytest.mark.parametrize(
    ("raw", "token"),
    [
        (b'{"temperature": NaN}', "NaN"),
        (b'{"metadata": {"a": Infinity}}', "Infinity"),
        (b'{"tools": [{"parameters": {"default": -Infinity}}]}', "-Infinity"),
        (b'{"top_p": 1e400}', "1e400"),  # json.loads reads it as inf
        (b"[-2.5e999]", "-2.5e999"),
        ('{"a": NaN}'.encode("utf-16"), "NaN"),  # the json.loads path (msgspec reads UTF-8 only)
    ],
)
def test_non_finite_numbers_are_refused_as_invalid_json(raw, token):
    with pytest.raises(InvalidRequestError) as info:
        loads_request_json(raw)
    assert info.value.code == "invalid_json"
    assert f"{token!r} is not a JSON number" in info.value.message


def test_finite_floats_parse_as_json_does_on_both_paths():
    value = {"a": [0.1, -2.5e-308, 1.7976931348623157e308, 3, "NaN"]}
    raw = json.dumps(value).encode()
    assert loads_request_json(raw) == value  # msgspec's path
    assert loads_request_json(b"\xef\xbb\xbf" + raw) == value  # a BOM: json.loads's path, hooks on
