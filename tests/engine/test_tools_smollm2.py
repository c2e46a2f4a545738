"""A tool-calling round trip on the real SmolLM2 (its template has no tool section, so the generic format is used):
whatever the model chooses, the constrained call parses and validates; the tool result rendered back leads to
an answer; the tools + system prefix of the second turn is served from the prefix cache."""

from __future__ import annotations

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
    # one call: greedy SmolLM2 otherwise repeats the same call until max_tokens (parallel calls tested on the tiny
    # checkpoint in test_constrained.py)
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
