"""Structured outputs across the two protocols: OpenAI's ``response_format`` ``json_schema`` as Anthropic's
``output_config.format`` (an OpenAI-face request to ``backend: anthropic``), and Anthropic's
``output_config.format`` (or the deprecated top-level ``output_format``) as ``response_format`` (an
Anthropic-face request to an OpenAI-compatible upstream) or as the embedded engine's schema. Pure functions,
no I/O; every refusal is an ``InvalidRequestError`` naming the field.

Anthropic's form (generally available, no beta header; https://platform.claude.com/docs/en/build-with-claude/
structured-outputs, and the ``anthropic`` SDK's ``OutputConfigParam`` / ``JSONOutputFormatParam``):
``"output_config": {"format": {"type": "json_schema", "schema": {...}}}``. The beta form, top-level
``output_format`` with ``anthropic-beta: structured-outputs-2025-11-13``, is deprecated; it is read here as the
same request and never sent. Anthropic always enforces the schema (constrained decoding), so OpenAI's
``strict: false`` gets at least what it asked for, and the reverse sends ``strict: true``.

Invariant: a schema is forwarded to Anthropic byte for byte or refused; never loosened, never rewritten
(``check_anthropic_schema`` refuses what Anthropic documents as unsupported, so a constraint is never dropped
silently; annotations and keywords this module does not know pass to the upstream, which judges them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gateway.core.errors import APIError, InvalidRequestError
from gateway.core.json_types import json_kind

ANTHROPIC_STRING_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "uri", "ipv4", "ipv6", "uuid"}
)
"""String ``format`` values Anthropic's structured outputs support (the docs' list; the SDK's
``SupportedStringFormats``)."""

UNSUPPORTED_KEYWORDS = {
    "minimum": "numerical constraints",
    "maximum": "numerical constraints",
    "exclusiveMinimum": "numerical constraints",
    "exclusiveMaximum": "numerical constraints",
    "multipleOf": "numerical constraints",
    "minLength": "string length constraints",
    "maxLength": "string length constraints",
    "maxItems": "array constraints other than minItems 0 or 1",
    "uniqueItems": "array constraints other than minItems 0 or 1",
    "contains": "array constraints other than minItems 0 or 1",
    "minContains": "array constraints other than minItems 0 or 1",
    "maxContains": "array constraints other than minItems 0 or 1",
    "prefixItems": "array constraints other than minItems 0 or 1",
    "minProperties": "object constraints other than properties, required and additionalProperties false",
    "maxProperties": "object constraints other than properties, required and additionalProperties false",
    "patternProperties": "object constraints other than properties, required and additionalProperties false",
    "propertyNames": "object constraints other than properties, required and additionalProperties false",
    "dependentRequired": "object constraints other than properties, required and additionalProperties false",
    "dependentSchemas": "object constraints other than properties, required and additionalProperties false",
    "unevaluatedProperties": "object constraints other than properties, required and additionalProperties false",
    "unevaluatedItems": "array constraints other than minItems 0 or 1",
    "oneOf": "oneOf (anyOf and allOf are supported)",
    "not": "not / if / then / else",
    "if": "not / if / then / else",
    "then": "not / if / then / else",
    "else": "not / if / then / else",
}
"""Constraint keywords outside what Anthropic's structured outputs support (the docs list the supported ones:
``type``, ``enum`` / ``const`` of primitives, ``anyOf``, ``allOf``, local ``$ref`` / ``$defs`` /
``definitions``, ``properties``, ``required``, ``additionalProperties: false``, ``items``, ``minItems`` 0 or 1,
string ``format`` and ``pattern``; unsupported: numerical and string-length constraints, other array
constraints, recursive schemas, external ``$ref``) -> the docs' name for what they are."""

OPENAI_FORMAT_NAME = "response"
"""``response_format.json_schema.name`` sent to an OpenAI-compatible upstream (required there; Anthropic's
format has no name, and the name does not change the answer)."""

_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "allOf")


def anthropic_output_config(response_format: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` (already validated by the face: ``gateway.protocols.openai.parse``) as
    Anthropic's ``output_config``, or None for ``text`` / absent.

    ``json_schema``: ``{"format": {"type": "json_schema", "schema": schema}}``, the schema as sent, with
    ``json_schema.description`` as its top-level ``description`` when it has none (the model reads both);
    ``name`` is left out (it names the format, it does not change the answer); ``strict`` false or absent is
    enforced all the same.

    Raises:
        InvalidRequestError: ``json_object`` (Anthropic constrains only to a schema whose every object is
            closed, so "any JSON object" has no equivalent; code ``unsupported_value``); a
            ``json_schema.description`` beside a schema with a different ``description``; a schema Anthropic
            cannot enforce (``check_anthropic_schema``).
    """
    if not isinstance(response_format, Mapping) or response_format.get("type") in (None, "text"):
        return None
    if response_format.get("type") == "json_object":
        raise InvalidRequestError(
            "Unsupported value: 'response_format' of type 'json_object' is not supported with an Anthropic "
            "upstream model: Anthropic's structured outputs need a JSON schema whose objects all set "
            "additionalProperties false, so 'any JSON object' has no equivalent; send a 'json_schema' "
            "response_format.",
            param="response_format",
            code="unsupported_value",
        )
    spec = response_format.get("json_schema") or {}
    schema = dict(spec.get("schema") or {})
    check_anthropic_schema(schema, "response_format.json_schema.schema")
    description = spec.get("description")
    if description is not None:
        if schema.get("description") not in (None, description):
            raise InvalidRequestError(
                "Unsupported value: 'response_format.json_schema.description' and the schema's own "
                "'description' differ; Anthropic's format carries one description (the schema's): send one.",
                param="response_format.json_schema.description",
                code="unsupported_value",
            )
        schema = {**schema, "description": description}
    return {"format": {"type": "json_schema", "schema": schema}}


def check_anthropic_schema(schema: dict[str, Any], param: str) -> None:
    """Refuse a JSON Schema Anthropic's structured outputs cannot enforce as written, naming where.

    Walks every subschema (``properties``, ``items``, ``anyOf``, ``allOf``, ``$defs``, ``definitions`` and the
    targets of local ``$ref``), each once.

    Raises:
        InvalidRequestError: code ``unsupported_value``, ``param`` the path of the offending keyword
            (``response_format.json_schema.schema.properties.age.minimum``): a keyword of
            ``UNSUPPORTED_KEYWORDS``; ``minItems`` other than 0 or 1; an object without
            ``additionalProperties: false`` (Anthropic requires it on every object); a string ``format``
            outside ``ANTHROPIC_STRING_FORMATS``; an ``enum`` / ``const`` that is not primitive; a ``$ref``
            that is not local (``#...``) or points nowhere; a recursive schema (a ``$ref`` to a schema that
            contains it); a subschema that is not an object; ``items`` as a list.
    """
    _SchemaWalk(schema, param).visit(schema, param, ())


class _SchemaWalk:
    """One walk of ``check_anthropic_schema``: local ``$ref`` targets are checked once (``done``); a ``$ref``
    met again while its own target is being walked (``stack``) is recursion."""

    def __init__(self, root: dict[str, Any], param: str) -> None:
        self.root = root
        self.param = param
        self.done: set[str] = set()

    def visit(self, node: Any, path: str, stack: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            raise _refused(path, f"a subschema must be an object, got {json_kind(node)}")
        for keyword, what in UNSUPPORTED_KEYWORDS.items():
            if keyword in node:
                raise _refused(f"{path}.{keyword}", f"Anthropic's structured outputs do not support {what}")
        if "minItems" in node and node["minItems"] not in (0, 1):
            raise _refused(f"{path}.minItems", "Anthropic's structured outputs support minItems 0 or 1 only")
        self._check_object(node, path)
        fmt = node.get("format")
        if fmt is not None and fmt not in ANTHROPIC_STRING_FORMATS:
            formats = ", ".join(sorted(ANTHROPIC_STRING_FORMATS))
            raise _refused(f"{path}.format", f"Anthropic's structured outputs support the formats {formats}")
        enum = node.get("enum", [])
        if not (isinstance(enum, list) and all(map(_primitive, enum))) or not _primitive(node.get("const")):
            keyword = "const" if "const" in node and not _primitive(node["const"]) else "enum"
            raise _refused(
                f"{path}.{keyword}",
                f"Anthropic's structured outputs need a {keyword} of strings, numbers, booleans or null",
            )
        for keyword in _SUBSCHEMA_MAPS:
            children = node.get(keyword)
            if isinstance(children, dict):
                for name, child in children.items():
                    self.visit(child, f"{path}.{keyword}.{name}", stack)
        for keyword in _SUBSCHEMA_LISTS:
            children = node.get(keyword)
            if isinstance(children, list):
                for i, child in enumerate(children):
                    self.visit(child, f"{path}.{keyword}[{i}]", stack)
        if "items" in node:
            if isinstance(node["items"], list):
                raise _refused(
                    f"{path}.items", "Anthropic's structured outputs need one items schema, not a list"
                )
            self.visit(node["items"], f"{path}.items", stack)
        if "$ref" in node:
            self._follow(node["$ref"], f"{path}.$ref", stack)

    def _check_object(self, node: dict[str, Any], path: str) -> None:
        kinds = node.get("type")
        is_object = (
            kinds == "object" or (isinstance(kinds, list) and "object" in kinds) or "properties" in node
        )
        if "additionalProperties" in node and node["additionalProperties"] is not False:
            raise _refused(f"{path}.additionalProperties", _CLOSED)
        if is_object and "additionalProperties" not in node:
            raise _refused(f"{path}.additionalProperties", _CLOSED)

    def _follow(self, ref: Any, path: str, stack: tuple[str, ...]) -> None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _refused(path, "Anthropic's structured outputs support local $ref only ('#/$defs/...')")
        if ref in stack:
            raise _refused(path, "Anthropic's structured outputs do not support recursive schemas")
        if ref in self.done:
            return
        target = _pointer(self.root, ref)
        if target is None:
            raise _refused(path, f"the $ref {ref!r} points to nothing in the schema")
        self.visit(target, f"{self.param}{_pointer_path(ref)}", (*stack, ref))
        self.done.add(ref)


_CLOSED = (
    "Anthropic's structured outputs need 'additionalProperties': false on every object schema (as OpenAI's "
    "strict mode does)"
)


def _refused(param: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Unsupported value: '{param}': {reason}, so the schema cannot be enforced by an Anthropic upstream "
        "model.",
        param=param,
        code="unsupported_value",
    )


def _primitive(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _pointer(root: dict[str, Any], ref: str) -> Any:
    """The subschema a local JSON Pointer ``ref`` (``#``, ``#/$defs/a``; RFC 6901 escapes) names, or None."""
    node: Any = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _pointer_path(ref: str) -> str:
    """``#/$defs/a`` -> ``.$defs.a`` (for naming a refused keyword inside a ``$ref`` target)."""
    return "".join(f".{part}" for part in ref[1:].split("/")[1:])


# ---- the Anthropic face: its output format, for a backend that is not Anthropic ------------------------------


def anthropic_output_schema(body: Mapping[str, Any], target: str) -> dict[str, Any] | None:
    """The JSON schema an Anthropic-face body asks its answer to follow (``output_config.format``, or the
    deprecated top-level ``output_format``, each ``{"type": "json_schema", "schema": {...}}``), or None.

    Args:
        body: the client's Messages body.
        target: the backend in words (``"the embedded"``, ``"an OpenAI-compatible upstream"``), for messages.

    Raises:
        InvalidRequestError: ``output_config`` / a format that is not an object, an unknown ``output_config``
            key, a format that is not ``json_schema`` with an object ``schema``, both forms at once (as the
            ``anthropic`` SDK refuses them), an ``output_config.effort`` that is not a string (a string is a hint,
            met as it is by a model without effort levels).
    """
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise InvalidRequestError("output_config: Input should be an object", param="output_config")
    config = config or {}
    if config.get("effort") is not None and not isinstance(config["effort"], str):
        raise InvalidRequestError(
            f"output_config.effort: Input should be a string, got {json_kind(config['effort'])}",
            param="output_config.effort",
        )  # a string: a hint of how hard to think, which a model without effort levels meets as it is
    extra = sorted(set(config) - {"effort", "format"})
    if extra:
        raise InvalidRequestError(
            f"output_config.{extra[0]}: Extra inputs are not permitted", param=f"output_config.{extra[0]}"
        )
    fmt, param = config.get("format"), "output_config.format"
    if body.get("output_format") is not None:
        if fmt is not None:
            raise InvalidRequestError(
                "output_format: both output_format and output_config.format were given; send only "
                "output_config.format (output_format is deprecated).",
                param="output_format",
            )
        fmt, param = body["output_format"], "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequestError(
            f'{param}: expected {{"type": "json_schema", "schema": {{...}}}}', param=param
        )
    extra = sorted(set(fmt) - {"type", "schema"})
    if extra:
        raise InvalidRequestError(
            f"{param}.{extra[0]}: Extra inputs are not permitted", param=f"{param}.{extra[0]}"
        )
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}.schema: Input should be an object", param=f"{param}.schema")
    return schema


def openai_response_format(schema: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's output schema as OpenAI's ``response_format``: ``json_schema`` named ``OPENAI_FORMAT_NAME``,
    ``strict: true`` (Anthropic's format is always enforced; a server that cannot enforce the schema strictly
    answers its own 400, relayed)."""
    return {
        "type": "json_schema",
        "json_schema": {"name": OPENAI_FORMAT_NAME, "schema": schema, "strict": True},
    }


_CHAT_FORMAT_PATH = re.compile(r"response_format(?:\.json_schema(?:\.schema)?)?")


def to_anthropic_format_error(error: APIError, body: Mapping[str, Any]) -> APIError:
    """``error`` naming OpenAI's ``response_format`` (what the embedded engine and the chat checks call the
    output schema) renamed in place to the field the Anthropic body used: ``output_config.format`` (or the
    deprecated ``output_format``), ``response_format.json_schema.schema`` -> ``<that>.schema``. An error that
    does not name it is left as it is. Returns the same object."""
    field = "output_format" if body.get("output_format") is not None else "output_config.format"

    def rename(match: re.Match[str]) -> str:
        return field + (".schema" if match.group(0).endswith(".schema") else "")

    if error.param and _CHAT_FORMAT_PATH.match(error.param):
        error.param = _CHAT_FORMAT_PATH.sub(rename, error.param, count=1)
    error.message = _CHAT_FORMAT_PATH.sub(rename, error.message)
    error.args = (error.message,)
    return error
