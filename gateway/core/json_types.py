"""JSON value kinds for error messages, and compact JSON encoding: the one copy of each.

``json_kind`` names a decoded JSON value as the OpenAI/Anthropic faces say it ("an object", "an array", ...);
``yaml_kind`` names a decoded YAML value as the config loader says it ("a mapping", "a list", ...).
``compact_json`` writes JSON as OpenAI's and Anthropic's APIs do (no spaces after separators, UTF-8 kept).
``finite_json`` makes a decoded value writable as strict JSON (no infinity, no NaN).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

_JSON_NAMES: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
}
_YAML_NAMES: dict[type, str] = {**_JSON_NAMES, dict: "a mapping", list: "a list"}


def json_kind(value: Any) -> str:
    """``"null"``, ``"an object"``, ``"an array"``, ``"a string"``, ``"a boolean"``, ``"an integer"``,
    ``"a number"``, or the Python type name of anything else."""
    if value is None:
        return "null"
    return _JSON_NAMES.get(type(value), type(value).__name__)


def yaml_kind(value: Any) -> str:
    """Like ``json_kind`` but in YAML's terms: ``"a mapping"``, ``"a list"``."""
    if value is None:
        return "null"
    return _YAML_NAMES.get(type(value), type(value).__name__)


def compact_json(value: Any) -> str:
    """JSON without spaces after separators, non-ASCII kept as UTF-8 (``json.dumps`` settings of the APIs)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def finite_json(value: Any) -> Any:
    """``value`` (decoded JSON: dicts, lists, strings, numbers, booleans, None) with every infinite float, i.e. a
    number beyond the float range such as ``1e999`` (valid JSON, RFC 8259 section 6, which Python and jiter
    decode as infinity), replaced by the largest finite float of its sign, the nearest number a strict JSON
    writer (``allow_nan=False``, as Starlette's ``JSONResponse``) can write. Returns ``value`` itself when
    nothing changes.

    Raises:
        ValueError: a NaN (only ``NaN`` literals, which are not JSON, decode to one).
    """
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN is not a JSON number")
        return value if math.isfinite(value) else math.copysign(sys.float_info.max, value)
    if isinstance(value, dict):
        items = {key: finite_json(item) for key, item in value.items()}
        return value if all(items[k] is value[k] for k in value) else items
    if isinstance(value, list):
        elements = [finite_json(item) for item in value]
        return value if all(a is b for a, b in zip(elements, value, strict=True)) else elements
    return value
