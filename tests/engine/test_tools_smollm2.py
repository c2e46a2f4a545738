"""A tool-calling round trip on the real SmolLM2 (its template has no tool section, so the generic format is used):
whatever the model chooses, the constrained call parses and validates; the tool result rendered back leads to
an answer; the tools + system prefix of the second turn is served from the prefix cache."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from engine.api import Constraint, SamplingParams
from engine.tool_calls import parse_tool_calls
from tests.engine.engine_helpers import make_engine, smollm2_checkpoint

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", "function"])
def test_tool_call_round_trip(choice):
    ck = smollm2_checkpoint()
    assert ck.tokenizer.tool_format == "generic"
    eng = make_engine(ck, num_blocks=128)
    messages = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris right now?"},
    ]
    prompt = ck.tokenizer.render_chat(messages, [WEATHER])
    assert len(prompt) > len(ck.tokenizer.render_chat(messages))  # the tools are in the prompt
    # one call (parallel calls are tested on the tiny checkpoint in test_constrained.py, and a repeated call
    # below)
    c = Constraint(
        "tool_calls", tools=(WEATHER,), tool_choice=choice, tool_name="get_weather", parallel_tool_calls=False
    )
    req = eng.add_request(prompt, SamplingParams(max_tokens=80, temperature=0.0, constraint=c))
    out = eng.run_to_completion()[req.request_id]
    assert out.finish_reason == "stop", out.full_text
    content, calls = parse_tool_calls(out.full_text)
    assert content == "" and len(calls) == 1
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(call.arguments, WEATHER["function"]["parameters"])
    history = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments_json}}
                for k in calls
            ],
        },
        *({"role": "tool", "tool_call_id": k.id, "content": json.dumps({"temp": 18})} for k in calls),
    ]
    second = ck.tokenizer.render_chat(history, [WEATHER])
    assert second[: len(prompt)] == prompt  # the first turn is a prefix of the second
    req2 = eng.add_request(second, SamplingParams(max_tokens=20, temperature=0.0))
    out2 = eng.run_to_completion()[req2.request_id]
    assert out2.usage.completion_tokens > 0
    assert out2.usage.cached_tokens >= (len(prompt) // 16) * 16 - 16


SDK_TOOLS = (  # as the OpenAI SDK's examples write tools: no additionalProperties, optional keys
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
)


@pytest.mark.parametrize("choice", ["required", "function"])
def test_calls_hold_to_the_listed_arguments_of_tools_that_leave_other_keys_open(choice):
    """Before ``engine.closed_schema``, greedy SmolLM2 copied the tool's own schema into its arguments (``{"city":
    "Paris", "type": "object", "properties": {...}, "required": ["city"]}``) and, with ``required``, wrote calls
    until ``max_tokens`` cut one in half."""
    ck = smollm2_checkpoint()
    eng = make_engine(ck, num_blocks=128)
    messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    prompt = ck.tokenizer.render_chat(messages, list(SDK_TOOLS))
    c = Constraint("tool_calls", tools=SDK_TOOLS, tool_choice=choice, tool_name="get_weather")
    req = eng.add_request(prompt, SamplingParams(max_tokens=200, temperature=0.0, constraint=c))
    out = eng.run_to_completion()[req.request_id]
    assert out.finish_reason == "stop", out.full_text
    content, calls = parse_tool_calls(out.full_text)
    assert content == "" and calls and (choice == "required" or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in SDK_TOOLS}
    for call in calls:
        assert set(call.arguments) <= set(schemas[call.name]["properties"]), call.arguments
        jsonschema.validate(call.arguments, schemas[call.name])


@pytest.mark.parametrize("max_tokens", [60, 120])
def test_a_call_repeated_under_required_ends_the_response(max_tokens):
    """With parallel calls allowed, greedy SmolLM2 writes the same call again and again under ``required`` (until
    ``max_tokens`` cut one: a ``length`` finish and the tool called twice); its first repeat now ends the
    response, not returned (``engine.detokenizer.RepeatedCallGuard``): one call, finish ``stop``. At 60 tokens
    the repeat is cut before it completes; at 120 it completes."""
    ck = smollm2_checkpoint()
    eng = make_engine(ck, num_blocks=128)
    tool = copy.deepcopy(
        SDK_TOOLS[0]
    )  # get_weather(city) alone: with a unit to choose it calls once per unit
    del tool["function"]["parameters"]["properties"]["unit"]
    prompt = ck.tokenizer.render_chat([{"role": "user", "content": "What's the weather in Paris?"}], [tool])
    c = Constraint("tool_calls", tools=(tool,), tool_choice="required", parallel_tool_calls=True)
    req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=c))
    out = eng.run_to_completion()[req.request_id]
    assert out.finish_reason == "stop", out.full_text
    content, calls = parse_tool_calls(out.full_text)
    assert content == "" and [k.name for k in calls] == ["get_weather"], out.full_text


def test_a_cut_in_a_new_call_that_starts_like_an_earlier_one_is_a_length_finish():
    """Asked for Paris and Rome, greedy SmolLM2 calls get_weather twice; a ``max_tokens`` cut inside the second
    call, before its arguments close, is text that could still become a new call (it began as a repeat of the
    first). Before (a tools trial): the guard read it as a repeat and answered ``stop`` with the Paris call
    alone, so an agent never learned the Rome call was cut. Now: ``length``, and the cut text is returned for
    the parser to deliver as a cut call."""
    ck = smollm2_checkpoint()
    eng = make_engine(ck, num_blocks=128)
    tool = copy.deepcopy(SDK_TOOLS[0])
    del tool["function"]["parameters"]["properties"]["unit"]
    prompt = ck.tokenizer.render_chat(
        [{"role": "user", "content": "What's the weather in Paris and in Rome?"}], [tool]
    )
    c = Constraint("tool_calls", tools=(tool,), tool_choice="required", parallel_tool_calls=True)

    def run(max_tokens: int):
        req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=c))
        return eng.run_to_completion()[req.request_id], req.output_token_ids

    whole, ids = run(96)
    _, calls = parse_tool_calls(whole.full_text)
    assert len({json.dumps(call.arguments) for call in calls}) >= 2, whole.full_text
    first_end = whole.full_text.index("</tool_call>") + len("</tool_call>")
    second_args_end = whole.full_text.index("}}", first_end)  # the second call's arguments close
    cuts = [
        k for k in range(1, len(ids)) if first_end + 2 < len(ck.tokenizer.decode(ids[:k])) <= second_args_end
    ]
    assert len(cuts) >= 5
    for k in cuts[:: max(1, len(cuts) // 4)]:
        out, _ = run(k)
        assert out.finish_reason == "length", (k, out.full_text)
        assert out.full_text == ck.tokenizer.decode(ids[:k])  # nothing held back or dropped
