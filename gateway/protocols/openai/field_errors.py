"""OpenAI's errors for a missing or mistyped request field (``missing_required_parameter``, ``invalid_type``),
with the messages OpenAI's API answers, shared by the request parsers of this package."""

from __future__ import annotations

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
