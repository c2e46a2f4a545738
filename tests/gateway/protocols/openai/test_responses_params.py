"""Chat field paths -> the Responses body's own (``gateway.protocols.openai.responses_params``), with the
message origins ``chat_message_origins`` traces while translating."""

from __future__ import annotations

import pytest

from gateway.core.errors import InvalidRequestError
from gateway.protocols.openai.responses import chat_message_origins, responses_to_chat_body
from gateway.protocols.openai.responses_params import responses_message, responses_param, to_responses_error

BODY = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "b", "output": "x"},
        {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "y"}]},
    ],
}


@pytest.mark.parametrize(
    ("chat", "responses"),
    [
        ("messages[0].content", "instructions"),
        ("messages[1].content[0].type", "input[0].content[0].type"),
        ("messages[2].tool_calls[0].function.arguments", "input[1].arguments"),
        ("messages[2].tool_calls[1].function.name", "input[2].name"),
        ("messages[2].tool_calls[1].id", "input[2].call_id"),
        ("messages[3].tool_call_id", "input[3].call_id"),
        ("messages[4].content[0].text", "input[4].output[0].text"),
        ("messages[9].content", "input"),
        ("messages", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("reasoning_effort", "reasoning.effort"),
        ("verbosity", "text.verbosity"),
        ("response_format", "text.format"),
        ("response_format.type", "text.format.type"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("tools[1].function.parameters", "tools[1].parameters"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("temperature", "temperature"),
        ("tools[0].type", "tools[0].type"),
    ],
)
def test_a_chat_path_becomes_the_responses_path(chat, responses):
    origins = chat_message_origins(BODY)
    assert responses_param(chat, origins) == responses
    if chat != "messages":  # a bare "messages" in a message is prose as often as a path: left alone
        assert responses_message(f"Invalid '{chat}': x", origins) == f"Invalid '{responses}': x"


def test_a_string_input_is_one_origin_and_the_word_messages_in_prose_stays():
    origins = chat_message_origins({"model": "m", "input": "hello"})
    assert responses_param("messages[0].content", origins) == "input"
    assert (
        responses_message("reduce the length of the messages", origins) == "reduce the length of the messages"
    )


def test_an_error_is_renamed_in_place():
    error = InvalidRequestError("Invalid type for 'max_completion_tokens': x", param="max_completion_tokens")
    assert to_responses_error(error, []) is error
    assert (error.param, error.message, str(error)) == (
        "max_output_tokens",
        "Invalid type for 'max_output_tokens': x",
        "Invalid type for 'max_output_tokens': x",
    )


def test_top_logprobs_zero_asks_for_nothing_and_cache_retention_is_passed_on() -> None:
    base = {"model": "m", "input": "hi"}
    assert "logprobs" not in responses_to_chat_body({**base, "top_logprobs": 0})
    assert responses_to_chat_body({**base, "top_logprobs": 2})["top_logprobs"] == 2
    included = responses_to_chat_body(
        {**base, "top_logprobs": 0, "include": ["message.output_text.logprobs"]}
    )
    assert (included["logprobs"], included["top_logprobs"]) == (True, 0)
    kept = responses_to_chat_body({**base, "prompt_cache_retention": "24h"})
    assert kept["prompt_cache_retention"] == "24h"
