"""Decoding a request body's JSON safely: a nesting-depth limit checked before the parser runs, and strings
that are valid Unicode. The one place a client's bytes become Python values.

Invariants: ``loads_request_json`` never lets the stdlib parser recurse deeper than ``MAX_JSON_DEPTH`` (so no
``RecursionError``, whatever the body), and every string it returns, keys included, encodes as UTF-8 (a lone
UTF-16 surrogate such as ``"\\ud800"``, which JSON's escapes allow, is refused: nothing downstream, the
tokenizer, the regex engine or a log line, can choke on it), and every number it returns is finite: ``NaN``,
``Infinity``, ``-Infinity`` (which ``json.loads`` accepts, RFC 8259 does not) and a number outside the float
range (``1e400``, which ``json.loads`` reads as infinity) are refused, so no value the gateway echoes (a
Responses ``metadata``, a tool schema) can fail to serialize back into JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

from gateway.core import json_decode
from gateway.core.errors import InvalidRequestError

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects accepted in a request body. Real bodies (messages, content parts,
tool JSON schemas) stay well under it; the stdlib parser recurses once per level."""

NOT_JSON = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP "
    "library correctly. The API expects a JSON payload, but what was sent was not valid JSON.)"
)

_STRING_OR_BRACKET = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
"""A whole JSON string (skipped as one match, so brackets inside strings do not count) or one bracket."""


_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""Where a lone surrogate can come from in UTF-8 JSON: a ``\\uD800``-``\\uDFFF`` escape, or the UTF-8 form of a
surrogate (which ``json.loads`` decodes with ``surrogatepass``). Without either, the full check is skipped (a
body ``json.loads`` reads as UTF-16/32 or with a BOM always gets it)."""


NOT_FINITE = (
    "We could not parse the JSON body of your request: {token!r} is not a JSON number (RFC 8259 allows no "
    "NaN or Infinity, and numbers must fit a 64-bit float)."
)


class _NonFiniteNumber(ValueError):
    """A ``NaN`` / ``Infinity`` constant or an out-of-range number met while parsing (``token``: its text)."""

    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.token = token


def _refuse_constant(token: str) -> NoReturn:
    """``json.loads``'s ``parse_constant`` hook: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON."""
    raise _NonFiniteNumber(token)


def _finite_float(token: str) -> float:
    """``json.loads``'s ``parse_float`` hook: the float of ``token``, refused when it overflows to infinity."""
    value = float(token)
    if not math.isfinite(value):
        raise _NonFiniteNumber(token)
    return value


def json_depth_exceeds(raw: bytes, limit: int) -> bool:
    """True when ``raw`` nests arrays/objects deeper than ``limit`` levels (brackets inside strings ignored;
    run over the raw bytes before parsing, in C-speed regex steps, one per string or bracket)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # nesting needs an opening bracket per level: no scan (the common case)
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def loads_request_json(raw: bytes) -> Any:
    """Parse a request body.

    Raises:
        InvalidRequestError: not UTF-8 JSON (code ``invalid_json``; also for ``NaN``, ``Infinity`` and numbers
            outside the float range, which ``json.loads`` would accept), nested deeper than ``MAX_JSON_DEPTH``
            (code ``json_too_deep``), or a string holding a lone surrogate (code ``invalid_unicode``, ``param``
            the path of the first such string).
    """
    if json_depth_exceeds(raw, MAX_JSON_DEPTH):
        raise InvalidRequestError(
            f"The JSON body of your request is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays "
            "and objects are accepted.",
            code="json_too_deep",
        )
    try:
        value = json_decode.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NonFiniteNumber as exc:
        raise InvalidRequestError(NOT_FINITE.format(token=exc.token), code="invalid_json") from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequestError(NOT_JSON, code="invalid_json") from exc
    if json.detect_encoding(raw) == "utf-8" and _MAY_HOLD_SURROGATE.search(raw) is None:
        return value  # neither an escaped nor a raw surrogate in UTF-8 JSON: every string encodes
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        path = _surrogate_path(value, "") or "body"
        raise InvalidRequestError(
            f"Invalid string at '{path}': it holds a lone UTF-16 surrogate (such as \\ud800), which is not "
            "valid Unicode.",
            param=path if path != "body" else None,
            code="invalid_unicode",
        ) from exc
    return value


def _surrogate_path(value: Any, path: str) -> str | None:
    """The JSON path of the first string (key or value) that does not encode as UTF-8, or None (bounded by
    ``MAX_JSON_DEPTH``, checked before)."""
    if isinstance(value, str):
        return path if not _encodes(value) else None
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if not _encodes(key):
                return where.encode("utf-8", "backslashreplace").decode("ascii")
            found = _surrogate_path(item, where)
            if found is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
