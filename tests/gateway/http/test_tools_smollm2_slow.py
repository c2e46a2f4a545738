"""A tool-calling round trip with the real default model (SmolLM2-135M-Instruct, whose chat template has no tool
section: the generic tool format) through the server, with the official openai and anthropic SDKs. Whatever the
model chooses, a call must parse and validate against its tool's schema; the tool result is sent back and the
model answers."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from gateway.config.schema import DEFAULT_MODEL_NAME
from tests.gateway.server import RunningServer, write_config

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.mark.slow
def test_smollm2_tool_round_trip_with_both_sdks(tmp_path):
    config = write_config(
        tmp_path / "prefixgate.yaml",
        {
            "models": [
                {
                    "name": DEFAULT_MODEL_NAME,
                    "path": "default",
                    "engine": {"num_blocks": 256, "device": "cpu"},
                }
            ]
        },
    )
    server = RunningServer(config).start(timeout_s=300)
    try:
        assert server.app.state.gateway.registry.get(DEFAULT_MODEL_NAME).engine.tool_format == "generic"
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
        first = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=QUESTION,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            seed=0,
        )
        message = first.choices[0].message
        assert len(message.tool_calls or []) == 1, first
        assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
        for call in message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        history = [
            *QUESTION,
            message.model_dump(exclude_none=True),
            *({"role": "tool", "tool_call_id": c.id, "content": "18C and sunny"} for c in message.tool_calls),
        ]
        chunks = list(
            client.chat.completions.create(
                model=DEFAULT_MODEL_NAME,
                messages=history,
                tools=tools,
                max_tokens=40,
                temperature=0,
                stream=True,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed_calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert text.strip() or streamed_calls  # an answer, or (the model's choice) another valid call
        assert "<tool_call>" not in text

        claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        with claude.messages.stream(
            model=DEFAULT_MODEL_NAME,
            max_tokens=120,
            messages=QUESTION,
            tools=[{"name": "get_weather", "input_schema": WEATHER}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        ) as stream:
            reply = stream.get_final_message()
        uses = [block for block in reply.content if block.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and uses
        for block in uses:
            jsonschema.validate(block.input, WEATHER)
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": "18C and sunny"} for b in uses]
        answer = claude.messages.create(
            model=DEFAULT_MODEL_NAME,
            max_tokens=40,
            messages=[
                *QUESTION,
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": results},
            ],
            tools=[{"name": "get_weather", "input_schema": WEATHER}],
            tool_choice={"type": "none"},
        )
        assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()
        assert (
            server.wait_blocks_released(DEFAULT_MODEL_NAME)["models"][DEFAULT_MODEL_NAME]["blocks"]["used"]
            == 0
        )
    finally:
        server.stop()
