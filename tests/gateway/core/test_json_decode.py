"""``gateway.core.json_decode.loads`` is ``json.loads``: the same value (types, floats bit for bit) or the same
error, for strict JSON (msgspec's path) and for what only ``json.loads`` reads (its fallback)."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.json_decode import loads

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def _same(a: object, b: object) -> bool:
    """Equal, with the same types all the way down and floats compared bit for bit (-0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def _outcome(text: str | bytes) -> tuple[str, object]:
    try:
        return "value", json.loads(text)
    except (ValueError, RecursionError) as exc:
        return "error", type(exc)


def _assert_like_json(text: str | bytes) -> None:
    kind, expected = _outcome(text)
    if kind == "error":
        with pytest.raises(expected):  # type: ignore[call-overload]
            loads(text)
    else:
        assert _same(loads(text), expected)


@settings(max_examples=400, deadline=None)
@given(_values, st.booleans(), st.booleans())
def test_values_decode_as_json_loads_does(value: object, ascii_only: bool, as_bytes: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    _assert_like_json(text.encode("utf-8", "surrogatepass") if as_bytes else text)


@settings(max_examples=400, deadline=None)
@given(st.from_regex(r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][+-]?[0-9]{1,3})?", fullmatch=True))
def test_number_texts_parse_bit_for_bit(text: str) -> None:
    _assert_like_json(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_arbitrary_text_gives_json_loads_outcome(text: str) -> None:
    _assert_like_json(text)


@pytest.mark.parametrize(
    "text",
    [
        "NaN",
        "[Infinity, -Infinity]",
        "1e400",
        "-1e400",
        "1e-400",
        '{"a": 1, "a": 2}',
        '"\\ud800"',
        '"\\ud83d\\ude00"',
        b'"\xed\xa0\x80"',  # a raw UTF-8 surrogate: json.loads reads it (surrogatepass)
        b'"\xff"',
        b"\xef\xbb\xbf[1]",  # UTF-8 BOM
        "[1]".encode("utf-16"),
        "[1]".encode("utf-16-le"),
        "[1]".encode("utf-32"),
        '"a\x01b"',
        "[1,]",
        "01",
        "1" * 5000,
        "[" * 100_000 + "]" * 100_000,
        "",
        " [1] ",
        "[1] x",
        "18446744073709551616",
        "-0",
        "-0.0",
    ],
)
def test_edges_match_json_loads(text: str | bytes) -> None:
    _assert_like_json(text)


def test_the_fast_path_is_taken_for_strict_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk as servers send it never reaches ``json.loads`` (else the module would save nothing)."""
    import gateway.core.json_decode as module

    def refuse(text: object) -> None:
        raise AssertionError("json.loads called")

    monkeypatch.setattr(module.json, "loads", refuse)
    assert (
        loads(b'{"choices":[{"delta":{"content":"hi"},"index":0}],"usage":null}')["choices"][0]["index"] == 0
    )
