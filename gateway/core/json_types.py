"""JSON value kinds for error messages, and compact JSON encoding: the one copy of each.

``json_kind`` names a decoded JSON value as the OpenAI/Anthropic faces say it ("an object", "an array", ...);
``yaml_kind`` names a decoded YAML value as the config loader says it ("a mapping", "a list", ...).
``compact_json`` writes JSON as OpenAI's and Anthropic's APIs do (no spaces after separators, UTF-8 kept).
"""

from __future__ import annotations

import json
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
