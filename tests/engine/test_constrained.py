"""Constrained decoding (llguidance): on a tiny random-weight checkpoint the grammar alone must make every finished
output a valid instance of its random schema, tool calls parse and validate for every ``tool_choice``, forks keep
their own grammar state, and cache on == cache off."""

from __future__ import annotations

import copy
import json

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import Constraint, SamplingParams
from engine.constrained import prefilled, tool_call_grammar
from engine.errors import InvalidRequestError
from engine.schema_instances import has_finite_instance
from engine.schema_relaxation import relaxed, unsupported_only, without_trivial_keywords
from engine.tool_calls import parse_tool_calls, render_call
from tests.engine.engine_helpers import make_engine, random_tokens

NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)

LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 1000),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda xs: {"enum": sorted(set(xs))}, st.lists(NAMES, min_size=1, max_size=4)),
)


def _object(props: dict, required_mask: list[bool]) -> dict:
    names = list(props)
    return {
        "type": "object",
        "properties": props,
        "required": [n for n, r in zip(names, required_mask, strict=False) if r],
        "additionalProperties": False,
    }


def composite(children):
    objects = st.builds(
        _object, st.dictionaries(NAMES, children, min_size=1, max_size=3), st.lists(st.booleans(), max_size=3)
    )
    arrays = st.builds(
        lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)
    )
    any_of = st.builds(lambda a, b: {"anyOf": [a, b]}, children, children)
    return st.one_of(objects, arrays, any_of)


SCHEMAS = st.recursive(LEAVES, composite, max_leaves=6)
"""Random JSON Schemas whose instances are bounded (short strings, bounded integers, at most 3 items / properties),
so a random model must finish one within ``max_tokens``. Unbounded numbers are left out for that reason only."""

_ENGINES: dict[bool, object] = {}


def engine(caching: bool = True):
    if caching not in _ENGINES:
        _ENGINES[caching] = make_engine(enable_prefix_caching=caching)
    return _ENGINES[caching]


def run(eng, constraint: Constraint, seeds, max_tokens=400, n=1, prompt_seed=0):
    reqs = [
        eng.add_request(
            random_tokens(12, prompt_seed + s),
            SamplingParams(max_tokens=max_tokens, seed=s, constraint=constraint, n=n),
        )
        for s in seeds
    ]
    finals = eng.run_to_completion()
    eng.kv.check_invariants()
    assert eng.stats().blocks_used == 0
    ids = [r.request_id for r in reqs]
    return [finals[k] for k in finals if k in ids or k.split("/")[0] in ids]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS)
def test_constrained_output_always_validates_against_its_random_schema(schema):
    for out in run(engine(), Constraint("json_schema", json_schema=schema), seeds=[1, 2]):
        assert out.finish_reason == "stop", out.full_text
        jsonschema.validate(json.loads(out.full_text), schema)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    params=st.lists(st.recursive(LEAVES, composite, max_leaves=3), min_size=1, max_size=3),
    choice=st.sampled_from(["auto", "required", "function"]),
    parallel=st.booleans(),
)
def test_tool_calls_parse_and_validate_for_every_tool_choice(params, choice, parallel):
    tools = tuple(
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": _object({"x": p}, [True])}}
        for i, p in enumerate(params)
    )
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    c = Constraint(
        "tool_calls", tools=tools, tool_choice=choice, tool_name="tool_0", parallel_tool_calls=parallel
    )
    for out in run(engine(), c, seeds=[3, 4], max_tokens=500):
        content, calls = parse_tool_calls(out.full_text)
        if out.finish_reason == "length":
            assert choice == "auto" and not calls  # free text ran out of room
            continue
        assert out.finish_reason == "stop"
        if choice != "auto":
            assert calls and content == ""
        if choice == "function":  # a named tool_choice is one call, parallel or not
            assert [call.name for call in calls] == ["tool_0"]
        if not parallel:
            assert len(calls) <= 1
        for call in calls:
            jsonschema.validate(call.arguments, by_name[call.name])
            assert json.loads(call.arguments_json) == call.arguments


CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": _object({"city": {"enum": ["Paris", "Lisbon"]}}, [True]),
    },
}


@pytest.mark.parametrize("choice", ["required", "function", "auto"])
def test_stop_strings_never_cut_a_call_and_still_cut_the_text_before_one(choice):
    """Stop strings apply to the answer's text, not to its tool calls (OpenAI's stop sequences): stop strings
    that occur in every call (its name, its JSON, its arguments) leave every call whole."""
    c = Constraint("tool_calls", tools=(CITY_TOOL,), tool_choice=choice, tool_name="weather")
    eng = engine()
    stops = ["weather", '"', "Paris", "Lisbon", "</tool_call>"]
    reqs = [
        eng.add_request(
            random_tokens(12, s), SamplingParams(max_tokens=120, seed=s, constraint=c, stop=stops)
        )
        for s in range(4)
    ]
    finals = eng.run_to_completion()
    assert eng.stats().blocks_used == 0
    called = 0
    for req in reqs:
        out = finals[req.request_id]
        content, calls = parse_tool_calls(out.full_text)
        if calls:
            called += 1
            assert out.finish_reason in ("stop", "length") and out.stop_string is None
            assert all(call.arguments["city"] in ("Paris", "Lisbon") for call in calls)
            assert not any(stop in content for stop in stops)
        else:  # only auto may answer with text, which the stop strings do cut
            assert choice == "auto"
            assert not any(stop in out.full_text for stop in stops)
    if choice != "auto":
        assert called == len(reqs)


def test_json_object_forks_each_keep_their_own_grammar_state():
    outs = run(engine(), Constraint("json_object"), seeds=[5], n=3, max_tokens=300)
    assert len(outs) == 3
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.full_text), dict)
        else:
            assert out.full_text.startswith("{")


def test_cache_on_equals_cache_off_with_a_constraint():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99, "minimum": 0}},
        "required": ["a"],
    }
    c = Constraint("json_schema", json_schema=schema)
    prompt = random_tokens(40, 9)

    def tokens(caching):
        eng = make_engine(enable_prefix_caching=caching)
        out = []
        for _ in range(2):  # the second run hits the cache when it is on
            r = eng.add_request(prompt, SamplingParams(max_tokens=60, seed=3, constraint=c))
            eng.run_to_completion()
            out.append(r.output_token_ids)
        return out

    on, off = tokens(True), tokens(False)
    assert on == off and on[0] == on[1]


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, cut=st.floats(0.0, 1.0), seed=st.integers(0, 50))
def test_a_prefix_is_continued_so_prefix_and_output_are_valid_together(schema, cut, seed):
    """An assistant prefill under a format (``Constraint.prefix``): the grammar consumes it first, so the output
    continues it; prefix + output validate, for a prefix cut anywhere in a valid instance (whole included)."""
    whole = run(engine(), Constraint("json_schema", json_schema=schema), seeds=[seed])[0]
    assert whole.finish_reason == "stop"
    prefix = whole.full_text[: max(1, round(cut * len(whole.full_text)))]
    constraint = Constraint("json_schema", json_schema=schema, prefix=prefix)
    for out in run(engine(), constraint, seeds=[seed + 1, seed + 2], prompt_seed=7):
        assert out.finish_reason == "stop", (prefix, out.full_text)
        jsonschema.validate(json.loads(prefix + out.full_text), schema)
        if prefix == whole.full_text:
            assert out.full_text == ""  # a complete instance leaves nothing to add


@pytest.mark.parametrize(
    ("kind", "schema", "prefix"),
    [
        ("json_object", None, "Sure, "),
        ("json_schema", {"type": "object", "required": ["a"]}, '{"b"'),
        ("json_object", None, " {"),
    ],
)
def test_a_prefix_no_output_of_the_format_starts_with_is_refused_before_queueing(kind, schema, prefix):
    eng = engine()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(
            [5, 6, 7], SamplingParams(constraint=Constraint(kind, json_schema=schema, prefix=prefix))
        )
    assert err.value.param == "messages" and json.dumps(prefix) in str(err.value)
    assert not eng.has_unfinished() and eng.stats().blocks_used == 0


def test_prefilled_continues_a_format_and_leaves_calls_alone():
    schema = {"type": "object"}
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
    assert prefilled(Constraint("json_object"), "{") == Constraint("json_object", prefix="{")
    assert prefilled(Constraint("json_schema", json_schema=schema), '{"a"').prefix == '{"a"'
    # a response format with tools: the answer has begun, so its schema alone, with the prefix
    answer = Constraint("tool_calls", tools=tools, json_schema=schema)
    assert prefilled(answer, "{") == Constraint("json_schema", json_schema=schema, prefix="{")
    # calls alone (or text then calls): the prefill is text the output follows, as without a constraint
    for choice in ("auto", "required"):
        calls = Constraint("tool_calls", tools=tools, tool_choice=choice)
        assert prefilled(calls, "Let me look.") is calls
    assert (
        prefilled(
            Constraint("tool_calls", tools=tools, tool_choice="required", json_schema=schema), "{"
        ).prefix
        == ""
    )
    assert prefilled(Constraint("json_object"), "") == Constraint("json_object")


def test_tool_grammar_auto_allows_text_then_calls_and_refuses_unknown_tool_names():
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
    grammar = tool_call_grammar(Constraint("tool_calls", tools=tools))
    assert "start: TEXT | lead body" in grammar
    with pytest.raises(InvalidRequestError) as err:
        tool_call_grammar(Constraint("tool_calls", tools=tools, tool_choice="function", tool_name="g"))
    assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        tool_call_grammar(Constraint("tool_calls", tools=()))


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        Constraint("json_schema", json_schema=None),
        Constraint("tool_calls", tools=({"type": "retrieval"},)),
        Constraint("tool_calls", tools=({"name": "f"},), tool_choice="sometimes"),  # type: ignore[arg-type]
    ],
)
def test_bad_constraints_are_refused_before_queueing(constraint):
    eng = engine()
    with pytest.raises(InvalidRequestError):
        eng.add_request([5, 6, 7], SamplingParams(constraint=constraint))
    assert not eng.has_unfinished()


def test_constraint_without_tokenizer_is_refused():
    eng = make_engine(with_tokenizer=False)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("json_object")))
    assert err.value.param == "response_format"


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, 'Unimplemented keys: ["not"]'),
        (
            {"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}},
            "Unknown format: nope",
        ),
    ],
)
def test_an_unsupported_schema_names_its_tool_without_grammar_internals(schema, problem):
    """Before: the message carried llguidance's grammar listing (``call: "<tool_call>\\n" body ...``). A strict
    tool (a non-strict one falls back to any object, see below) and a response format promise conformance."""
    fine = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = (
        {"type": "function", "function": {"name": "fine", "parameters": fine}},
        {"type": "function", "function": {"name": "odd", "parameters": schema, "strict": True}},
    )
    eng = engine()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("tool_calls", tools=tools)))
    assert err.value.param == "tools"
    assert str(err.value) == (
        f"Invalid 'tools': the schema of tool 'odd' is not supported by constrained decoding: {problem}"
    )
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("json_schema", json_schema=schema)))
    assert (err.value.param, str(err.value)) == (
        "response_format",
        f"Invalid 'response_format': the JSON schema is not supported by constrained decoding: {problem}",
    )
    assert not eng.has_unfinished()


# ---- schemas llguidance cannot compile ----------------------------------------------------------------------
TASK_CREATE = {  # Claude Code's default TaskCreate tool (its input_schema, as a trial sent it)
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "subject": {"type": "string", "description": "A brief title for the task"},
        "description": {"type": "string", "description": "A detailed description of what needs to be done"},
        "activeForm": {"type": "string", "description": "Present continuous form shown in the spinner"},
        "metadata": {
            "type": "object",
            "propertyNames": {"type": "string"},
            "additionalProperties": {},
            "description": "Arbitrary metadata to attach to the task",
        },
    },
    "required": ["subject", "description"],
    "additionalProperties": False,
}
FINE = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
NOT_SCHEMA = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}


def _tool(name: str, parameters: dict, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **extra}}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_claude_codes_task_create_schema_compiles_and_holds_calls_to_the_rest_of_it(choice):
    """Before: every default Claude Code request was a 400 ``Unimplemented keys: ["propertyNames"]``; a
    ``propertyNames`` every key satisfies is dropped before compiling, and the rest of the schema holds."""
    sent = copy.deepcopy(TASK_CREATE)
    tools = (_tool("TaskCreate", TASK_CREATE), _tool("fine", FINE))
    grammar = engine().constraints.grammar(Constraint("tool_calls", tools=tools, tool_choice=choice))
    assert TASK_CREATE == sent  # the client's schema is never modified
    good = {"subject": "Fix", "description": "the bug", "metadata": {"k": [1, {"v": None}], "n": "x"}}
    jsonschema.validate(good, TASK_CREATE)
    assert _accepts(grammar, render_call("TaskCreate", good))
    assert _accepts(grammar, render_call("TaskCreate", {"subject": "a", "description": "b"}))
    for bad in (
        {"subject": "Fix"},  # description is required
        {"subject": "Fix", "description": "b", "metadata": [1]},
        {"subject": "Fix", "description": "b", "owner": "me"},  # closed by additionalProperties: false
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, TASK_CREATE)
        assert not _accepts(grammar, render_call("TaskCreate", bad)), bad
    assert not _accepts(grammar, render_call("fine", {"x": "1"}))


def test_claude_codes_task_create_calls_on_a_random_model_validate():
    tools = (_tool("TaskCreate", TASK_CREATE),)
    c = Constraint("tool_calls", tools=tools, tool_choice="required", parallel_tool_calls=False)
    for out in run(engine(), c, seeds=[1, 2, 3], max_tokens=400):
        content, calls = parse_tool_calls(out.full_text, cut=out.finish_reason == "length")
        assert content == "" and len(calls) == 1
        if out.finish_reason == "stop":
            jsonschema.validate(calls[0].arguments, TASK_CREATE)


@pytest.mark.parametrize(
    ("schema", "trivial"),
    [
        ({"type": "object", "propertyNames": True}, True),
        ({"type": "object", "propertyNames": {}}, True),
        (
            {"type": "object", "properties": {"m": {"type": "object", "propertyNames": {"type": "string"}}}},
            True,
        ),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, False),
        ({"type": "object", "propertyNames": {"type": "string", "maxLength": 3}}, False),
        ({"type": "object", "propertyNames": 1}, False),  # not ``true``
    ],
)
def test_a_response_format_with_a_trivial_property_names_compiles(schema, trivial):
    """``propertyNames`` any key satisfies is dropped (before: ``Unimplemented keys: ["propertyNames"]``);
    another one still cannot be enforced, and a response format promises conformance: a 400."""
    sent = copy.deepcopy(schema)
    c = Constraint("json_schema", json_schema=schema)
    if trivial:
        grammar = engine().constraints.grammar(c)
        assert _accepts(grammar, '{"m": {"k": 1}}' if "properties" in schema else '{"ab": 1}')
    else:
        with pytest.raises(InvalidRequestError) as err:
            engine().constraints.grammar(c)
        assert err.value.param == "response_format"
    assert schema == sent


def test_only_schema_positions_lose_a_trivial_property_names():
    """A property named ``propertyNames`` is a property, not the keyword: kept."""
    schema = {
        "type": "object",
        "properties": {"propertyNames": {"type": "string"}},
        "$defs": {"M": {"type": "object", "propertyNames": True}},
        "items": [{"propertyNames": {}}],
    }
    assert without_trivial_keywords(schema) == {
        "type": "object",
        "properties": {"propertyNames": {"type": "string"}},
        "$defs": {"M": {"type": "object"}},
        "items": [{}],
    }
    unchanged = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert without_trivial_keywords(unchanged) is unchanged


def test_a_non_strict_tool_llguidance_cannot_compile_takes_any_object_and_others_keep_their_grammar(caplog):
    """Before: the whole request was a 400 ``Unimplemented keys: ["not"]`` (Anthropic and OpenAI's non-strict
    functions accept any JSON Schema and promise no conformance). One INFO line names the tool and the reason."""
    tools = (_tool("odd", NOT_SCHEMA), _tool("fine", FINE, strict=True))
    with caplog.at_level("INFO", logger="engine.constrained"):
        grammar = engine().constraints.grammar(Constraint("tool_calls", tools=tools, tool_choice="required"))
    lines = [r.getMessage() for r in caplog.records if "any JSON object" in r.getMessage()]
    assert len(lines) == 1 and "'odd'" in lines[0] and 'Unimplemented keys: ["not"]' in lines[0], lines
    for arguments in ({}, {"a": "a string, which the schema refuses"}, {"b": [1, {"c": None}]}):
        assert _accepts(grammar, render_call("odd", arguments))
    for arguments in ("[1, 2]", '"x"', "null"):
        assert not _accepts(
            grammar, f'<tool_call>\n{{"name": "odd", "arguments": {arguments}}}\n</tool_call>'
        )
    assert _accepts(grammar, render_call("fine", {"x": 1}))
    for arguments in ({"x": "1"}, {}, {"x": 1, "y": 2}):  # fine's exact grammar
        assert not _accepts(grammar, render_call("fine", arguments))
    # a named tool_choice of the loosened tool, and a response format beside it
    named = engine().constraints.grammar(
        Constraint("tool_calls", tools=tools, tool_choice="function", tool_name="odd")
    )
    assert _accepts(named, render_call("odd", {"a": 1}))
    answer = engine().constraints.grammar(Constraint("tool_calls", tools=tools, json_schema=FINE))
    assert _accepts(answer, '{"x": 3}') and _accepts(answer, render_call("odd", {"z": 1}))
    assert not _accepts(answer, '{"x": "3"}')


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?!x)"}}},
        {"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}},
        {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        {"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
        {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
    ],
)
def test_what_llguidance_does_not_implement_falls_back_for_a_non_strict_tool_only(schema):
    eng = engine()
    loose = Constraint("tool_calls", tools=(_tool("odd", schema), _tool("fine", FINE)))
    assert _accepts(eng.constraints.grammar(loose), render_call("odd", {"any": ["thing"]}))
    for strict in ({"strict": True}, {"strict": True, "description": "Anthropic's strict rides as OpenAI's"}):
        tools = (_tool("fine", FINE), _tool("odd", schema, **strict))
        with pytest.raises(InvalidRequestError) as err:
            eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("tool_calls", tools=tools)))
        assert err.value.param == "tools"
        assert str(err.value).startswith("Invalid 'tools': the schema of tool 'odd' is not supported"), (
            err.value
        )
    assert not eng.has_unfinished()


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (  # the unimplemented keyword hid it: llguidance reports only "Unimplemented keys"
            {
                "type": "object",
                "properties": {"a": {"not": {}}, "b": {"type": "integer", "minimum": 3, "maximum": 1}},
                "required": ["b"],
            },
            "Unsatisfiable schema: required property 'b' is unsatisfiable",
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string", "enum": [1, 2]}}, "required": ["a"]},
            "Unsatisfiable schema: required property 'a' is unsatisfiable",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            "admits no instance of finite depth",
        ),
        ({"type": "object", "properties": {"a": {"type": "strng"}}}, "Invalid type: strng"),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}},
            "Pointer '/$defs/Nope' does not exist",
        ),
    ],
)
def test_an_unsatisfiable_or_wrong_schema_is_refused_even_for_a_non_strict_tool(schema, problem):
    eng = engine()
    tools = (_tool("fine", FINE), _tool("odd", schema))
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("tool_calls", tools=tools)))
    assert err.value.param == "tools"
    assert str(err.value).startswith("Invalid 'tools': the schema of tool 'odd' is not supported"), err.value
    assert problem in str(err.value)
    assert not eng.has_unfinished()


def test_a_response_format_llguidance_cannot_compile_is_still_a_400_beside_tools():
    eng = engine()
    c = Constraint("tool_calls", tools=(_tool("odd", NOT_SCHEMA),), json_schema=NOT_SCHEMA)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=c))
    assert (err.value.param, str(err.value)) == (
        "response_format",
        "Invalid 'response_format': the JSON schema is not supported by constrained decoding: Unimplemented keys: [\"not\"]",
    )
    assert not eng.has_unfinished()


def test_unsupported_only_tells_unimplemented_from_wrong_by_llguidances_texts():
    for problem in (
        'Unimplemented keys: ["propertyNames"]',
        "Unknown format: nope",
        "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf",
        "regex parse error: (?=a)b ^^^ error: look-around, including look-ahead and look-behind, is not supported",
        'min/maxProperties only supported when all keys listed in "properties" are required',
    ):
        assert unsupported_only(problem), problem
    for problem in (
        "Unsatisfiable schema: required property 'a' is unsatisfiable",
        "All options in anyOf are unsatisfiable",
        "Pointer '/$defs/Nope' does not exist",
        "Resource 'http://example.com/s.json' is not present in a registry and retrieving it failed",
        "Invalid type: strng",
        "Expected positive integer for 'maxLength', got \"x\"",
    ):
        assert not unsupported_only(problem), problem


def test_relaxed_admits_more_and_leaves_the_input_alone():
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string", "pattern": "^a"}, "o": {"oneOf": [{}], "anyOf": [{}]}},
        "not": {"required": ["x"]},
        "if": {},
        "then": {},
    }
    sent = copy.deepcopy(schema)
    assert relaxed(schema) == {
        "type": "object",
        "properties": {"not": {"type": "string"}, "o": {"anyOf": [{}], "allOf": [{"anyOf": [{}]}]}},
    }
    assert schema == sent


# ---- tool schemas with $ref ---------------------------------------------------------------------------------
UNIT_SCHEMA = {  # what openai.pydantic_function_tool makes of ``class GetWeather(BaseModel): city: str; unit: Unit``
    "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}},
    "properties": {"city": {"title": "City", "type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"],
    "title": "GetWeather",
    "type": "object",
    "additionalProperties": False,
}
TREE_SCHEMA = {  # recursive, through the old-style ``definitions``, nested two levels deep
    "type": "object",
    "properties": {"root": {"$ref": "#/definitions/Node"}},
    "required": ["root"],
    "additionalProperties": False,
    "definitions": {
        "Node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    },
}
LIST_SCHEMA = {  # a linked list through ``#``, the tool's own schema
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
    "additionalProperties": False,
}
OTHER_UNIT_SCHEMA = {  # the same def name as UNIT_SCHEMA's, another type: each tool resolves its own
    "$defs": {"Unit": {"type": "integer"}, "Wrap": {"$ref": "#/$defs/Unit"}},
    "type": "object",
    "properties": {"n": {"$ref": "#/$defs/Wrap"}},
    "required": ["n"],
    "additionalProperties": False,
}
REF_TOOLS = tuple(
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in [
        ("get_weather", UNIT_SCHEMA),
        ("tree", TREE_SCHEMA),
        ("chain", LIST_SCHEMA),
        ("count", OTHER_UNIT_SCHEMA),
    ]
)


def _accepts(grammar: str, text: str) -> bool:
    """Whether ``text`` (tokenized by the tiny checkpoint's tokenizer) is a complete instance of ``grammar``."""
    lltok = engine().constraints.lltokenizer
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    tokens = lltok.tokenize_str(text)
    if matcher.validate_tokens(tokens) < len(tokens):
        return False
    assert matcher.consume_tokens(tokens)
    return matcher.is_accepting()


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize(
    ("name", "arguments", "valid"),
    [
        ("get_weather", {"city": "Paris", "unit": "celsius"}, True),
        ("get_weather", {"city": "Paris", "unit": "kelvin"}, False),
        ("get_weather", {"city": "Paris"}, False),
        ("tree", {"root": {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {"v": 4}]}}, True),
        ("tree", {"root": {"v": 1, "kids": [{"v": 2, "kids": [{"v": "3"}]}]}}, False),
        ("chain", {"v": 1, "next": {"v": 2, "next": {"v": 3, "next": None}}}, True),
        ("chain", {"v": 1, "next": {"v": 2}}, False),
        ("count", {"n": 5}, True),
        ("count", {"n": "celsius"}, False),  # not get_weather's Unit
    ],
)
def test_tool_schemas_with_refs_compile_and_hold_their_calls_to_the_schema(name, arguments, valid, choice):
    """Before: every tool whose schema used ``$ref`` into ``$defs`` / ``definitions`` was refused
    (``Pointer '/$defs/Unit' does not exist``: the schema was embedded under the call schema's
    ``properties.arguments``, so root-relative pointers no longer resolved)."""
    grammar = engine().constraints.grammar(Constraint("tool_calls", tools=REF_TOOLS, tool_choice=choice))
    text = render_call(name, arguments)
    assert _accepts(grammar, text) is valid
    if valid:  # the cases are right about the schema
        jsonschema.validate(arguments, REF_TOOLS_BY_NAME[name])
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(arguments, REF_TOOLS_BY_NAME[name])
    both = render_call("count", {"n": 1}) + "\n" + text
    assert _accepts(grammar, both) is valid


REF_TOOLS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in REF_TOOLS}


def test_the_tool_grammar_writes_calls_byte_for_byte_as_render_call():
    """The call's text around its arguments comes from ``call_head`` / ``CALL_TAIL`` (non-ASCII and quoted
    names included), so a resent call is the model's own text."""
    tools = ({"type": "function", "function": {"name": 'méteo"x', "parameters": UNIT_SCHEMA}},)
    grammar = engine().constraints.grammar(Constraint("tool_calls", tools=tools, tool_choice="required"))
    arguments = {"city": "Zürich", "unit": "celsius"}
    assert _accepts(grammar, render_call('méteo"x', arguments))
    assert not _accepts(grammar, render_call('méteo"x', arguments).replace('": ', '":'))


def test_ref_tools_generate_calls_that_validate_on_a_random_model():
    c = Constraint("tool_calls", tools=REF_TOOLS, tool_choice="required", parallel_tool_calls=True)
    for out in run(engine(), c, seeds=[1, 2, 3], max_tokens=400):
        assert out.finish_reason == "stop", out.full_text
        content, calls = parse_tool_calls(out.full_text)
        assert content == "" and calls
        for call in calls:
            jsonschema.validate(call.arguments, REF_TOOLS_BY_NAME[call.name])


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}, "$defs": {"Yes": {}}},
            "Pointer '/$defs/Nope' does not exist",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/definitions/Nope"}}},
            "Pointer '/definitions/Nope' does not exist",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "http://example.com/schema.json"}}},
            "Resource 'http://example.com/schema.json' is not present in a registry",
        ),
    ],
)
def test_a_ref_that_does_not_resolve_names_the_tool_and_the_pointer(schema, problem):
    tools = REF_TOOLS + ({"type": "function", "function": {"name": "broken", "parameters": schema}},)
    eng = engine()
    for choice in ("auto", "required"):
        with pytest.raises(InvalidRequestError) as err:
            eng.add_request(
                [5, 6, 7],
                SamplingParams(constraint=Constraint("tool_calls", tools=tools, tool_choice=choice)),
            )
        assert err.value.param == "tools"
        message = str(err.value)
        assert message.startswith("Invalid 'tools': the schema of tool 'broken' is not supported"), message
        assert problem in message and "%json" not in message and "body_" not in message
    assert not eng.has_unfinished()


# ---- a response format with tools ---------------------------------------------------------------------------
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "level"],
    "additionalProperties": False,
}


def _with_answer(schema, choice="auto", parallel=True) -> Constraint:
    return Constraint(
        "tool_calls",
        tools=REF_TOOLS,
        tool_choice=choice,
        tool_name="count",
        parallel_tool_calls=parallel,
        json_schema=schema,
    )


CALL = render_call("count", {"n": 5})
OTHER_CALL = render_call("get_weather", {"city": "Paris", "unit": "celsius"})


@pytest.mark.parametrize(
    ("schema", "text", "accepted"),
    [
        (ANSWER_SCHEMA, CALL, True),
        (ANSWER_SCHEMA, CALL + "\n" + OTHER_CALL, True),
        (ANSWER_SCHEMA, '{"answer": "yes", "level": 3}', True),
        (ANSWER_SCHEMA, '{"answer": "maybe", "level": 3}', False),  # not an instance of the schema
        (ANSWER_SCHEMA, '{"answer": "yes"}', False),
        (ANSWER_SCHEMA, "Sure, here it is.", False),  # free text is no longer an answer
        (ANSWER_SCHEMA, "Let me check.\n" + CALL, False),  # nor text before a call
        (ANSWER_SCHEMA, '{"answer": "yes", "level": 3}\n' + CALL, False),  # an answer, then nothing
        (ANSWER_SCHEMA, CALL + '\n{"answer": "yes", "level": 3}', False),  # calls, then nothing but calls
        (ANSWER_SCHEMA, render_call("count", {"n": "x"}), False),  # a call is still held to its tool's schema
        (ANSWER_SCHEMA, render_call("nope", {}), False),
        ({"type": "object"}, '{"anything": [1, {"b": null}]}', True),  # json_object
        ({"type": "object"}, "[1, 2]", False),
        ({"type": "object"}, CALL, True),
    ],
)
def test_a_response_format_with_tools_allows_calls_or_an_answer_in_the_format(schema, text, accepted):
    grammar = engine().constraints.grammar(_with_answer(schema))
    assert _accepts(grammar, text) is accepted


def test_one_call_at_most_without_parallel_calls_and_a_forced_call_ignores_the_format():
    compiler = engine().constraints
    one = compiler.grammar(_with_answer(ANSWER_SCHEMA, parallel=False))
    assert _accepts(one, CALL) and _accepts(one, '{"answer": "no", "level": 0}')
    assert not _accepts(one, CALL + "\n" + OTHER_CALL)
    for choice in ("required", "function"):  # calls only, the same grammar as without a format
        forced = compiler.grammar(_with_answer(ANSWER_SCHEMA, choice))
        assert forced == compiler.grammar(_with_answer(None, choice))
        assert _accepts(forced, CALL) and not _accepts(forced, '{"answer": "no", "level": 0}')
    plain = tool_call_grammar(_with_answer(None))
    assert "start: TEXT | lead body" in plain and "answer" not in plain  # tools alone: the grammar as before


def test_a_response_format_with_tools_gives_a_call_or_an_answer_on_a_random_model():
    """Whatever the random model picks, a finished output is valid calls or a valid answer, never both, and
    the first token decided which (the parser's ``json_answer`` reads it so)."""
    by_kind = {"calls": 0, "answer": 0}
    for out in run(engine(), _with_answer(ANSWER_SCHEMA), seeds=range(8), max_tokens=400):
        assert out.finish_reason == "stop", out.full_text
        content, calls = parse_tool_calls(out.full_text, json_answer=True)
        if calls:
            by_kind["calls"] += 1
            assert content == "" and out.full_text.startswith("<tool_call>")
            for call in calls:
                jsonschema.validate(call.arguments, REF_TOOLS_BY_NAME[call.name])
        else:
            by_kind["answer"] += 1
            assert content == out.full_text
            jsonschema.validate(json.loads(content), ANSWER_SCHEMA)
    assert by_kind["calls"] + by_kind["answer"] == 8
    assert by_kind["calls"] and by_kind["answer"], (
        by_kind
    )  # these seeds give both (fixed weights and prompts)


def test_an_answer_schema_the_engine_cannot_enforce_names_the_response_format():
    eng = engine()
    bad = {"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=_with_answer(bad)))
    assert (err.value.param, str(err.value)) == (
        "response_format",
        "Invalid 'response_format': the JSON schema is not supported by constrained decoding: Unknown format: nope",
    )
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=_with_answer(["not", "a schema"])))
    assert err.value.param == "response_format"
    assert not eng.has_unfinished()


def test_stop_strings_cut_an_answer_in_the_format_and_never_a_call():
    """With a response format and tools, stop strings apply to the answer (as to a format alone), never to
    calls (as with tools alone)."""
    c = Constraint("tool_calls", tools=(CITY_TOOL,), json_schema=ANSWER_SCHEMA)
    eng = engine()
    stops = ["weather", '"', "Paris", "Lisbon", "</tool_call>"]
    reqs = [
        eng.add_request(
            random_tokens(12, s), SamplingParams(max_tokens=120, seed=s, constraint=c, stop=stops)
        )
        for s in range(8)
    ]
    finals = eng.run_to_completion()
    assert eng.stats().blocks_used == 0
    kinds = set()
    for req in reqs:
        out = finals[req.request_id]
        content, calls = parse_tool_calls(out.full_text, json_answer=True)
        if calls:
            kinds.add("calls")
            assert out.stop_string is None and content == ""
            assert all(call.arguments["city"] in ("Paris", "Lisbon") for call in calls)
        else:  # every answer has a key, so '"' cuts it right after its "{"
            kinds.add("answer")
            assert (out.full_text, out.finish_reason, out.stop_string) == ("{", "stop", '"')
    assert kinds == {"calls", "answer"}, kinds


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_tool_choice_is_exactly_one_call_even_with_parallel_calls_allowed(parallel):
    """Before: ``tool_choice`` naming a function allowed repeated calls when ``parallel_tool_calls`` was on, and
    SmolLM2 repeated one identical call until ``max_tokens`` (``finish_reason: length``). A forced call is one
    call (vLLM's and SGLang's named function calling); ``required`` still allows several."""
    one = render_call("count", {"n": 5})
    named = engine().constraints.grammar(
        Constraint(
            "tool_calls",
            tools=REF_TOOLS,
            tool_choice="function",
            tool_name="count",
            parallel_tool_calls=parallel,
        )
    )
    assert _accepts(named, one)
    assert not _accepts(named, one + "\n" + one)
    required = engine().constraints.grammar(
        Constraint("tool_calls", tools=REF_TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    )
    assert _accepts(required, one + "\n" + one) is parallel


@pytest.mark.parametrize("parameters", [{}, {"$ref": "#/$defs/A", "$defs": {"A": {}}}, {"anyOf": [{}, {}]}])
def test_a_tool_schema_without_a_root_type_still_takes_object_arguments_only(parameters):
    """Before (a tools trial): a root that admits any JSON value let the model write ``"arguments": [1, 2]``,
    which the parser dropped: a forced call answered neither a call nor text."""
    tools = ({"type": "function", "function": {"name": "f", "parameters": parameters}},)
    grammar = engine().constraints.grammar(Constraint("tool_calls", tools=tools, tool_choice="required"))
    assert _accepts(grammar, render_call("f", {"a": 1}))
    for arguments in ("[1, 2]", '"x"', "3", "null"):
        assert not _accepts(grammar, f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>')


@pytest.mark.parametrize("root_type", ["array", "string", ["object", "null"]])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_tool_schema_typed_other_than_object_is_refused_before_queueing(root_type, choice):
    eng = engine()
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": root_type}}},)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(
            [5, 6, 7], SamplingParams(constraint=Constraint("tool_calls", tools=tools, tool_choice=choice))
        )
    assert err.value.param == "tools" and "schema must be a JSON Schema of 'type: \"object\"'" in str(
        err.value
    )
    assert not eng.has_unfinished()


def test_a_schema_llguidance_cannot_convert_is_worded_as_every_refused_format():
    """An integer bound past 64 bits: before, ``unsupported JSON schema: Value is not JSON serializable`` (no
    ``Invalid 'response_format'`` for the Anthropic face to rename to ``output_config.format``)."""
    eng = engine()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**22}}}
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("json_schema", json_schema=schema)))
    assert err.value.param == "response_format"
    assert str(err.value).startswith(
        "Invalid 'response_format': the JSON schema is not supported by constrained"
    )
    assert not eng.has_unfinished()


SELF_RECURSIVE = [
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$ref": "#/$defs/A", "$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/A"}, "minItems": 1}}},
    {
        "allOf": [{"$ref": "#/$defs/B"}],
        "$defs": {"B": {"type": "object", "properties": {"b": {"$ref": "#"}}, "required": ["b"]}},
    },
]
"""Schemas every instance of which nests forever (before, a fuzzing trial: answered ``""`` or ``{"`` as ``stop``)."""


@pytest.mark.parametrize("schema", SELF_RECURSIVE)
def test_a_schema_with_no_finite_instance_is_refused_as_format_and_as_tool(schema):
    eng = engine()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("json_schema", json_schema=schema)))
    assert err.value.param == "response_format" and "admits no instance of finite depth" in str(err.value)
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", **schema}}},)
    if "type" in schema and schema["type"] != "object":
        return
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("tool_calls", tools=tools)))
    assert err.value.param == "tools" and "tool 'f'" in str(err.value)
    assert not eng.has_unfinished()


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # "a" optional: {} ends it
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # null ends it
        {
            "type": "object",
            "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}},
            "required": ["a"],
        },
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: any scalar is an instance
        {
            "$ref": "#/$defs/T",
            "$defs": {
                "T": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
                    "required": ["kids"],
                }
            },
        },
    ],
)
def test_a_recursive_schema_with_a_way_out_compiles(schema):
    assert has_finite_instance(schema)
    engine().constraints.grammar(Constraint("json_schema", json_schema=schema))


@pytest.mark.parametrize("schema", SELF_RECURSIVE)
def test_has_finite_instance_refuses_only_endless_recursion(schema):
    assert not has_finite_instance(schema)


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "wat"}, "wat"),
        ({"type": "object", "properties": {"a": {"type": "strng"}}, "required": ["a"]}, "strng"),
        ({"type": ["wat", "object"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "wat"),
        ({"type": [{}]}, "type"),
    ],
)
def test_a_type_json_schema_does_not_have_is_refused_by_its_name_not_as_endless_recursion(schema, message):
    """Before: ``{"type": "wat"}`` was refused as "its $ref recursion never ends" (no ``$ref`` in it): an unknown
    type name counted as admitting nothing; ``{"type": [{}]}`` raised a TypeError inside the check. Such types
    are now left to llguidance, whose refusal names them."""
    assert has_finite_instance(schema)
    eng = engine()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(constraint=Constraint("json_schema", json_schema=schema)))
    assert err.value.param == "response_format" and "recursion" not in str(err.value)
    assert message in str(err.value), str(err.value)
    assert not eng.has_unfinished() and eng.stats().blocks_used == 0
