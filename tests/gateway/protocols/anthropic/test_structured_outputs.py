"""Structured outputs across the protocols (``gateway.protocols.anthropic.structured_outputs``): what an
Anthropic model is asked for an OpenAI ``response_format``, which schemas are refused and where, and Anthropic's
output format read for the other backends."""

from __future__ import annotations

import copy

import pytest

from gateway.core.errors import InvalidRequestError
from gateway.protocols.anthropic.structured_outputs import (
    anthropic_output_config,
    anthropic_output_schema,
    check_anthropic_schema,
    openai_response_format,
)

P = "response_format.json_schema.schema"

# what the openai SDK's ``parse(response_format=Model)`` sends for a pydantic model with a nested model, an
# optional field, an enum and a list (strict: every object closed, every property required)
PYDANTIC_STRICT = {
    "$defs": {
        "Address": {
            "properties": {"city": {"title": "City", "type": "string"}},
            "required": ["city"],
            "title": "Address",
            "type": "object",
            "additionalProperties": False,
        },
        "Plan": {"enum": ["free", "pro", "enterprise"], "title": "Plan", "type": "string"},
    },
    "properties": {
        "name": {"title": "Name", "type": "string"},
        "email": {"format": "email", "title": "Email", "type": "string"},
        "plan": {"$ref": "#/$defs/Plan"},
        "home": {"$ref": "#/$defs/Address"},
        "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
        "tags": {"items": {"type": "string"}, "minItems": 1, "title": "Tags", "type": "array"},
        "id": {"pattern": "^[a-z]+$", "type": "string"},
        "const": {"const": 3},
    },
    "required": ["name", "email", "plan", "home", "work", "tags", "id", "const"],
    "title": "Contact",
    "type": "object",
    "additionalProperties": False,
}


def json_schema_format(schema, **spec):
    return {"type": "json_schema", "json_schema": {"name": "contact", "schema": schema, **spec}}


def test_a_json_schema_is_sent_to_anthropic_as_it_is():
    before = copy.deepcopy(PYDANTIC_STRICT)
    for strict in (True, False, None):
        spec = {} if strict is None else {"strict": strict}
        config = anthropic_output_config(json_schema_format(PYDANTIC_STRICT, **spec))
        assert config == {"format": {"type": "json_schema", "schema": PYDANTIC_STRICT}}
    assert PYDANTIC_STRICT == before  # never rewritten


def test_text_or_no_response_format_asks_for_nothing():
    assert anthropic_output_config(None) is None
    assert anthropic_output_config({"type": "text"}) is None


def test_the_format_description_becomes_the_schema_description():
    schema = {"type": "object", "properties": {}, "additionalProperties": False}
    config = anthropic_output_config(json_schema_format(schema, description="A contact card."))
    assert config["format"]["schema"] == {**schema, "description": "A contact card."}
    assert "description" not in schema
    same = {**schema, "description": "A contact card."}
    assert (
        anthropic_output_config(json_schema_format(same, description="A contact card."))["format"]["schema"]
        == same
    )
    with pytest.raises(InvalidRequestError) as info:
        anthropic_output_config(
            json_schema_format({**schema, "description": "Other."}, description="A card.")
        )
    assert (info.value.param, info.value.code) == (
        "response_format.json_schema.description",
        "unsupported_value",
    )


def test_json_object_has_no_anthropic_equivalent():
    with pytest.raises(InvalidRequestError) as info:
        anthropic_output_config({"type": "json_object"})
    assert (info.value.param, info.value.code) == ("response_format", "unsupported_value")
    assert "'json_object'" in info.value.message and "json_schema" in info.value.message


OBJ = {"type": "object", "additionalProperties": False}


def obj(**properties):
    return {**OBJ, "properties": properties, "required": list(properties)}


REFUSED = [
    (obj(age={"type": "integer", "minimum": 0}), f"{P}.properties.age.minimum"),
    (obj(age={"type": "number", "exclusiveMaximum": 9}), f"{P}.properties.age.exclusiveMaximum"),
    (obj(age={"type": "integer", "multipleOf": 2}), f"{P}.properties.age.multipleOf"),
    (obj(name={"type": "string", "maxLength": 8}), f"{P}.properties.name.maxLength"),
    (obj(name={"type": "string", "minLength": 1}), f"{P}.properties.name.minLength"),
    (obj(tags={"type": "array", "items": {"type": "string"}, "minItems": 2}), f"{P}.properties.tags.minItems"),
    (obj(tags={"type": "array", "items": {"type": "string"}, "maxItems": 3}), f"{P}.properties.tags.maxItems"),
    (obj(tags={"type": "array", "items": [{"type": "string"}]}), f"{P}.properties.tags.items"),
    (obj(x={"oneOf": [{"type": "string"}, {"type": "null"}]}), f"{P}.properties.x.oneOf"),
    (obj(x={"not": {"type": "string"}}), f"{P}.properties.x.not"),
    (obj(when={"type": "string", "format": "phone"}), f"{P}.properties.when.format"),
    (obj(kind={"enum": [{"a": 1}, "b"]}), f"{P}.properties.kind.enum"),
    (obj(kind={"const": [1]}), f"{P}.properties.kind.const"),
    ({"type": "object", "properties": {}}, f"{P}.additionalProperties"),  # open by default
    ({**OBJ, "additionalProperties": True}, f"{P}.additionalProperties"),
    (obj(inner={"type": "object", "properties": {}}), f"{P}.properties.inner.additionalProperties"),
    (obj(m={"type": "object", "additionalProperties": {"type": "string"}}), f"{P}.properties.m.additionalProperties"),
    (obj(x={"anyOf": [{"type": "string"}, {"type": "integer", "maximum": 3}]}), f"{P}.properties.x.anyOf[1].maximum"),
    (obj(x={"$ref": "https://example.com/s.json"}), f"{P}.properties.x.$ref"),
    (obj(x={"$ref": "#/$defs/Missing"}), f"{P}.properties.x.$ref"),
    (obj(x=True), f"{P}.properties.x"),
    # a $ref target is checked where it lives, even when only reached through the reference
    (
        {**obj(x={"$ref": "#/definitions/Age"}), "definitions": {"Age": {"type": "integer", "minimum": 0}}},
        f"{P}.definitions.Age.minimum",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "param"), REFUSED)
def test_what_anthropic_cannot_enforce_is_a_400_naming_where(schema, param):
    with pytest.raises(InvalidRequestError) as info:
        anthropic_output_config(json_schema_format(schema))
    assert (info.value.param, info.value.code) == (param, "unsupported_value")
    assert f"'{param}'" in info.value.message and "Anthropic" in info.value.message


@pytest.mark.parametrize(
    "schema",
    [
        # a tree: Node -> children -> Node
        {
            "$defs": {"Node": obj(children={"type": "array", "items": {"$ref": "#/$defs/Node"}})},
            **obj(root={"$ref": "#/$defs/Node"}),
        },
        # the root itself
        obj(parent={"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
        # through two definitions
        {"$defs": {"A": obj(b={"$ref": "#/$defs/B"}), "B": obj(a={"$ref": "#/$defs/A"})}, **obj(a={"$ref": "#/$defs/A"})},
    ],
)  # fmt: skip
def test_recursive_schemas_are_refused(schema):
    with pytest.raises(InvalidRequestError) as info:
        check_anthropic_schema(schema, P)
    assert info.value.param.endswith(".$ref") and "recursive" in info.value.message


def test_a_definition_used_twice_is_not_recursion():
    check_anthropic_schema(PYDANTIC_STRICT, P)  # Address is reached from home and work
    shared = {"$defs": {"S": {"type": "string"}}, **obj(a={"$ref": "#/$defs/S"}, b={"$ref": "#/$defs/S"})}
    check_anthropic_schema(shared, P)


# ---- the Anthropic face's format, for the other backends ---------------------------------------------------

SCHEMA = obj(answer={"type": "string"})


def test_output_config_format_and_the_deprecated_output_format_are_the_same_request():
    assert anthropic_output_schema({}, "x") is None
    assert anthropic_output_schema({"output_config": {}}, "x") is None
    fmt = {"type": "json_schema", "schema": SCHEMA}
    assert anthropic_output_schema({"output_config": {"format": fmt}}, "x") == SCHEMA
    assert anthropic_output_schema({"output_format": fmt}, "x") == SCHEMA
    assert openai_response_format(SCHEMA) == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": SCHEMA, "strict": True},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"output_config": "json"}, "output_config"),
        ({"output_config": {"effort": ["low"]}}, "output_config.effort"),
        ({"output_config": {"verbosity": "low"}}, "output_config.verbosity"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
        ({"output_config": {"format": {"type": "json_schema", "schema": []}}}, "output_config.format.schema"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}, "name": "x"}}}, "output_config.format.name"),
        ({"output_format": {"type": "json_schema"}}, "output_format.schema"),
        (
            {
                "output_format": {"type": "json_schema", "schema": SCHEMA},
                "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
            },
            "output_format",
        ),
    ],
)  # fmt: skip
def test_a_bad_anthropic_output_format_is_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as info:
        anthropic_output_schema(body, "an OpenAI-compatible upstream")
    assert info.value.param == param and info.value.message.startswith(f"{param}:")
