"""What constrained decoding may leave out of a client's JSON schema (``engine.constrained``).

Owns two rewrites of a schema, each on a copy (the client's schema is never modified; the prompt shows it as
sent): ``without_trivial_keywords`` drops keywords every instance satisfies that llguidance does not implement
(the same instances, so the same grammar), and ``relaxed`` drops every keyword llguidance may not implement and
reads ``oneOf`` as ``anyOf`` (a schema admitting every instance of the original and more: if it is unsatisfiable,
so is the original). ``unsupported_only`` tells llguidance's "not implemented" refusals from a schema's own
errors, for the fallback of non-strict tools (``ConstraintCompiler``).

Invariant: neither rewrite ever narrows what an instance may be.
"""

from __future__ import annotations

import re
from typing import Any

_TRIVIAL_PROPERTY_NAMES = (True, {}, {"type": "string"})
"""``propertyNames`` values every object satisfies (a JSON object's keys are strings). llguidance implements no
``propertyNames`` at all ("Unimplemented keys"), and Claude Code's TaskCreate / TaskUpdate tools send
``"metadata": {"type": "object", "propertyNames": {"type": "string"}, ...}``."""
_SUBSCHEMA_MAPS = (
    "properties",
    "patternProperties",
    "dependentSchemas",
    "$defs",
    "definitions",
    "dependencies",
)
"""Keywords whose value maps names to subschemas (``dependencies``' list values are key names, left alone)."""
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
"""Keywords whose value is a list of subschemas (``items`` in draft 4-7's tuple form)."""
_SUBSCHEMA_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
"""Keywords whose value is one subschema."""


def without_trivial_keywords(schema: Any) -> Any:
    """``schema`` without the keywords every instance satisfies that llguidance does not implement: a
    ``propertyNames`` of ``true``, ``{}`` or ``{"type": "string"}``, in any subschema (a property *named*
    ``propertyNames`` is kept: only schema positions are walked). The same instances, so the same grammar;
    the input is never modified (the prompt shows the schema as the client sent it), an unchanged schema
    comes back as itself."""
    if isinstance(schema, list):
        items = [without_trivial_keywords(item) for item in schema]
        return schema if all(a is b for a, b in zip(items, schema, strict=True)) else items
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    changed = False
    for key, value in schema.items():
        if key == "propertyNames" and any(_same_json(value, t) for t in _TRIVIAL_PROPERTY_NAMES):
            changed = True
            continue
        new = value
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            subs = {name: without_trivial_keywords(sub) for name, sub in value.items()}
            new = value if all(subs[n] is value[n] for n in value) else subs
        elif (key in _SUBSCHEMA_LISTS and isinstance(value, list)) or key in _SUBSCHEMA_ONE:
            new = without_trivial_keywords(value)
        changed |= new is not value
        out[key] = new
    return out if changed else schema


def _same_json(value: object, other: object) -> bool:
    """Equal as JSON values (so ``1`` is not ``true``)."""
    return type(value) is type(other) and value == other


_UNSUPPORTED = re.compile(
    r"Unimplemented keys: |Unknown format: |regex parse error|not supported|only supported"
)
"""llguidance's wordings of a schema that uses what it does not implement, rather than a wrong one (the texts of
llguidance 1.9): ``Unimplemented keys: ["not"]`` (``propertyNames``, ``if``, ``uniqueItems``, ``contains``,
``dependentSchemas``...), ``oneOf constraints are not supported...`` (branches that may overlap), ``Unknown
format: x``, ``min/maxProperties only supported when...``, ``circular references with sibling keys are not
supported``, and a ``pattern`` its regex engine cannot parse (look-around, backreferences, or ECMA-262 syntax
its Rust dialect lacks such as ``\\cJ`` or ``[^]``, which it reports as a parse error like a malformed one).
A pointer that does not resolve, a remote ``$ref``, a wrong type or keyword value are the client's errors
(never matched)."""


def unsupported_only(problem: str) -> bool:
    """Whether llguidance's reason for refusing a schema (``schema_problem``) says only that it uses what
    llguidance does not implement (``_UNSUPPORTED``): a non-strict tool's arguments then fall back to any
    object. Never a reason that says the schema (or a part of it) is unsatisfiable: a schema without instances
    is the client's bug, refused for every tool."""
    return "unsatisfiable" not in problem.lower() and _UNSUPPORTED.search(problem) is not None


_RELAXED_AWAY = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "propertyNames",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentSchemas",
        "dependentRequired",
        "unevaluatedProperties",
        "unevaluatedItems",
        "minProperties",
        "maxProperties",
        "format",
        "pattern",
    }
)
"""Keywords that only ever narrow what an instance may be (with ``not`` and ``if`` gone, nothing negates them):
a schema without them admits every instance of the schema with them."""


def relaxed(schema: Any) -> Any:
    """``schema`` without the keywords llguidance may not implement (``_RELAXED_AWAY``) and with ``oneOf`` read
    as ``anyOf``, in every subschema: a schema admitting every instance of ``schema`` (and more), so if it is
    unsatisfiable, so is ``schema``. Hidden behind an unimplemented keyword, an unsatisfiable part is still
    refused (llguidance reports only the unimplemented one). The input is not modified."""
    if isinstance(schema, list):
        return [relaxed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for key, value in schema.items():
        if key in _RELAXED_AWAY:
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: relaxed(sub) for name, sub in value.items()}
        elif (key in _SUBSCHEMA_LISTS and isinstance(value, list)) or key in _SUBSCHEMA_ONE:
            value = relaxed(value)
        out["anyOf" if key == "oneOf" else key] = value
    if "oneOf" in schema and "anyOf" in schema:  # both: their conjunction, as two branches of an allOf
        out["allOf"] = [*out.get("allOf", []), {"anyOf": relaxed(schema["oneOf"])}]
        out["anyOf"] = relaxed(schema["anyOf"])
    return out
