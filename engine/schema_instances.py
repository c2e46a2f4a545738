"""Whether a JSON Schema admits a finite instance, for constrained decoding (``engine.constrained``).

Owns ``has_finite_instance``: False when every instance of the schema would have to nest forever through its
own references (``{"$ref": "#"}``, or an object that requires a property whose schema is the root again). llguidance
compiles such a schema, and the grammar then allows nothing (the answer was ``""``) or runs into a dead end after a
few bytes (``{"``), each with a ``stop`` finish, as if the output were a complete instance. Other unsatisfiable
schemas (``{"enum": []}``, ``{"not": {}}``, conflicting bounds) are llguidance's to refuse; this module looks at
recursion only.

The check is a least fixed point over the schema's own reference targets (the root ``#`` and its root
``$defs`` / ``definitions`` entries): each starts as admitting nothing, and is recomputed from the others until
nothing changes, as a context-free grammar's productive symbols are found. A subschema admits a finite instance
when all its conjoined parts do (``$ref``, ``allOf``; one branch of ``anyOf`` / ``oneOf``) and its ``type`` allows a
scalar, or an object whose required properties all do, or an array whose first ``minItems`` items do. Anything
this module does not follow (another pointer, a keyword it does not know) counts as admitting an instance, so the
check only ever refuses schemas that certainly admit none.

Invariant: the schema is never modified.
"""

from __future__ import annotations

from typing import Any

from engine.closed_schema import pointer_token

_DEFS = ("$defs", "definitions")
_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})
_TYPES = _SCALARS | {"object", "array"}
UNSATISFIABLE = "Unsatisfiable schema: it admits no instance of finite depth (its $ref recursion never ends)"
"""The reason given to a client whose schema ``has_finite_instance`` refuses."""


def has_finite_instance(schema: Any) -> bool:
    """Whether ``schema`` (parsed JSON) admits an instance of finite depth (module docstring).

    Returns:
        False only when the schema's references leave no way out of their recursion; True otherwise, also for
        schemas this module does not understand (conservative).
    """
    if not isinstance(schema, dict):
        return schema is not False
    targets: dict[str, Any] = {"#": schema}
    for key in _DEFS:
        defs = schema.get(key)
        if isinstance(defs, dict):
            for name, sub in defs.items():
                targets[f"#/{key}/{pointer_token(name)}"] = sub
    known: dict[str, bool] = dict.fromkeys(targets, False)
    for _ in range(len(targets) + 1):  # monotone: at most one target turns True per round
        changed = False
        for pointer, sub in targets.items():
            if not known[pointer] and _admits(sub, known, 0):
                known[pointer] = changed = True
        if not changed:
            break
    return known["#"]


_MAX_DEPTH = 200
"""Deeper than this, a subschema counts as admitting an instance (the body's JSON nesting is bounded already)."""


def _admits(node: Any, known: dict[str, bool], depth: int) -> bool:
    """Whether ``node`` admits a finite instance, given which reference targets do (``known``)."""
    if node is False:
        return False
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not known.get(ref, True):
        return False
    for branch in _schemas(node.get("allOf")):
        if not _admits(branch, known, depth + 1):
            return False
    for key in ("anyOf", "oneOf"):
        branches = _schemas(node.get(key))
        if branches and not any(_admits(b, known, depth + 1) for b in branches):
            return False
    types = node.get("type")
    if isinstance(types, list) and all(isinstance(t, str) for t in types):
        allowed = set(types)
    elif isinstance(types, str):
        allowed = {types}
    else:
        return True  # no type (any instance), or a ``type`` this module does not read
    if not allowed <= _TYPES:
        return True  # a type name JSON Schema does not have: llguidance's to refuse, by its name
    if allowed & _SCALARS or "enum" in node or "const" in node:
        return True  # a scalar instance (object and array keywords do not apply to it)
    if "object" in allowed and _object_admits(node, known, depth):
        return True
    return "array" in allowed and _array_admits(node, known, depth)


def _schemas(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _object_admits(node: dict[str, Any], known: dict[str, bool], depth: int) -> bool:
    properties = node.get("properties")
    required = node.get("required")
    if not isinstance(properties, dict) or not isinstance(required, list):
        return True
    return all(
        _admits(properties[name], known, depth + 1)
        for name in required
        if isinstance(name, str) and name in properties
    )


def _array_admits(node: dict[str, Any], known: dict[str, bool], depth: int) -> bool:
    least = node.get("minItems", 0)
    if not isinstance(least, int) or least <= 0:
        return True
    prefix = _schemas(node.get("prefixItems"))
    if not all(_admits(sub, known, depth + 1) for sub in prefix[:least]):
        return False
    if least <= len(prefix):
        return True
    items = node.get("items")
    return _admits(items, known, depth + 1) if isinstance(items, dict) or items is False else True
