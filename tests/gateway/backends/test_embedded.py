"""ChatRequest -> engine GenerationRequest in the embedded backend (no model needed)."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from gateway.backends.embedded import generation_request
from gateway.core.errors import InvalidRequestError
from gateway.core.request import ChatRequest


def request(messages, **fields) -> ChatRequest:
    return ChatRequest(model="m", messages=messages, params=SamplingParams(max_tokens=3), **fields)


def test_messages_become_template_messages():
    generation = generation_request(
        request(
            [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
            ],
            tenant="acme",
            request_id="r1",
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f"},
                    "x-anthropic": {"cache_control": {"type": "ephemeral"}},
                }
            ],
        )
    )
    assert generation.messages[0] == {"role": "system", "content": "Be brief."}
    assert generation.messages[1] == {"role": "user", "content": "a\nb"}
    assert generation.messages[2]["content"] == "" and generation.messages[2]["tool_calls"][0]["id"] == "c"
    assert generation.tools == [{"type": "function", "function": {"name": "f"}}]
    assert (generation.cache_salt, generation.request_id, generation.params.max_tokens) == ("acme", "r1", 3)
    assert generation.prompt is None and generation.prompt_token_ids is None


def test_anthropic_thinking_parts_are_dropped():
    thinking = {"type": "x-anthropic", "block": {"type": "thinking", "thinking": "hmm", "signature": "s"}}
    generation = generation_request(
        request(
            [{"role": "assistant", "content": [thinking, {"type": "text", "text": "answer"}]}],
            anthropic_body={},
        )
    )
    assert generation.messages == [{"role": "assistant", "content": "answer"}]


def test_completion_requests_send_the_prompt():
    generation = generation_request(
        ChatRequest(model="m", messages=[], params=SamplingParams(), kind="completion", prompt="Once")
    )
    assert (generation.prompt, generation.messages, generation.tools) == ("Once", None, None)


@pytest.mark.parametrize(
    ("messages", "fields", "param"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "x-anthropic", "block": {"type": "document"}}]}],
            {},
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"tools": [{"type": "x-anthropic", "tool": {"type": "web_search"}}]},
            "tools[0]",
        ),
        ([{"role": "user", "content": "x"}], {"tool_choice": "required"}, "tool_choice"),
        ([{"role": "user", "content": "x"}], {"openai_body": {"logprobs": True}}, "logprobs"),
        (
            [{"role": "user", "content": "x"}],
            {"openai_body": {"frequency_penalty": 0.5}},
            "frequency_penalty",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"openai_body": {"response_format": {"type": "json_object"}}},
            "response_format",
        ),
    ],
)
def test_what_the_engine_cannot_honour_is_a_400(messages, fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(request(messages, **fields))
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (
        400,
        param,
        "unsupported_value",
    )


def test_neutral_values_and_bookkeeping_fields_are_accepted():
    body = {
        "logprobs": False,
        "frequency_penalty": 0,
        "response_format": {"type": "text"},
        "metadata": {"a": "b"},
        "store": True,
    }
    generation_request(request([{"role": "user", "content": "x"}], openai_body=body, tool_choice="auto"))
    # an Anthropic body is not checked against OpenAI's fields (its own face validated it)
    generation_request(
        request([{"role": "user", "content": "x"}], anthropic_body={"tool_choice": {"type": "auto"}})
    )
