"""Hypothesis strategies for the JSON Schema subset ``gateway.protocols.openapi`` uses (``type``, ``const``,
``enum``, ``anyOf``, ``properties`` / ``required`` / ``additionalProperties: false``, ``items``,
``minItems`` / ``maxItems``, ``minimum`` / ``maximum``, ``minLength``; the empty schema is any JSON value).

hypothesis-jsonschema 0.23 does not run on this hypothesis (``'many' object has no attribute 'more'`` while
generating objects), so the fuzz tests use this instead; a schema keyword outside the subset raises, so the
document cannot silently outgrow it.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SUPPORTED = frozenset(
    {"type", "const", "enum", "anyOf", "properties", "required", "additionalProperties", "items", "minItems",
     "maxItems", "minimum", "maximum", "minLength", "examples", "description"}
)  # fmt: skip

ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid against ``schema``.

    Raises:
        ValueError: a keyword outside ``SUPPORTED``.
    """
    unknown = set(schema) - SUPPORTED
    if unknown:
        raise ValueError(f"schema keywords not supported by the fuzz generator: {sorted(unknown)}")
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(option) for option in schema["anyOf"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": one}) for one in kind])
    if kind is None:
        return ANY_JSON
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.floats(low, high, allow_nan=False, allow_infinity=False) | st.integers(
            None if low is None else int(low), None if high is None else int(high)
        )
    if kind == "array":
        items = from_schema(schema.get("items", {}))
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=schema.get("maxItems", low + 3))
    if kind == "object":
        return _object(schema)
    raise ValueError(f"unsupported type {kind!r}")


def _object(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties = schema.get("properties", {})
    required = {name: from_schema(properties.get(name, {})) for name in schema.get("required", [])}
    optional = {name: from_schema(sub) for name, sub in properties.items() if name not in required}
    base = st.fixed_dictionaries(required, optional=optional)
    if schema.get("additionalProperties", True) is False:
        return base
    extra = st.dictionaries(
        st.text(max_size=8).filter(lambda key: key not in properties), ANY_JSON, max_size=2
    )
    return st.builds(lambda fixed, more: {**more, **fixed}, base, extra)
