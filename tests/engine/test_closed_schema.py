"""Objects closed by default in constrained decoding (``engine.closed_schema``): which objects are closed, which stay
open, and the grammars built from them refusing a key the schema does not list (tool arguments, forced calls,
response formats) while an open object still takes any key."""

from __future__ import annotations

import copy
import json

import pytest

from engine.api import Constraint
from engine.closed_schema import closed_schema
from engine.tool_calls import render_call
from tests.engine.test_constrained import _accepts, engine

CLOSED = {"additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "number"}}}


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        # listed properties, nothing said about other keys: closed, at every depth (properties, items, $defs,
        # anyOf branches, an additionalProperties schema, contains, prefixItems)
        (POINT, {**POINT, **CLOSED}),
        (
            {"type": "object", "properties": {"p": POINT}, "required": ["p"]},
            {"type": "object", "properties": {"p": {**POINT, **CLOSED}}, "required": ["p"], **CLOSED},
        ),
        ({"type": "array", "items": POINT}, {"type": "array", "items": {**POINT, **CLOSED}}),
        (
            {"prefixItems": [POINT], "contains": POINT},
            {"prefixItems": [{**POINT, **CLOSED}], "contains": {**POINT, **CLOSED}},
        ),
        (
            {"$defs": {"P": POINT}, "$ref": "#/$defs/P"},
            {"$defs": {"P": {**POINT, **CLOSED}}, "$ref": "#/$defs/P"},
        ),
        ({"definitions": {"P": POINT}}, {"definitions": {"P": {**POINT, **CLOSED}}}),
        ({"anyOf": [POINT, {"type": "null"}]}, {"anyOf": [{**POINT, **CLOSED}, {"type": "null"}]}),
        (
            {"type": "object", "additionalProperties": POINT},
            {"type": "object", "additionalProperties": {**POINT, **CLOSED}},
        ),
        # the client said what other keys may be: kept as written
        ({**POINT, "additionalProperties": True}, {**POINT, "additionalProperties": True}),
        (
            {**POINT, "additionalProperties": {"type": "string"}},
            {**POINT, "additionalProperties": {"type": "string"}},
        ),
        ({**POINT, "patternProperties": {"^y": {}}}, {**POINT, "patternProperties": {"^y": {}}}),
        ({**POINT, "unevaluatedProperties": False}, {**POINT, "unevaluatedProperties": False}),
        # any object, or keys that sibling applicators share: open
        ({"type": "object"}, {"type": "object"}),
        ({**POINT, "$ref": "#/$defs/Q"}, {**POINT, "$ref": "#/$defs/Q"}),
        ({**POINT, "anyOf": [{"required": ["x"]}]}, {**POINT, "anyOf": [{"required": ["x"]}]}),
        (
            {**POINT, "dependentSchemas": {"x": POINT}},
            {**POINT, "dependentSchemas": {"x": {**POINT, **CLOSED}}},
        ),
        # keys the object may be required to have beyond its properties: open (closed, never writable)
        ({**POINT, "dependentRequired": {"x": ["y"]}}, {**POINT, "dependentRequired": {"x": ["y"]}}),
        ({**POINT, "minProperties": 2}, {**POINT, "minProperties": 2}),
        # an anyOf branch beside keys of its owner stays open at its top (closed, {"y"} would refuse the required
        # "x": a schema that could never be written); alone (an optional value), it closes
        (
            {
                "type": "object",
                "properties": {"x": {}},
                "required": ["x"],
                "anyOf": [{"properties": {"y": POINT}}],
            },
            {
                "type": "object",
                "properties": {"x": {}},
                "required": ["x"],
                "anyOf": [{"properties": {"y": {**POINT, **CLOSED}}}],
            },
        ),
        (
            {
                "properties": {"p": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}], "default": None}},
                "$defs": {"B": POINT},
            },
            {
                "properties": {"p": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}], "default": None}},
                "$defs": {"B": {**POINT, **CLOSED}},
                **CLOSED,
            },
        ),
        (  # an anyOf branch beside a $ref meets the target's keys: both stay open at their tops
            {
                "$defs": {"X": POINT},
                "properties": {"p": {"$ref": "#/$defs/X", "anyOf": [{"properties": {"y": {}}}]}},
            },
            {
                "$defs": {"X": POINT},
                "properties": {"p": {"$ref": "#/$defs/X", "anyOf": [{"properties": {"y": {}}}]}},
                **CLOSED,
            },
        ),
        # a definition a $ref brings in beside other keys stays open at its top (pydantic's inheritance: closed,
        # Base would refuse the subclass's own keys); referenced only plainly, it closes
        (
            {"$defs": {"Base": POINT}, "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"y": {}}},
            {"$defs": {"Base": POINT}, "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"y": {}}},
        ),
        (
            {"$defs": {"B": POINT}, "properties": {"p": {"$ref": "#/$defs/B", "properties": {"y": {}}}}},
            {
                "$defs": {"B": POINT},
                "properties": {"p": {"$ref": "#/$defs/B", "properties": {"y": {}}}},
                **CLOSED,
            },
        ),
        (
            {
                "$defs": {"B": POINT},
                "properties": {"p": {"allOf": [{"$ref": "#/$defs/B"}], "description": "d"}},
            },
            {
                "$defs": {"B": {**POINT, **CLOSED}},
                "properties": {"p": {"allOf": [{"$ref": "#/$defs/B"}], "description": "d"}},
                **CLOSED,
            },
        ),
        (
            {
                "definitions": {"a/b": POINT},
                "properties": {"p": {"$ref": "#/definitions/a~1b", "title": "t"}},
            },
            {
                "definitions": {"a/b": {**POINT, **CLOSED}},
                "properties": {"p": {"$ref": "#/definitions/a~1b", "title": "t"}},
                **CLOSED,
            },
        ),
        (  # a nested $defs entry's top stays open (its pointer is not the root's); deeper objects close
            {"properties": {"p": {"$defs": {"Q": {"properties": {"q": POINT}}}}}},
            {"properties": {"p": {"$defs": {"Q": {"properties": {"q": {**POINT, **CLOSED}}}}}}, **CLOSED},
        ),
        # required names a key the properties do not list: open (closed, it could never be written)
        ({**POINT, "required": ["x", "y"]}, {**POINT, "required": ["x", "y"]}),
        # allOf: each branch's own keys stay open (closed branches would refuse each other's), deeper ones close
        (
            {"allOf": [POINT, {"properties": {"y": POINT}}]},
            {"allOf": [POINT, {"properties": {"y": {**POINT, **CLOSED}}}]},
        ),
        # not / oneOf / if anywhere: a stricter subschema could admit more, so nothing changes
        ({"type": "object", "properties": {"p": POINT}, "not": {"required": ["q"]}}, None),
        ({"oneOf": [POINT, {"type": "object", "properties": {"y": {}}}]}, None),
        ({"properties": {"p": {"if": POINT, "then": POINT}}}, None),
        # a $ref other than "#" or a root definition's plain pointer, or a nested $id: nothing changes (a tools
        # trial: zod-to-json-schema's "#/properties/home" reused in an allOf beside more keys was closed, and a
        # satisfiable schema refused as unsatisfiable; so was a percent-encoded name, and an $id-relative ref)
        (
            {
                "type": "object",
                "properties": {
                    "home": POINT,
                    "work": {
                        "allOf": [{"$ref": "#/properties/home"}, {"properties": {"y": {}}, "required": ["y"]}]
                    },
                },
            },
            None,
        ),
        ({"properties": {"a": {"$ref": "#/$defs/A%20B"}}, "$defs": {"A B": POINT}}, None),
        (
            {
                "$id": "https://x.test/root",
                "properties": {"a": {"$ref": "a"}},
                "$defs": {"a": {"$id": "a", **POINT}},
            },
            None,
        ),
        ({"properties": {"a": {"$ref": "#/$defs/Nope"}}, "$defs": {"A": POINT}}, None),
        # a root definition's plain pointer, escaped as RFC 6901 says: followed, closed as before
        (
            {"properties": {"a": {"$ref": "#/$defs/A~1B"}}, "$defs": {"A/B": POINT}},
            {"properties": {"a": {"$ref": "#/$defs/A~1B"}}, "$defs": {"A/B": {**POINT, **CLOSED}}, **CLOSED},
        ),
        # not a schema object: as it is
        (True, True),
        ([POINT], [POINT]),
        ("text", "text"),
    ],
)
def test_objects_are_closed_only_where_the_schema_says_nothing_of_other_keys(schema, expected):
    before = copy.deepcopy(schema)
    got = closed_schema(schema)
    assert got == (before if expected is None else expected)
    assert schema == before  # the client's schema is never modified


WEATHER = {  # as the OpenAI SDK's examples write a tool: no additionalProperties
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
OPEN_WEATHER = {**WEATHER, "additionalProperties": True}
TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "open_weather", "parameters": OPEN_WEATHER}},
    {"type": "function", "function": {"name": "anything", "parameters": {"type": "object"}}},
)


@pytest.mark.parametrize("choice", ["auto", "required", "function"])
@pytest.mark.parametrize(
    ("name", "arguments", "accepted"),
    [
        ("get_weather", {"city": "Paris"}, True),
        ("get_weather", {"city": "Paris", "unit": "celsius"}, True),
        # SmolLM2's arguments before: the tool's schema copied into them
        ("get_weather", {"city": "Paris", "type": "object", "required": ["city"]}, False),
        ("get_weather", {"city": "Paris", "country": "France"}, False),
        ("open_weather", {"city": "Paris", "country": "France"}, True),
        ("anything", {"any": 1, "key": [2]}, True),
    ],
)
def test_tool_arguments_hold_to_the_listed_properties_unless_the_schema_opens_them(
    choice, name, arguments, accepted
):
    c = Constraint("tool_calls", tools=TOOLS, tool_choice=choice, tool_name=name)
    assert _accepts(engine().constraints.grammar(c), render_call(name, arguments)) is accepted


REQUIRED_BESIDE_ANYOF = {
    "type": "object",
    "properties": {"x": {"type": "integer"}},
    "required": ["x"],
    "anyOf": [{"properties": {"y": {"type": "integer"}}}],
}
INHERITED = {  # pydantic's shape for class Child(Base): the child's own key beside the base's
    "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
    "allOf": [{"$ref": "#/$defs/Base"}],
    "properties": {"b": {"type": "integer"}},
    "required": ["b"],
}

ZOD_REUSED = {  # zod-to-json-schema's root $refStrategy for a reused subschema (before: refused, unsatisfiable)
    "type": "object",
    "properties": {
        "home": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        "work": {
            "allOf": [
                {"$ref": "#/properties/home"},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]},
            ]
        },
    },
    "required": ["home", "work"],
}


@pytest.mark.parametrize(
    ("schema", "answer", "accepted"),
    [
        (INHERITED, {"a": 1, "b": 2}, True),
        (REQUIRED_BESIDE_ANYOF, {"x": 1, "y": 2}, True),
        (WEATHER, {"city": "Paris"}, True),
        (WEATHER, {"city": "Paris", "extra": 1}, False),
        (OPEN_WEATHER, {"city": "Paris", "extra": 1}, True),
        ({"type": "object"}, {"extra": 1}, True),
        (ZOD_REUSED, {"home": {"x": 1}, "work": {"x": 2, "y": 3}}, True),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/A%20B"}}, "$defs": {"A B": WEATHER}},
            {"a": {"city": "Paris"}},
            True,
        ),
    ],
)
def test_a_response_format_holds_to_the_listed_properties_unless_the_schema_opens_them(
    schema, answer, accepted
):
    grammar = engine().constraints.grammar(Constraint("json_schema", json_schema=schema))
    assert _accepts(grammar, json.dumps(answer)) is accepted
