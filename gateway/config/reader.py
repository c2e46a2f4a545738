"""The config reader: type checks of YAML values with their key paths, ``env:NAME`` resolution and coercion of
environment strings. Every failure raises ``ConfigError`` naming the file, the key path and what was expected;
no other module of ``gateway.config`` formats those messages."""

from __future__ import annotations

import math
import os
import types
import typing
from typing import Any

import redis.connection

from engine.kv_tiers.settings import redis_url_db_problem
from gateway.config.schema import ConfigError
from gateway.core.json_types import yaml_kind


class Reader:
    """Type checks with key paths; every failure raises ``ConfigError`` for ``source``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, problem: str) -> typing.NoReturn:
        raise ConfigError(self.source, key, problem)

    def redis_url(self, key: str, url: str) -> str:
        """``url`` when it is a Redis URL redis-py connects with as written: a ``redis://``, ``rediss://`` or
        ``unix://`` scheme, a port and query arguments it parses, and a database that is a non-negative integer
        (``engine.kv_tiers.settings.redis_url_db_problem``: redis-py silently takes database 0 for
        ``redis://host:6379/abc``). Before, some of these were a traceback at start, others ran on database 0.

        Raises:
            ConfigError: naming ``key`` and what is wrong with the URL.
        """
        if not url.startswith(("redis://", "rediss://", "unix://")):
            self.fail(key, f"not a Redis URL: expected a redis://, rediss:// or unix:// URL, got {url!r}")
        try:
            redis.connection.parse_url(url)
        except ValueError as exc:
            self.fail(key, f"not a Redis URL ({exc}): {url!r}")
        problem = redis_url_db_problem(url)
        if problem is not None:
            self.fail(key, problem)
        return url

    def mapping(self, value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where or "(top level)", f"expected a mapping, got {yaml_kind(value)}")
        for key in value:
            if not isinstance(key, str) or key not in allowed:
                path = f"{where}.{key}" if where else str(key)
                self.fail(path, f"unknown key (valid keys: {', '.join(sorted(allowed))})")
        return value

    def resolve_env(self, value: Any, where: str) -> Any:
        """``env:NAME`` -> the variable's value; anything else unchanged."""
        if isinstance(value, str) and value.startswith("env:"):
            name = value[4:]
            if not name:
                self.fail(where, "expected env:NAME with a variable name")
            resolved = os.environ.get(name)
            if not resolved:
                self.fail(where, f"environment variable {name} (from {value!r}) is not set or empty")
            return resolved
        return value

    def typed(
        self, section: dict, where: str, key: str, expected: Any, default: Any, required: bool = False
    ) -> Any:
        """``section[key]`` checked against ``expected`` (str, int, float, bool, or ``X | None``)."""
        path = f"{where}.{key}" if where else key
        if key not in section:
            if required:
                self.fail(path, "missing required key")
            return default
        raw = section[key]
        from_env = isinstance(raw, str) and raw.startswith("env:")
        return _coerce(self, self.resolve_env(raw, path), expected, path, from_env)


def _coerce(reader: Reader, value: Any, expected: Any, path: str, from_env: bool = False) -> Any:
    """Check ``value`` against ``expected``; a string read from the environment may be parsed as a number."""
    options = (
        typing.get_args(expected)
        if isinstance(expected, types.UnionType) or typing.get_origin(expected) is typing.Union
        else (expected,)
    )
    if value is None:
        if type(None) in options:
            return None
        reader.fail(path, f"expected {_describe(options)}, got null")
    for option in options:
        if option is type(None):
            continue
        converted = _convert(value, option, from_env)
        if converted is not _NO:
            return converted
    reader.fail(
        path, f"expected {_describe(options)}, got {yaml_kind(value)} {value!r}{_number_hint(value, options)}"
    )


_NO = object()


def _number_hint(value: Any, options: tuple) -> str:
    """A hint for a number YAML read as text: PyYAML (YAML 1.1) takes ``1e16`` or ``1.0e16`` for a string, since
    its floats need a dot and a signed exponent (``1.0e+16``)."""
    if not isinstance(value, str) or float not in options:
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    return f" (YAML reads {value} as text: write it as {number:.1e})"


def _convert(value: Any, option: type, from_env: bool) -> Any:
    if option is bool:
        if isinstance(value, bool):
            return value
        if from_env and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return _NO
    if option is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_env and value.strip().lstrip("-").isdigit():
            return int(value)
        return _NO
    if option is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if from_env:
            try:
                return float(value)
            except ValueError:
                return _NO
        return _NO
    if option is str:
        return value if isinstance(value, str) else _NO
    return _NO


def _describe(options: tuple) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return " or ".join(names.get(option, str(option)) for option in options)
