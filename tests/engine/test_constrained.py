"""Constrained decoding (llguidance): on a tiny random-weight checkpoint the grammar alone must make every finished
output a valid instance of its random schema, tool calls parse and validate for every ``tool_choice``, forks keep
their own grammar state, and cache on == cache off."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import Constraint, SamplingParams
from engine.constrained import tool_call_grammar
from engine.errors import InvalidRequestError
from engine.tool_calls import parse_tool_calls
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
        if choice == "function":
            assert {call.name for call in calls} == {"tool_0"}
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
    """Before: the message carried llguidance's grammar listing (``call: "<tool_call>\\n" body ...``)."""
    fine = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = (
        {"type": "function", "function": {"name": "fine", "parameters": fine}},
        {"type": "function", "function": {"name": "odd", "parameters": schema}},
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
