"""Parsing OpenAI bodies into ChatRequest, and formatting responses and chunks like OpenAI's."""

from __future__ import annotations

import json

import pytest

from engine.api import SamplingParams
from gateway.core.errors import InvalidRequestError
from gateway.core.events import BackendUsage, Finish
from gateway.core.headers import check_tenant
from gateway.core.request import ChatRequest
from gateway.protocols.openai.parse import parse_chat_request, parse_completion_request
from gateway.protocols.openai.render import (
    ResponseMeta,
    chat_chunk,
    chat_completion_body,
    completion_body,
    merge_tool_call_deltas,
    usage_body,
    usage_chunk,
)
from gateway.protocols.openai.responses import responses_to_chat_body
from gateway.transport.sse import parse_sse
from tests.gateway.upstream_helpers import fixture_bytes

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def chat(**fields):
    return parse_chat_request({"model": "m", "messages": MESSAGES, **fields}, {})


def test_minimal_chat_body():
    request = chat()
    assert request.model == "m" and request.kind == "chat" and request.anthropic_body is None
    assert request.messages == MESSAGES
    assert request.params == SamplingParams(
        max_tokens=None, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=()
    )
    assert (request.stream, request.include_usage, request.rules_enabled, request.tenant) == (
        False,
        False,
        True,
        "",
    )


def test_sampling_fields_map_to_sampling_params():
    request = chat(temperature=0.5, top_p=0.9, max_tokens=7, stop="\n", seed=3, user="u1", n=1, top_k=40)
    assert request.params == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop=("\n",)
    )
    assert request.user == "u1"


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=9).params.max_tokens == 9


def test_top_p_zero_is_greedy():
    params = chat(top_p=0, temperature=0.7).params
    assert (params.temperature, params.top_p) == (0.0, 1.0)


def test_stream_options_and_headers():
    request = parse_chat_request(
        {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
        {"x-prefixgate-rules": "OFF", "x-prefixgate-tenant": "acme"},
    )
    assert (request.stream, request.include_usage, request.rules_enabled, request.tenant) == (
        True,
        True,
        False,
        "acme",
    )


def test_content_parts_and_tool_messages_are_accepted():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = parse_chat_request({"model": "m", "messages": messages, "tools": tools}, {})
    assert request.messages == messages and request.tools == tools
    messages[1]["content"] = []  # an assistant turn of calls alone may say so with an empty array
    assert parse_chat_request({"model": "m", "messages": messages, "tools": tools}, {}).messages == messages


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"model": None}, "model", "invalid_type"),
        ({"messages": "hi"}, "messages", "invalid_type"),
        ({"messages": []}, "messages", "empty_array"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "empty_array"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": []}]},
            "messages[1].content",
            "empty_array",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
            "invalid_type",
        ),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]", "invalid_type"),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "missing_required_parameter",
        ),
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"top_p": 1.5}, "top_p", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 1.5}, "max_tokens", "invalid_type"),
        ({"max_completion_tokens": True}, "max_completion_tokens", "invalid_type"),
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"seed": 1 << 64}, "seed", "integer_above_max_value"),
        ({"seed": -(1 << 63) - 1}, "seed", "integer_below_min_value"),
        ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        ({"frequency_penalty": "x"}, "frequency_penalty", "invalid_type"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
        ({"logit_bias": [1]}, "logit_bias", "invalid_type"),
        ({"logprobs": 1}, "logprobs", "invalid_type"),
        ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "missing_required_parameter",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
            "response_format.json_schema.schema",
            "invalid_type",
        ),
        ({"n": "1"}, "n", "invalid_type"),
        ({"seed": "x"}, "seed", "invalid_type"),
        ({"stop": 5}, "stop", "invalid_type"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
        ({"stop": [""]}, "stop", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        (
            {"stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            "invalid_type",
        ),
        # Before (a fresh-user trial): accepted, and service_tier echoed as "default"
        ({"service_tier": "bogus"}, "service_tier", "invalid_value"),
        ({"prompt_cache_retention": "1y"}, "prompt_cache_retention", "invalid_value"),
        ({"stream": True, "stream_options": {"foo": 1}}, "stream_options.foo", "unknown_parameter"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": "no"}},
            "stream_options.include_obfuscation",
            "invalid_type",
        ),
        ({"user": 7}, "user", "invalid_type"),
        ({"tools": {}}, "tools", "invalid_type"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "invalid_value"),
        (
            {"tools": [{"type": "function", "function": {}}]},
            "tools[0].function.name",
            "missing_required_parameter",
        ),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        (  # before: accepted (OpenAI: a json_schema name matches ^[a-zA-Z0-9_-]+$, 64 characters at most)
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
            "response_format.json_schema.name",
            "invalid_value",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": {}}}},
            "response_format.json_schema.name",
            "string_above_max_length",
        ),
        ({"metadata": ["a"]}, "metadata", "invalid_type"),
        ({"metadata": {"a": 5}}, "metadata.a", "invalid_type"),
        ({"metadata": {"a": None}}, "metadata.a", "invalid_type"),
        ({"metadata": {"a": "v" * 513}}, "metadata.a", "string_above_max_length"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "string_above_max_length"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "object_above_max_properties"),
        # Before (a fuzzing trial): each of these was a 500 (an unhashable value in a set test, a float overflow,
        # a part's text joined unchecked) or a 200 with the field silently ignored
        ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role", "invalid_type"),
        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role", "invalid_type"),
        ({"repetition_penalty": 10**309}, "repetition_penalty", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "messages[0].content[0].text",
            "invalid_type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": [{"type": "refusal"}]},
                ]
            },
            "messages[1].content[0].refusal",
            "invalid_type",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "function_call": 5}]},
            "messages[1].function_call",
            "invalid_type",
        ),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
        ({"store": "yes"}, "store", "invalid_type"),
        ({"prompt_cache_key": {"a": [1]}}, "prompt_cache_key", "invalid_type"),
        ({"safety_identifier": 42}, "safety_identifier", "invalid_type"),
        ({"prompt_cache_options": 7}, "prompt_cache_options", "invalid_type"),
        ({"moderation": []}, "moderation", "invalid_type"),
        # Before (a tools trial): accepted, or refused in words about tool_choice
        ({"tools": []}, "tools", "empty_array"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            "invalid_type",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
            "tools[0].function.description",
            "invalid_type",
        ),
    ],
)
def test_bad_chat_fields_are_400_with_param_and_code(fields, param, code):
    body = {"model": "m", "messages": MESSAGES, **fields}
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(body, {})
    error = caught.value
    assert (error.status_code, error.param, error.code) == (400, param, code)
    assert error.openai_body()["error"]["type"] == "invalid_request_error"


def test_metadata_within_openais_limits_is_accepted():
    metadata = {f"k{i}": "v" * 512 for i in range(15)} | {"k" * 64: ""}
    assert chat(metadata=metadata).openai_body["metadata"] == metadata
    assert chat(metadata=None).openai_body["metadata"] is None


def test_missing_model_and_messages():
    for body, param in (({"messages": MESSAGES}, "model"), ({"model": "m"}, "messages")):
        with pytest.raises(InvalidRequestError) as caught:
            parse_chat_request(body, {})
        assert (caught.value.param, caught.value.code) == (param, "missing_required_parameter")


def test_bad_headers():
    with pytest.raises(InvalidRequestError, match="x-prefixgate-rules"):
        parse_chat_request({"model": "m", "messages": MESSAGES}, {"x-prefixgate-rules": "maybe"})
    # the tenant header is read as sent; whether it may become a cache salt is decided by authorization
    request = parse_chat_request({"model": "m", "messages": MESSAGES}, {"x-prefixgate-tenant": "t" * 300})
    assert request.tenant == "t" * 300
    with pytest.raises(InvalidRequestError, match="x-prefixgate-tenant"):
        check_tenant(request.tenant)


def test_completion_body():
    request = parse_completion_request({"model": "m", "prompt": "Once"}, {})
    assert (request.kind, request.prompt, request.messages, request.params.max_tokens) == (
        "completion",
        "Once",
        [],
        16,
    )
    assert (
        parse_completion_request({"model": "m", "prompt": ["Once"], "max_tokens": 3}, {}).params.max_tokens
        == 3
    )
    for prompt in (["a", "b"], [1, 2], None):
        with pytest.raises(InvalidRequestError) as caught:
            parse_completion_request({"model": "m", "prompt": prompt}, {})
        assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as caught:
        parse_completion_request({"model": "m"}, {})
    assert caught.value.code == "missing_required_parameter"
    with pytest.raises(InvalidRequestError) as caught:  # before: 200 (OpenAI: best_of >= n)
        parse_completion_request({"model": "m", "prompt": "x", "best_of": 1, "n": 2}, {})
    assert (caught.value.param, caught.value.code) == ("best_of", "invalid_value")
    accepted = {"model": "m", "prompt": "x", "best_of": 2, "n": 2, "stream": True}
    assert parse_completion_request({**accepted, "stream_options": {"include_obfuscation": False}}, {}).stream


USAGE = BackendUsage(prompt_tokens=40, completion_tokens=5, cached_tokens=32)


def meta(kind="chat"):
    request = ChatRequest(model="m", messages=[], params=SamplingParams(), kind=kind, request_id="abc")
    return ResponseMeta(request, "fp_test")


def test_usage_reports_cached_tokens():
    body = usage_body(USAGE)
    assert body["prompt_tokens"] == 40 and body["total_tokens"] == 45
    assert body["prompt_tokens_details"]["cached_tokens"] == 32
    assert body["prompt_tokens_details"]["cache_write_tokens"] == 0


def test_chat_usage_reports_cache_writes_as_the_other_faces_do():
    """A fresh-user trial: an Anthropic upstream's 1,439 written tokens (and OpenAI's ``cache_write_tokens``)
    were in the Responses and Messages usage but not in Chat Completions', so a cost computed from it missed the
    write premium."""
    import openai.types.completion_usage as openai_usage

    written = BackendUsage(
        prompt_tokens=2000, completion_tokens=5, cached_tokens=512, cache_creation_tokens=1439
    )
    body = usage_body(written)
    assert body["prompt_tokens_details"] == {
        "cached_tokens": 512,
        "cache_write_tokens": 1439,
        "audio_tokens": 0,
    }
    parsed = openai_usage.CompletionUsage.model_validate(body)
    assert parsed.prompt_tokens_details.cache_write_tokens == 1439


def test_chat_completion_body_shape():
    body = chat_completion_body(meta(), "hello", [], Finish("stop", USAGE))
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hello", "refusal": None, "annotations": []},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def recorded_chunks(name: str) -> list[dict]:
    """The JSON chunks of a recorded OpenAI stream (without ``[DONE]``)."""
    return [e.json() for e in parse_sse(fixture_bytes("openai", name)) if e.data != "[DONE]"]


def test_tool_call_fragments_merge_like_the_sdk():
    events = recorded_chunks("f82268f2fefd.sse")
    calls: dict = {}
    for chunk in events:
        for choice in chunk["choices"]:
            merge_tool_call_deltas(calls, choice["delta"].get("tool_calls") or [])
    merged = [calls[i] for i in sorted(calls)]
    assert len(merged) == 2
    assert (
        merged[0]["id"] == "call_JMW1whyEaYG438VE1OIflxA2"
        and merged[0]["function"]["name"] == "GetWeatherArgs"
    )
    assert json.loads(merged[0]["function"]["arguments"])["city"] == "Edinburgh"
    body = chat_completion_body(meta(), "", merged, Finish("tool_calls", USAGE))
    assert (
        body["choices"][0]["message"]["content"] is None
        and body["choices"][0]["message"]["tool_calls"] == merged
    )


def test_chunks_have_the_recorded_streams_key_layout():
    recorded = recorded_chunks("2018feb66ae1.sse")
    ours = chat_chunk(meta(), {"content": "x"})
    assert list(ours) == list(recorded[1])
    assert list(ours["choices"][0]) == list(recorded[1]["choices"][0])
    final = chat_chunk(meta(), {}, "stop")
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "stop"
    usage = usage_chunk(meta(), "chat.completion.chunk", USAGE)
    assert list(usage)[:6] == list(recorded[-1])[:6] and usage["choices"] == []
    assert set(recorded[-1]["usage"]) <= set(usage["usage"])


def test_completion_body_shape():
    body = completion_body(meta("completion"), ["text"], Finish("length", USAGE))
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["choices"] == [{"text": "text", "index": 0, "logprobs": None, "finish_reason": "length"}]


def test_sampling_fields_reach_the_engine_parameters():
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "seed": (1 << 63) - 1,
        "logprobs": True,
        "top_logprobs": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"42": -100, "7": 3.5},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}},
        },
    }
    params = parse_chat_request(body, {}).params
    assert (params.n, params.seed, params.logprobs) == (3, (1 << 63) - 1, 2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.logit_bias == ((42, -100.0), (7, 3.5))
    assert (params.constraint.kind, params.constraint.json_schema) == ("json_schema", {"type": "object"})
    assert parse_chat_request(
        {**body, "response_format": {"type": "json_object"}}, {}
    ).params.constraint.kind == ("json_object")
    assert parse_chat_request({"model": "m", "messages": MESSAGES, "logprobs": True}, {}).params.logprobs == 0
    completion = parse_completion_request({"model": "m", "prompt": "a", "logprobs": 3, "n": 2}, {}).params
    assert (completion.logprobs, completion.n, completion.constraint) == (3, 2, None)


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        (
            [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "nope", "content": "42"}],
            "messages[1].role",
            "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with "
            "'tool_calls'.",
        ),
        (
            [{"role": "tool", "tool_call_id": "c1", "content": "42"}],
            "messages[0].role",
            "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with "
            "'tool_calls'.",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                {"role": "tool", "tool_call_id": "nope", "content": "43"},
            ],
            "messages[3].tool_call_id",
            "Invalid parameter: 'tool_call_id' of 'nope' not found in 'tool_calls' of previous message.",
        ),
        (  # a user turn in between closes the assistant's calls
            [
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "messages[1].role",
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
            "'tool_call_id'. The following tool_call_ids did not have response messages: c1",
        ),
    ],
)
def test_a_tool_message_must_answer_a_preceding_call(messages, param, message):
    """Before: a lone tool message with an unknown tool_call_id was served (200 and a generation)."""
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": messages}, {})
    assert (info.value.status_code, info.value.param, info.value.message) == (400, param, message)


def test_parallel_tool_results_answer_their_calls():
    second = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "user", "content": "and?"},
    ]
    assert parse_chat_request({"model": "m", "messages": messages}, {}).messages == messages


@pytest.mark.parametrize(
    ("name", "code", "message"),
    [
        (
            "bad name!",
            "invalid_value",
            "Invalid 'tools[0].function.name': string does not match pattern. Expected a string that matches "
            "the pattern '^[a-zA-Z0-9_-]+$'.",
        ),
        ("a.b", "invalid_value", None),
        (
            "x" * 65,
            "string_above_max_length",
            "Invalid 'tools[0].function.name': string too long. Expected a string with maximum length 64, but "
            "got a string with length 65 instead.",
        ),
    ],
)
def test_function_names_follow_openai_pattern(name, code, message):
    """Before: "bad name!" was accepted."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    with pytest.raises(InvalidRequestError) as info:
        chat(tools=tools)
    assert (info.value.param, info.value.code) == ("tools[0].function.name", code)
    if message is not None:
        assert info.value.message == message
    ok = [{"type": "function", "function": {"name": "get-weather_2" + "x" * 51}}]
    assert chat(tools=ok).tools == ok  # 64 characters, every allowed kind


@pytest.mark.parametrize(
    ("tool_calls", "param", "code"),
    [
        ({}, "messages[1].tool_calls", "invalid_type"),  # before: "Missing required parameter: content"
        (["x"], "messages[1].tool_calls[0]", "invalid_type"),
        (
            [{"id": "c1", "type": "function"}],
            "messages[1].tool_calls[0].function",
            "missing_required_parameter",
        ),
        ([{**CALL, "id": None}], "messages[1].tool_calls[0].id", "missing_required_parameter"),
        ([{**CALL, "id": 7}], "messages[1].tool_calls[0].id", "invalid_type"),
        ([{**CALL, "type": "code"}], "messages[1].tool_calls[0].type", "invalid_value"),
        ([{**CALL, "function": "f"}], "messages[1].tool_calls[0].function", "invalid_type"),
        (
            [{**CALL, "function": {"arguments": "{}"}}],
            "messages[1].tool_calls[0].function.name",
            "missing_required_parameter",
        ),
        (
            [{**CALL, "function": {"name": "f"}}],
            "messages[1].tool_calls[0].function.arguments",
            "missing_required_parameter",
        ),
        (
            [{**CALL, "function": {"name": "f", "arguments": {}}}],
            "messages[1].tool_calls[0].function.arguments",
            "invalid_type",
        ),
    ],
)
def test_an_ill_formed_assistant_tool_call_is_named_by_its_path(tool_calls, param, code):
    """Before: a non-array ``tool_calls`` was reported as a missing ``content``, and a call without a function
    name or with non-string arguments reached the engine, whose error named only ``messages``."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": tool_calls}]
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request({"model": "m", "messages": messages}, {})
    assert (caught.value.param, caught.value.code) == (param, code)
    assert param in caught.value.message


def test_a_well_formed_tool_call_round_trip_parses():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert parse_chat_request({"model": "m", "messages": messages}, {}).messages[1]["tool_calls"] == [CALL]


@pytest.mark.parametrize(
    ("messages", "param", "unanswered"),
    [
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "user", "content": "next"},
            ],
            "messages[2].role",
            "c1",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "c2"}]},
                {"role": "tool", "tool_call_id": "c2", "content": "42"},
                {"role": "assistant", "content": "done"},
            ],
            "messages[3].role",
            "c1",
        ),
    ],
)
def test_every_call_is_answered_before_the_next_other_message(messages, param, unanswered):
    """Before: an assistant turn's calls with no tool message answering them were served (OpenAI answers 400)."""
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": messages}, {})
    assert (info.value.status_code, info.value.param) == (400, param)
    assert info.value.message.endswith(f"did not have response messages: {unanswered}")


def test_a_trailing_unanswered_call_turn_is_left_alone():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ]
    assert len(parse_chat_request({"model": "m", "messages": messages}, {}).messages) == 2


def test_a_responses_cut_marks_only_its_last_item_incomplete():
    """A fresh-user trial: every function_call item was ``incomplete`` when ``max_output_tokens`` cut the output,
    though the calls before the cut were delivered whole (docs/tools.md)."""
    from gateway.core.events import Finish
    from gateway.protocols.openai.response_builder import ResponseBuilder

    stream = ResponseBuilder({"model": "m", "input": "x"}, "m", "abc")
    calls = [
        {"index": 0, "id": "c0", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"index": 1, "id": "c1", "function": {"name": "f", "arguments": '{"a": '}},
    ]
    stream.tool_calls(calls)
    stream.finish(Finish(finish_reason="length", usage=USAGE))
    assert [item["status"] for item in stream.output] == ["completed", "incomplete"]


def test_an_empty_tools_array_is_refused_on_chat_and_dropped_on_responses():
    """OpenAI's Chat Completions refuses ``tools: []``; the Responses API takes it (agent SDKs send one)."""
    chat = responses_to_chat_body({"model": "m", "input": "hi", "tools": []})
    assert "tools" not in chat
    assert parse_chat_request(chat, {}).openai_body.get("tools") is None
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request({"model": "m", "messages": MESSAGES, "tools": []}, {})
    assert (caught.value.param, caught.value.code) == ("tools", "empty_array")


def test_responses_output_items_stream_one_after_another():
    """A fresh-user trial: text then a call (Claude's usual answer), and interleaved parallel calls, left the
    message item open while the call's item was added and every ``*.done`` came at the end. Each item is now
    done before the next is added, with its events in order and sequence numbers rising."""
    from gateway.core.events import Finish
    from gateway.protocols.openai.response_builder import ResponseBuilder

    stream = ResponseBuilder({"model": "m", "input": "x"}, "m", "abc")
    events = stream.start() + stream.text("Let me check.")
    events += stream.tool_calls([{"index": 0, "id": "c0", "function": {"name": "f", "arguments": '{"a": '}}])
    events += stream.tool_calls([{"index": 1, "id": "c1", "function": {"name": "g", "arguments": '{"b": '}}])
    events += stream.tool_calls([{"index": 0, "function": {"arguments": "1}"}}])
    events += stream.tool_calls([{"index": 1, "function": {"arguments": "2}"}}])
    events += stream.finish(Finish(finish_reason="tool_calls", usage=USAGE))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    open_items: list[int] = []
    done: set[int] = set()
    arguments: dict[int, str] = {}
    for event in events:
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert not open_items and index == len(done)  # the one before is done
            open_items.append(index)
        elif event["type"] == "response.output_item.done":
            assert open_items == [index]
            open_items.pop()
            done.add(index)
        elif index is not None:
            assert open_items == [index]  # every event of an item between its added and its done
            if event["type"] == "response.function_call_arguments.delta":
                arguments[index] = arguments.get(index, "") + event["delta"]
    assert arguments == {1: '{"a": 1}', 2: '{"b": 2}'}
    assert [item["type"] for item in stream.output] == ["message", "function_call", "function_call"]
    assert [item["status"] for item in stream.output] == ["completed"] * 3
