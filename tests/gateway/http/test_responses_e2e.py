"""``POST /v1/responses`` (stateless OpenAI Responses API) through the real server with the official SDK:
text and item inputs, instructions, streaming events in OpenAI's order, cached tokens in usage, the chat
path's prefix cache, clear refusals of stateful fields; no block left in use."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.gateway.conftest import TINY_MODEL
from tests.gateway.http.test_protocol_exact_e2e import assert_no_block_in_use, openai_error, post_raw

LONG = "You are a careful assistant for a bakery. " * 6


def test_text_input_gives_a_completed_response(server, client):
    response = client.responses.create(model=TINY_MODEL, input="Say hi", max_output_tokens=4)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.output_text == response.output[0].content[0].text
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 4
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert_no_block_in_use(server)


def test_instructions_and_items_take_the_chat_path_and_its_prefix_cache(server, client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What do you sell?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bread."}]},
        {"type": "message", "role": "user", "content": "And cakes?"},
    ]
    first = client.responses.create(model=TINY_MODEL, instructions=LONG, input=items, max_output_tokens=2)
    second = client.responses.create(model=TINY_MODEL, instructions=LONG, input=items, max_output_tokens=2)
    assert second.usage.input_tokens == first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    chat = client.chat.completions.create(
        model=TINY_MODEL,
        messages=[
            {"role": "system", "content": LONG},
            {"role": "user", "content": "What do you sell?"},
            {"role": "assistant", "content": "Bread."},
            {"role": "user", "content": "And cakes?"},
        ],
        max_tokens=2,
    )
    assert chat.usage.prompt_tokens == first.usage.input_tokens  # the same prompt as the chat request
    assert chat.usage.prompt_tokens_details.cached_tokens == second.usage.input_tokens_details.cached_tokens
    assert_no_block_in_use(server)


def test_streamed_events_come_in_openai_order(server, client):
    # greedy: a sampled first token can be EOS (it happened in one make test run of session 14), ending the reply with no
    # output item at all, so the order of the item events could not be checked
    with client.responses.stream(
        model=TINY_MODEL, input="Tell me a story", max_output_tokens=6, temperature=0
    ) as stream:
        events = list(stream)
    # A max_output_tokens cut ends with response.incomplete, as OpenAI sends it; the SDK's
    # get_final_response() only knows response.completed (openai-python PR #3538), so read the last event.
    final = events[-1].response
    if events[-1].type == "response.completed":
        assert stream.get_final_response().output_text == final.output_text
    else:
        assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
    assert final.usage.input_tokens_details.cached_tokens >= 0
    assert_no_block_in_use(server)


def test_create_with_stream_true_yields_the_same_events(server, client):
    events = list(client.responses.create(model=TINY_MODEL, input="Hi", max_output_tokens=3, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens > 0
    assert_no_block_in_use(server)


def test_function_call_items_and_outputs_render_as_a_tool_round_trip(server, client):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    response = client.responses.create(model=TINY_MODEL, input=items, max_output_tokens=2)
    assert response.usage.input_tokens > 0
    assert_no_block_in_use(server)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "custom", "name": "grammar"}]}, "tools[0].type"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ],
)
def test_stateful_and_unsupported_fields_are_refused_clearly(server, client, extra, param):
    body = {"model": TINY_MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    response = post_raw(server, "/v1/responses", json.dumps(body))
    error = openai_error(response, 400, param=param)
    assert error["message"]
    assert_no_block_in_use(server)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": TINY_MODEL}, "missing_required_parameter", "input"),
        ({"model": TINY_MODEL, "input": 5}, "invalid_type", "input"),
        ({"model": TINY_MODEL, "input": []}, "empty_array", "input"),
        (
            {"model": TINY_MODEL, "input": "x", "max_output_tokens": 0},
            "integer_below_min_value",
            "max_output_tokens",
        ),
        ({"model": TINY_MODEL, "input": "x", "frobnicate": 1}, "unknown_parameter", "frobnicate"),
        (
            {"model": TINY_MODEL, "input": [{"role": "robot", "content": "x"}]},
            "invalid_value",
            "input[0].role",
        ),
        ({"model": TINY_MODEL, "input": "x", "tool_choice": "auto"}, None, "tool_choice"),
        ({"input": "x"}, "missing_required_parameter", "model"),
        (  # Before: 200 (OpenAI: the format's name matches ^[a-zA-Z0-9_-]+$)
            {
                "model": TINY_MODEL,
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}},
            },
            "invalid_value",
            "text.format.name",
        ),
        # Before: 200 with the value echoed back as the Response's metadata (OpenAI: string values only)
        ({"model": TINY_MODEL, "input": "x", "metadata": {"a": 5}}, "invalid_type", "metadata.a"),
        ({"model": TINY_MODEL, "input": "x", "metadata": "tag"}, "invalid_type", "metadata"),
        # Before (a fresh-user trial): each of these was a 200, the value echoed or silently ignored
        ({"model": TINY_MODEL, "input": "x", "truncation": "bogus"}, "invalid_value", "truncation"),
        ({"model": TINY_MODEL, "input": "x", "service_tier": "bogus"}, "invalid_value", "service_tier"),
        (
            {"model": TINY_MODEL, "input": "x", "prompt_cache_retention": "1y"},
            "invalid_value",
            "prompt_cache_retention",
        ),
        ({"model": TINY_MODEL, "input": "x", "text": {"frob": 1}}, "unknown_parameter", "text.frob"),
        (
            {"model": TINY_MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "missing_required_parameter",
            "text.format.schema",
        ),
        (
            {"model": TINY_MODEL, "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "missing_required_parameter",
            "text.format.name",
        ),
        ({"model": TINY_MODEL, "input": "x", "include": ["frob"]}, "invalid_value", "include[0]"),
        (
            {"model": TINY_MODEL, "input": "x", "reasoning": {"summary": "long"}},
            "invalid_value",
            "reasoning.summary",
        ),
        (
            {"model": TINY_MODEL, "input": "x", "reasoning": {"frob": 1}},
            "unknown_parameter",
            "reasoning.frob",
        ),
        ({"model": TINY_MODEL, "input": "x", "max_tool_calls": -1}, "invalid_type", "max_tool_calls"),
        (
            {"model": TINY_MODEL, "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
            "object_above_max_properties",
            "metadata",
        ),
        # Before (a fuzzing trial): a 500 (an unhashable role), or a 200 with the value unchecked
        ({"model": TINY_MODEL, "input": [{"role": {}, "content": "x"}]}, "invalid_value", "input[0].role"),
        (
            {"model": TINY_MODEL, "input": "x", "top_logprobs": 1, "include": ["bogus"]},
            "invalid_value",
            "include[0]",
        ),
        ({"model": TINY_MODEL, "input": "x", "top_logprobs": 1, "include": 5}, "invalid_type", "include"),
        ({"model": TINY_MODEL, "input": "x", "store": "yes"}, "invalid_type", "store"),
        ({"model": TINY_MODEL, "input": "x", "background": 0}, "invalid_type", "background"),
        ({"model": TINY_MODEL, "input": "x", "stream_options": 5}, "invalid_type", "stream_options"),
        (
            {"model": TINY_MODEL, "input": "x", "parallel_tool_calls": "x"},
            "invalid_type",
            "parallel_tool_calls",
        ),
        ({"model": TINY_MODEL, "input": "x", "image": 1}, "invalid_type", "image"),
        ({"model": TINY_MODEL, "input": "x", "background_options": 3}, "invalid_type", "background_options"),
        # client_metadata (the OpenAI Codex CLI's; before: unknown_parameter): an object of string values
        ({"model": TINY_MODEL, "input": "x", "client_metadata": "t"}, "invalid_type", "client_metadata"),
        (
            {"model": TINY_MODEL, "input": "x", "client_metadata": {"a": 1}},
            "invalid_type",
            "client_metadata.a",
        ),
        (
            {"model": TINY_MODEL, "input": [{"type": "reasoning", "summary": "s"}, "x"]},
            "invalid_type",
            "input[0].summary",
        ),
    ],
)
def test_bad_bodies_get_openai_errors(server, body, code, param):
    error = openai_error(post_raw(server, "/v1/responses", json.dumps(body)), 400, param=param)
    if code is not None:
        assert error["code"] == code
    assert_no_block_in_use(server)


def test_store_false_is_accepted_and_store_is_reported_false(server, client):
    response = client.responses.create(model=TINY_MODEL, input="hi", max_output_tokens=2, store=False)
    assert response.store is False
    assert_no_block_in_use(server)


def test_accepted_fields_are_echoed_in_the_response(server, client):
    """A fresh-user trial: ``max_tool_calls``, ``top_logprobs`` and ``reasoning.summary`` were accepted and echoed
    as null. ``max_tool_calls`` bounds built-in tool calls (none here) and ``reasoning.summary`` summarises
    reasoning items (none here): both hold vacuously and are echoed as sent."""
    response = client.responses.create(
        model=TINY_MODEL,
        input="hi",
        max_output_tokens=2,
        max_tool_calls=1,
        top_logprobs=2,
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        truncation="auto",
        service_tier="flex",
        prompt_cache_retention="24h",
    )
    assert (response.max_tool_calls, response.top_logprobs, response.reasoning.summary) == (1, 2, "auto")
    assert response.prompt_cache_retention == "24h"  # a protocol trial: accepted, not echoed
    # the tier that served it, as the chat face reports (a protocol trial: the requested "flex" was echoed)
    assert (response.truncation, response.service_tier) == ("auto", "default")
    assert_no_block_in_use(server)


def test_metadata_is_echoed_in_the_response(server, client):
    metadata = {"run": "nightly", "team": "x" * 512}
    response = client.responses.create(model=TINY_MODEL, input="hi", max_output_tokens=2, metadata=metadata)
    assert response.metadata == metadata
    assert_no_block_in_use(server)


def test_logprobs_asked_by_include_come_back_as_the_chat_path_computes_them(server, client):
    # Before: [] (the engine computed them for top_logprobs, the Response dropped them)
    kwargs = {"model": TINY_MODEL, "max_output_tokens": 5, "temperature": 0}
    for _ in range(2):  # the second is served the prompt's cached blocks, as every request below is
        chat = client.chat.completions.create(
            model=TINY_MODEL,
            messages=[{"role": "user", "content": "Count to five"}],
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert len(expected) == chat.usage.completion_tokens and all(
        len(e["top_logprobs"]) == 2 for e in expected
    )
    response = client.responses.create(
        input="Count to five", include=["message.output_text.logprobs"], top_logprobs=2, **kwargs
    )
    assert [entry.model_dump() for entry in response.output[0].content[0].logprobs] == expected
    with client.responses.stream(
        input="Count to five", include=["message.output_text.logprobs"], top_logprobs=2, **kwargs
    ) as stream:
        done = [event for event in stream if event.type == "response.output_text.done"]
    assert [entry.model_dump() for entry in done[0].logprobs] == expected
    only_include = (
        client.responses.create(input="Count to five", include=["message.output_text.logprobs"], **kwargs)
        .output[0]
        .content[0]
        .logprobs
    )
    assert [(e.token, e.logprob, e.top_logprobs) for e in only_include] == [
        (e["token"], e["logprob"], []) for e in expected
    ]
    plain = client.responses.create(input="Count to five", **kwargs)
    assert plain.output[0].content[0].logprobs == []
    assert_no_block_in_use(server)


@pytest.mark.parametrize(("include", "param"), [("logprobs", "include"), ([5], "include[0]")])
def test_include_must_be_an_array_of_strings(server, include, param):
    body = {"model": TINY_MODEL, "input": "x", "include": include}
    openai_error(post_raw(server, "/v1/responses", json.dumps(body)), 400, code="invalid_type", param=param)


def test_a_surrogate_in_a_responses_body_is_a_400(server):
    response = httpx.post(
        server.base_url + "/v1/responses",
        content='{"model": "tiny", "input": "\\ud800"}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    openai_error(response, 400, code="invalid_unicode", param="input")
    assert_no_block_in_use(server)


def test_text_format_json_object_is_honoured_like_chat(server, client):
    """``text.format`` becomes chat's ``response_format``: the embedded engine constrains the output to JSON."""
    response = client.responses.create(
        model=TINY_MODEL, input="hi", text={"format": {"type": "json_object"}}, max_output_tokens=64
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    assert_no_block_in_use(server)


def test_unsupported_format_is_refused(server):
    body = {"model": TINY_MODEL, "input": "hi", "text": {"format": {"type": "xml"}}}
    error = openai_error(post_raw(server, "/v1/responses", json.dumps(body)), 400)
    assert error["param"] in ("text.format", "text.format.type", "response_format")
    assert_no_block_in_use(server)


def test_the_sdk_raises_on_a_refused_request(server, client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=TINY_MODEL, input="hi", previous_response_id="resp_1")
    assert_no_block_in_use(server)


def test_function_tools_are_passed_to_the_backend_as_chat_tools(server, client):
    tools = [
        {
            "type": "function",
            "name": "weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    with_tools = client.responses.create(model=TINY_MODEL, input="hi", tools=tools, max_output_tokens=2)
    chat = client.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}],
        max_tokens=2,
    )
    assert with_tools.usage.input_tokens == chat.usage.prompt_tokens
    assert with_tools.tools[0].name == "weather"
    assert_no_block_in_use(server)


CALL_ITEM = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"}
WEATHER_TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"max_output_tokens": "5"}, "max_output_tokens", "'max_output_tokens'"),
        ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens'"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "'reasoning.effort'"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": 5}]},
            "tools[0].parameters",
            "tools[0].parameters",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input[0].content[0].type",
            "input[0].content[0]:",
        ),
        (
            {"text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
            "'text.format.name'",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
            "text.format.schema",
            "text.format.schema",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
            "'text.format'",
        ),
        ({"instructions": "x", "input": "the quick brown fox jumps over the lazy dog " * 200}, "input", None),
        (
            {"input": [{"role": "user", "content": "hi"}, {**CALL_ITEM, "call_id": 5}]},
            "input[1].call_id",
            "'input[1].call_id'",
        ),
    ],
)
def test_errors_name_the_responses_fields_not_the_chat_ones(server, fields, param, named):
    """Before: the chat path's names leaked out (``max_completion_tokens``, ``reasoning_effort``,
    ``tools[0].function.parameters``, ``messages[0].content[0]``, ``response_format.json_schema.name``), for fields
    the client never sent."""
    body = {"model": TINY_MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    error = openai_error(post_raw(server, "/v1/responses", json.dumps(body)), 400, param=param)
    for chat_name in (
        "max_completion_tokens",
        "reasoning_effort",
        "response_format",
        "function.",
        "messages[",
    ):
        assert chat_name not in error["message"], error["message"]
    if named is not None:
        assert named in error["message"]
    assert_no_block_in_use(server)


def test_a_function_call_item_cut_by_max_output_tokens_is_served_back(server):
    """A ``function_call`` item whose arguments were cut by ``max_output_tokens`` (not valid JSON, status
    ``incomplete``) resent with its output is served, as on the chat face (before: 400 naming
    ``input[1].arguments``): the engine renders the cut text verbatim (docs/tools.md, "A cut call sent back")."""
    body = {
        "model": TINY_MODEL,
        "max_output_tokens": 2,
        "tools": [WEATHER_TOOL],
        "input": [
            {"role": "user", "content": "hi"},
            {**CALL_ITEM, "arguments": '{"city": "Par'},
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
        ],
    }
    answer = post_raw(server, "/v1/responses", json.dumps(body))
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] in ("completed", "incomplete")
    assert_no_block_in_use(server)


@pytest.mark.parametrize(
    "items",
    [
        [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}],
        [
            {"role": "user", "content": "hi"},
            CALL_ITEM,
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
            {"role": "user", "content": "and now?"},
            {"type": "function_call_output", "call_id": "c1", "output": "again"},
        ],
    ],
)
def test_an_output_without_its_call_names_the_output_item(server, items):
    """Before: "messages with role 'tool' must be a response to a preceeding message with 'tool_calls'", param
    ``messages[1].role``: chat words for a body that has neither."""
    body = {"model": TINY_MODEL, "input": items, "tools": [WEATHER_TOOL], "max_output_tokens": 2}
    error = openai_error(
        post_raw(server, "/v1/responses", json.dumps(body)), 400, param=f"input[{len(items) - 1}].call_id"
    )
    assert error["message"].startswith("No tool call found for function call output with call_id")
    assert "role 'tool'" not in error["message"]
    assert_no_block_in_use(server)


def test_a_function_call_round_trip_still_takes_the_chat_path(server, client):
    items = [
        {"role": "user", "content": "weather?"},
        CALL_ITEM,
        {**CALL_ITEM, "call_id": "c2", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c2", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c1", "output": "rainy"},
    ]
    response = client.responses.create(
        model=TINY_MODEL, input=items, tools=[WEATHER_TOOL], max_output_tokens=2
    )
    assert response.usage.input_tokens > 0
    assert_no_block_in_use(server)


@pytest.mark.parametrize(
    ("items", "param"),
    [
        (
            [{"role": "user", "content": "hi"}, CALL_ITEM, {"role": "user", "content": "and?"}],
            "input[1].call_id",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                CALL_ITEM,
                {**CALL_ITEM, "call_id": "c2"},
                {"type": "function_call_output", "call_id": "c2", "output": "x"},
                {**CALL_ITEM, "call_id": "c3"},
            ],
            "input[1].call_id",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                CALL_ITEM,
                {"role": "assistant", "content": "thinking aloud"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
            ],
            "input[1].call_id",
        ),
    ],
)
def test_a_function_call_without_its_output_names_the_call_item(server, items, param):
    """Before: 200 (the chat path took an unanswered call turn; OpenAI answers "No tool output found for
    function call ...")."""
    body = {"model": TINY_MODEL, "input": items, "tools": [WEATHER_TOOL], "max_output_tokens": 2}
    error = openai_error(post_raw(server, "/v1/responses", json.dumps(body)), 400, param=param)
    assert error["message"].startswith("No tool output found for function call c1")
    assert_no_block_in_use(server)


CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Run a command", "parameters": {"type": "object"}},
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Sub-agents",
        "tools": [
            {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}, "strict": False},
            {"type": "function", "name": "wait", "description": "Wait for an agent", "parameters": {}},
        ],
    },
    {"type": "web_search", "external_web_access": False},
]
CODEX_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Run ls."}], "encrypted_content": "gAAA"},
    {
        "type": "function_call",
        "call_id": "call_1",
        "name": "spawn_agent",
        "namespace": "multi_agent_v1",
        "arguments": '{"task": "ls"}',
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
    {"type": "reasoning", "id": "rs_2", "summary": [], "content": None, "encrypted_content": "gAAB"},
]  # fmt: skip
CODEX_FIELDS = {
    "instructions": "You are Codex.",
    "input": CODEX_INPUT,
    "tools": CODEX_TOOLS,
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"summary": "auto", "effort": "low"},  # an effort hint: met as it is (before: a 400)
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199a0f0-thread",
    "max_output_tokens": 3,
}  # Codex adds text.verbosity for the gpt-5 family only: the embedded engine refuses it (it cannot honour it)
CODEX_METADATA = {"x-codex-installation-id": "inst-1", "thread_id": "t"}


@pytest.mark.parametrize("stream", [False, True])
def test_codex_default_request_is_served(server, client, stream):
    """The OpenAI Codex CLI 0.171's default request: before, a 400 for each of ``client_metadata`` (unknown), the
    ``namespace`` and ``web_search`` tools and the ``reasoning`` input items. Now a 200 the SDK parses: the
    namespace's functions are the model's (flat names), the hosted tool is dropped, reasoning items too."""
    if stream:
        events = list(
            client.responses.create(
                model=TINY_MODEL, stream=True, extra_body={"client_metadata": CODEX_METADATA}, **CODEX_FIELDS
            )
        )
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        response = events[-1].response
    else:
        response = client.responses.create(
            model=TINY_MODEL, extra_body={"client_metadata": CODEX_METADATA}, **CODEX_FIELDS
        )
    assert response.status in ("completed", "incomplete")
    assert response.store is False and response.prompt_cache_key == CODEX_FIELDS["prompt_cache_key"]
    assert response.usage.input_tokens > 0
    assert [tool.type for tool in response.tools] == ["function", "namespace", "web_search"]  # echoed as sent
    # the SDK builds its objects leniently: validate the raw JSON strictly against its types too
    body = {"model": TINY_MODEL, "client_metadata": CODEX_METADATA, "stream": stream, **CODEX_FIELDS}
    raw = post_raw(server, "/v1/responses", json.dumps(body))
    assert raw.status_code == 200, raw.text
    if stream:
        datas = [line[len("data: ") :] for line in raw.text.splitlines() if line.startswith("data: ")]
        events = [TypeAdapter(ResponseStreamEvent).validate_json(data) for data in datas]
        assert events[-1].type in ("response.completed", "response.incomplete")
    else:
        assert Response.model_validate(raw.json()).status in ("completed", "incomplete")
    assert_no_block_in_use(server)


def test_codex_request_prompts_like_the_flattened_chat_request(server, client):
    """The namespace's functions reach the model as ``<namespace>__<name>`` chat tools (a ``function_call`` item
    with a ``namespace`` names the same), the hosted tool and the reasoning items are not in the prompt."""
    response = client.responses.create(
        model=TINY_MODEL, extra_body={"client_metadata": CODEX_METADATA}, **CODEX_FIELDS
    )
    chat = client.chat.completions.create(
        model=TINY_MODEL,
        messages=[
            {"role": "system", "content": "You are Codex."},
            {"role": "developer", "content": "Sandbox: read-only."},
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"task": "ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "shell",
                    "description": "Run a command",
                    "parameters": {"type": "object"},
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "multi_agent_v1__spawn_agent",
                    "parameters": {"type": "object"},
                    "strict": False,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "multi_agent_v1__wait",
                    "description": "Wait for an agent",
                    "parameters": {},
                },
            },
        ],
        max_tokens=1,
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert_no_block_in_use(server)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [{"type": "web_search_preview"}]}, "tool_choice.type"),
        ({"tool_choice": {"type": "file_search"}, "tools": CODEX_TOOLS}, "tool_choice.type"),
        ({"tool_choice": {"type": "mcp", "server_label": "x"}, "tools": CODEX_TOOLS}, "tool_choice.type"),
        ({"tool_choice": "required", "tools": [{"type": "web_search"}]}, "tool_choice"),
    ],
)  # fmt: skip
def test_a_tool_choice_forcing_a_dropped_hosted_tool_is_a_400(server, fields, param):
    body = {"model": TINY_MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    error = openai_error(post_raw(server, "/v1/responses", json.dumps(body)), 400, param=param)
    assert error["code"] == "unsupported_parameter"
    assert "hosted tool" in error["message"]
    assert_no_block_in_use(server)


def test_hosted_tools_alone_with_tool_choice_auto_are_dropped(server, client):
    response = client.responses.create(
        model=TINY_MODEL,
        input="hi",
        tools=[{"type": "web_search"}],
        tool_choice="auto",
        parallel_tool_calls=False,
        max_output_tokens=2,
    )
    plain = client.responses.create(model=TINY_MODEL, input="hi", max_output_tokens=2)
    assert response.usage.input_tokens == plain.usage.input_tokens  # no tool reached the prompt
    assert_no_block_in_use(server)


def test_an_error_in_a_namespace_function_names_its_own_path(server):
    """Chat ``tools[k]`` is the k-th function after flattening: the error names the client's nested tool."""
    tools = [
        {"type": "web_search"},
        {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "f", "parameters": 5}]},
    ]  # fmt: skip
    body = {"model": TINY_MODEL, "input": "hi", "max_output_tokens": 2, "tools": tools}
    error = openai_error(
        post_raw(server, "/v1/responses", json.dumps(body)), 400, param="tools[1].tools[0].parameters"
    )
    assert "function." not in error["message"] and "tools[1].tools[0].parameters" in error["message"]
    assert_no_block_in_use(server)


def test_truncation_auto_drops_the_oldest_items_until_the_prompt_fits(server, client):
    """A protocol trial: ``truncation: "auto"`` was accepted and echoed but a prompt over the context was a 400,
    as with ``"disabled"``. The oldest input items now go (a call with its output), instructions and the newest
    item stay, until the prompt fits the tiny model's 512 tokens."""
    old = "an old note about the catalogue " * 40  # ~200 tokens of the tiny tokenizer each
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "first: " + old},
        {"role": "assistant", "content": "noted"},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "second: " + old},
        {"role": "user", "content": "third: " + old},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is in stock?"},
    ]
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]
    fields = {"model": TINY_MODEL, "input": items, "tools": tools, "max_output_tokens": 8}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**fields)  # truncation "disabled", the default
    assert refused.value.body["code"] == "context_length_exceeded"
    response = client.responses.create(**fields, truncation="auto")
    assert response.status in ("completed", "incomplete") and response.truncation == "auto"
    assert 0 < response.usage.input_tokens <= 512 - 8
    whole = client.responses.create(**{**fields, "input": [items[0], items[-1]]})
    assert response.usage.input_tokens > whole.usage.input_tokens  # not everything was dropped
    # a newest item that alone does not fit: nothing left to drop, the 400 stands
    with pytest.raises(openai.BadRequestError) as still:
        client.responses.create(
            **{**fields, "input": [items[0], {"role": "user", "content": old * 4}]}, truncation="auto"
        )
    assert still.value.body["code"] == "context_length_exceeded"
    assert (
        'truncation "auto" left out the 1 oldest input items' not in still.value.body["message"]
    )  # none went
    with pytest.raises(openai.BadRequestError) as text_input:  # a string input: nothing to drop
        client.responses.create(**{**fields, "input": old * 4}, truncation="auto")
    assert text_input.value.body["code"] == "context_length_exceeded"
    agent = [items[0], {"role": "user", "content": "first: " + old}, {"role": "user", "content": old * 4}]
    with pytest.raises(openai.BadRequestError) as after_dropping:
        client.responses.create(**{**fields, "input": agent}, truncation="auto")
    assert 'truncation "auto" left out the 1 oldest input items' in after_dropping.value.body["message"]
    assert_no_block_in_use(server)
