"""JSON Schema objects closed by default for constrained decoding (``engine.constrained``).

Owns ``closed_schema``: a copy of a tool's ``parameters`` or a response format's schema in which every object that
lists its ``properties`` and says nothing about other keys gets ``"additionalProperties": false``. By JSON Schema
(draft 2020-12, "additionalProperties") such an object admits any other key, and a small constrained model uses
that freedom: SmolLM2 asked for ``get_weather(city)`` wrote ``{"city": "Paris", "type": "object", "properties":
{...}, "required": ["city"]}``, the tool's own schema copied into its arguments. llama.cpp's
``json-schema-to-grammar`` (an absent ``additionalProperties`` closes the object) and xgrammar's default
``strict_mode`` (used by vLLM and SGLang) close such objects too. Every output of the closed schema is still an
instance of the schema the client sent, so nothing a client validates against changes.

Left open, so the closed schema never refuses what the client's schema needs: an object with
``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties`` of its own (the client said), one
without ``properties`` (``{"type": "object"}``: any object), one whose keys other applicators share (``$ref``,
``allOf``, ``anyOf``, ``dependentSchemas`` beside its ``properties``: llguidance intersects sibling keywords, so
closing one side would refuse the other's keys), one that may require keys beyond its ``properties``
(``dependentRequired``, ``minProperties``), a direct branch of an ``allOf`` or ``anyOf`` beside other branches
(``allOf``) or keywords that add or require keys (closed, it would refuse them), a definition a ``$ref`` brings in
beside other keys (pydantic's inheritance, ``{"allOf": [{"$ref": "#/$defs/Base"}], "properties": {...}}``, or a
``$ref`` with sibling ``properties``: closed, it would refuse them; a root-level definition referenced only plainly
is closed, a nested ``$defs`` entry never), and one whose ``required`` names a key its ``properties`` do not list.
A schema with ``not``, ``oneOf`` or ``if`` anywhere comes back unchanged: there a stricter subschema can let
through what the client's refuses (``not`` of a closed object refuses less; an instance of one closed ``oneOf``
branch may match another open one; a closed ``if`` picks the other branch), and a ``$ref`` may bring a closed
definition into such a place. So does one with a ``$ref`` other than ``#`` and ``#/$defs/<name>`` (or
``#/definitions/<name>``) of a root definition, or a nested ``$id`` (``_plain_refs_only``): only those pointers
are followed here, and another could bring a closed subschema in beside keys it would refuse.

Invariant: the input is never modified; the result differs from it only by added ``additionalProperties: false``.
"""

from __future__ import annotations

from typing import Any

_SHARED_KEYS = (
    "$ref",
    "allOf",
    "anyOf",
    "dependentSchemas",
    "dependencies",
    "dependentRequired",
    "minProperties",
)
"""Keywords that give or may require an object keys beside its ``properties``: with any of them the object stays
open (closed, ``{"properties": {"a": {}}, "minProperties": 2}`` could never be written)."""
_OWN_RULE_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
"""Keywords by which the schema already says what other keys may be: kept as written."""
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
"""Keywords whose values are a mapping of name -> subschema."""
_DEFS = ("$defs", "definitions")
"""Keywords of definitions: a mapping of name -> subschema, closed at its top only where every ``$ref`` to it is
plain (``_conjoined_refs``)."""
_KEYLESS = frozenset(
    {
        "$ref",
        "$defs",
        "definitions",
        "$schema",
        "$id",
        "$comment",
        "title",
        "description",
        "default",
        "examples",
    }
    | {"deprecated", "readOnly", "writeOnly", "type"}
)
"""Keywords that neither add nor require a key of an instance: a ``$ref`` (an ``allOf`` / ``anyOf`` branch) among
only these brings its target in alone, so closing the target refuses nothing the schema asks for."""
_SCHEMA_LISTS = ("prefixItems",)
"""Keywords whose values are a list of subschemas (``allOf``'s and ``anyOf``'s branches are walked apart,
``_closed``)."""
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "items", "contains")
"""Keywords whose value is one subschema (``items`` may also be a list, draft 4-7's tuple form)."""
_UNSAFE_KEYS = frozenset({"not", "oneOf", "if"})
"""Keywords under which a stricter subschema can admit more (module docstring): a schema with any is left as is."""


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and nothing else about other keys closed (module
    docstring), or ``schema`` itself when it has ``not``, ``oneOf`` or ``if`` anywhere. Any JSON value is taken:
    non-objects (``true``, a malformed keyword's value) come back as they are, for the grammar compiler to judge.

    Args:
        schema: a JSON Schema as parsed JSON (dicts, lists, scalars).

    Returns:
        A new schema (the input is not modified).
    """
    if not isinstance(schema, dict) or _has_key(schema, _UNSAFE_KEYS) or not _plain_refs_only(schema):
        return schema
    conjoined: set[str] = set()
    _conjoined_refs(schema, conjoined, False)
    return _closed(schema, close_here="#" not in conjoined, conjoined=conjoined)


def _plain_refs_only(schema: dict[str, Any]) -> bool:
    """Whether every ``$ref`` in ``schema`` is ``#`` or names a root definition as ``#/$defs/<name>`` /
    ``#/definitions/<name>`` (the pointers ``_conjoined_refs`` and ``_closed`` match), and no subschema sets its
    own ``$id`` (which would move the base its references resolve against). Another reference (into
    ``#/properties/...``, as zod-to-json-schema writes a reused subschema; a percent-encoded name; an anchor or
    ``$id``-relative one) could bring a closed subschema in beside keys it would refuse (a tools trial: a
    satisfiable schema was refused as unsatisfiable), so such a schema is left as sent."""
    known = {"#"} | {
        f"#/{key}/{pointer_token(name)}"
        for key in _DEFS
        if isinstance(schema.get(key), dict)
        for name in schema[key]
    }
    refs: list[Any] = []
    _collect_refs(schema, refs, root=True)
    return all(ref in known for ref in refs)


def _collect_refs(node: Any, out: list[Any], root: bool = False) -> None:
    """Append every ``$ref`` value in ``node`` to ``out``, and a sentinel for a nested ``$id``."""
    if isinstance(node, list):
        for item in node:
            _collect_refs(item, out)
    elif isinstance(node, dict):
        if "$ref" in node:
            out.append(node["$ref"])
        if "$id" in node and not root:
            out.append(None)  # never a known pointer
        for value in node.values():
            _collect_refs(value, out)


def pointer_token(name: str) -> str:
    """``name`` as one JSON Pointer reference token (RFC 6901: ``~`` -> ``~0``, ``/`` -> ``~1``)."""
    return name.replace("~", "~0").replace("/", "~1")


def _conjoined_refs(node: Any, out: set[str], conjoined: bool) -> None:
    """Add to ``out`` every ``$ref`` whose target meets other keys where it is used: beside keywords that add or
    require keys, or as a branch of an ``allOf`` / ``anyOf`` that is not alone (``_alone``)."""
    if isinstance(node, list):
        for item in node:
            _conjoined_refs(item, out, False)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and (conjoined or not set(node) <= _KEYLESS):
        out.add(ref)
    for key, value in node.items():
        if key in ("allOf", "anyOf") and isinstance(value, list):
            for sub in value:
                _conjoined_refs(sub, out, not _alone(node, key))
        else:
            _conjoined_refs(value, out, False)


def _alone(node: dict[str, Any], key: str) -> bool:
    """Whether each branch of ``node[key]`` (``allOf`` or ``anyOf``) meets no other keys: ``node`` has only keyless
    keywords beside it (not a ``$ref``, whose target's keys the branch would meet), and an ``allOf`` has one branch
    (its branches are conjoined)."""
    return set(node) <= (_KEYLESS - {"$ref"}) | {key} and (key == "anyOf" or len(node[key]) == 1)


def _has_key(node: Any, keys: frozenset[str]) -> bool:
    """Whether any object in ``node`` has one of ``keys`` (a property of that name counts too: a false alarm
    only leaves the schema open)."""
    if isinstance(node, dict):
        return any(k in keys for k in node) or any(_has_key(v, keys) for v in node.values())
    if isinstance(node, list):
        return any(_has_key(v, keys) for v in node)
    return False


def _closed(node: Any, close_here: bool, conjoined: set[str] | None = None) -> Any:
    """``node`` closed where ``_closes`` says (its own top only with ``close_here``). ``conjoined``: given for
    the root only, the ``$ref`` pointers ``_conjoined_refs`` found; the root's definitions close at their tops
    where no such pointer names them, nested ones never."""
    if isinstance(node, list):
        return [_closed(item, True) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed(sub, True) for name, sub in value.items()}
        elif key in _DEFS and isinstance(value, dict):
            out[key] = {
                name: _closed(
                    sub, conjoined is not None and f"#/{key}/{pointer_token(name)}" not in conjoined
                )
                for name, sub in value.items()
            }
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_closed(sub, True) for sub in value]
        elif key in ("allOf", "anyOf") and isinstance(value, list):
            # a branch's own keys close only where nothing else meets them (``_alone``)
            out[key] = [_closed(sub, _alone(node, key)) for sub in value]
        elif key in _SCHEMA_ONE and isinstance(value, (dict, list)):
            out[key] = _closed(value, True)
        else:
            out[key] = value
    if close_here and _closes(node):
        out["additionalProperties"] = False
    return out


def _closes(node: dict[str, Any]) -> bool:
    props = node.get("properties")
    if not isinstance(props, dict):
        return False
    if any(key in node for key in _OWN_RULE_KEYS + _SHARED_KEYS):
        return False
    required = node.get("required", [])
    return isinstance(required, list) and all(isinstance(n, str) and n in props for n in required)
