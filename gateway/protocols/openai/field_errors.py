"""OpenAI's errors for a missing, mistyped or out-of-set request field (``missing_required_parameter``,
``invalid_type``, ``invalid_value``), with the messages OpenAI's API answers, shared by the request parsers of
this package."""

from __future__ import annotations

import json
from typing import Any

from gateway.core.errors import InvalidRequestError
from gateway.core.json_types import json_kind


def missing_param(param: str) -> InvalidRequestError:
    """``Missing required parameter: '<param>'.`` (400, ``missing_required_parameter``)."""
    return InvalidRequestError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def invalid_type(param: str, expected: str, value: Any) -> InvalidRequestError:
    """``Invalid type for '<param>': expected <expected>, but got <JSON kind> instead.`` (400, ``invalid_type``)."""
    got = json_kind(value)
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
        param=param,
        code="invalid_type",
    )


JSON_TYPES: dict[str, type | tuple[type, ...]] = {"a boolean": bool, "a string": str, "an object": dict}
"""The expected kinds ``check_types`` knows, by the words its message uses."""


def check_types(body: dict[str, Any], types: dict[str, str], prefix: str = "") -> None:
    """Refuse a present, non-null ``body[field]`` whose JSON type is not ``types[field]`` (a key of
    ``JSON_TYPES``); the fields a request only passes on or ignores are typed as OpenAI's reference types them.

    Raises:
        InvalidRequestError: ``invalid_type`` naming ``prefix + field``.
    """
    for name, expected in types.items():
        value = body.get(name)
        if value is not None and not isinstance(value, JSON_TYPES[expected]):
            raise invalid_type(f"{prefix}{name}", expected, value)


def check_enums(body: dict[str, Any], enums: dict[str, tuple[str, ...]]) -> None:
    """Refuse a value of ``body[field]`` outside ``enums[field]`` (None and absent are accepted).

    Raises:
        InvalidRequestError: ``invalid_value`` naming the field and the supported values.
    """
    for name, values in enums.items():
        value = body.get(name)
        if value is not None and value not in values:
            shown = ", ".join(f"'{v}'" for v in values)
            raise InvalidRequestError(
                f"Invalid value for '{name}': {json.dumps(value)}. Supported values are: {shown}.",
                param=name,
                code="invalid_value",
            )
