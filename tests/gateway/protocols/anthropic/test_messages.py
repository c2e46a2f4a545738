"""The Anthropic Messages face: validation, translation both ways, SSE/JSON formatting
(gateway.protocols.anthropic.validate).

End-to-end tests with the official SDKs through the real gateway are in test_upstream_e2e.py.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest

from gateway.core.errors import APIError, InvalidRequestError, anthropic_error_body
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.http.anthropic import message_sse
from gateway.protocols.anthropic.parse import parse_messages_body
from gateway.protocols.anthropic.prompt import (
    UnsupportedContentError,
    openai_to_anthropic,
    openai_to_anthropic_tool_choice,
)
from gateway.protocols.anthropic.render import NativeDelta, anthropic_usage, build_message
from gateway.protocols.anthropic.stream import StreamFormatter
from gateway.service.pipeline import OpenedStream
from gateway.transport.failures import UpstreamCallError
from gateway.transport.sse import parse_sse
from tests.gateway.upstream_helpers import fixture_bytes

RICH_BODY = {
    "model": "claude",
    "max_tokens": 300,
    "system": [
        {"type": "text", "text": "You are helpful."},
        {"type": "text", "text": "Long rules.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "<document>Doc</document> What is it?",
                    "cache_control": {"type": "ephemeral"},
                },
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                },
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "c2ln"},
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "t1",
                    "name": "search",
                    "input": {"q": "x", "n": 2},
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "tool_use", "id": "t2", "name": "search", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "found"}],
                    "is_error": False,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "tool_result", "tool_use_id": "t2", "content": "nothing", "is_error": True},
                {"type": "text", "text": "And now?"},
            ],
        },
        {"role": "assistant", "content": "plain answer"},
        {"role": "user", "content": "plain question"},
    ],
    "tools": [
        {
            "name": "search",
            "description": "Search.",
            "input_schema": {"type": "object"},
            "strict": True,
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ],
    "tool_choice": {"type": "tool", "name": "search"},
    "temperature": 0.3,
    "top_p": 0.9,
    "top_k": 40,
    "stop_sequences": ["END", "STOP"],
    "stream": True,
    "metadata": {"user_id": "user-42"},
}


# ---- parsing
# ------------------------------------------------------------------------------------------------


def test_parse_builds_the_internal_request():
    request = parse_messages_body(copy.deepcopy(RICH_BODY), request_id="abc")
    assert request.openai_body is None and request.model == "claude" and request.stream
    assert request.anthropic_body == RICH_BODY
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (300, 0.3, 0.9, 40)
    assert params.stop == ("END", "STOP") and request.user == "user-42"
    assert request.tool_choice == {"type": "function", "function": {"name": "search"}}
    assert [m["role"] for m in request.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "user",
        "assistant",
        "user",
    ]
    assert request.messages[3] == {
        "role": "tool",
        "tool_call_id": "t1",
        "content": [{"type": "text", "text": "found"}],
        "is_error": False,
        "cache_control": {"type": "ephemeral"},
    }
    assert request.messages[1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
    }
    assert request.tools[
        0
    ] == {  # ``strict`` also as OpenAI's, for the embedded engine's constrained decoding
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {"type": "object"},
            "strict": True,
        },
        "x-anthropic": {"strict": True, "cache_control": {"type": "ephemeral"}},
    }


def test_defaults_follow_the_messages_api():
    request = parse_messages_body(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert (request.params.temperature, request.params.top_p, request.params.top_k) == (1.0, 1.0, 0)
    assert (
        request.messages == [{"role": "user", "content": "hi"}]
        and request.tools is None
        and not request.stream
    )


def test_round_trip_restores_the_body_exactly():
    request = parse_messages_body(copy.deepcopy(RICH_BODY))
    prompt = openai_to_anthropic(request.messages, request.tools)
    assert prompt.system == RICH_BODY["system"]
    assert prompt.messages == RICH_BODY["messages"]
    assert prompt.tools == RICH_BODY["tools"]


def test_round_trip_of_a_string_system_prompt():
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}],
    }
    request = parse_messages_body(body)
    prompt = openai_to_anthropic(request.messages, request.tools)
    assert (prompt.system, prompt.messages) == ("Be brief.", body["messages"])
    assert prompt.part_blocks == [[("system", 0)], [("messages", 0, 0)]]


def test_part_blocks_map_every_canonical_part():
    request = parse_messages_body(copy.deepcopy(RICH_BODY))
    prompt = openai_to_anthropic(request.messages, request.tools)
    assert prompt.part_blocks[0] == [("system", 0), ("system", 1)]
    assert prompt.part_blocks[1] == [("messages", 0, j) for j in range(4)]
    assert prompt.part_blocks[2] == [("messages", 1, 0), ("messages", 1, 1)]  # tool uses are not parts
    assert prompt.part_blocks[3] == prompt.part_blocks[4] == []  # tool results are single blocks
    assert prompt.part_blocks[5] == [("messages", 2, 2)]  # merged after the two tool results
    assert prompt.last_block[2] == ("messages", 1, 3) and prompt.last_block[4] == ("messages", 2, 1)


def test_empty_text_parts_are_sent_as_no_block_and_hand_their_breakpoint_back():
    # what the default rules leave after hoisting a system block that held only the date
    messages = [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "Be brief."},
                {"type": "text", "text": "", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": ""}]},
        {
            "role": "tool",
            "tool_call_id": "t1",
            "content": [{"type": "text", "text": ""}, {"type": "text", "text": "ok"}],
        },
    ]
    prompt = openai_to_anthropic(messages, None)
    assert prompt.system == [
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ]
    assert prompt.messages == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}]},
            ],
        },
    ]
    assert prompt.part_blocks[:3] == [
        [("system", 0), None],
        [None, ("messages", 0, 0)],
        [("messages", 1, 0), None],
    ]
    assert prompt.last_block[:3] == [("system", 0), ("messages", 0, 0), ("messages", 1, 0)]


def test_a_block_keeps_its_own_breakpoint_and_an_empty_system_prompt_is_none():
    marked = {"type": "ephemeral"}
    messages = [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "A", "cache_control": marked},
                {"type": "text", "text": "", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            ],
        },
        {"role": "user", "content": "hi"},
    ]
    assert openai_to_anthropic(messages, None).system == [
        {"type": "text", "text": "A", "cache_control": marked}
    ]
    assert openai_to_anthropic([{"role": "system", "content": ""}, *messages[1:]], None).system is None


def test_a_later_message_with_nothing_to_send_becomes_no_turn():
    """A trailing system message whose only line (``Current time: ...``) the rules hoisted into the user turn is
    empty; as an Anthropic turn it was ``{"role": "user", "content": []}``, which the Messages API refuses."""
    hoisted = "What time is it?\n\n<request_context>\nCurrent time: 10:00\n</request_context>"
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": [{"type": "text", "text": ""}]},
        {"role": "user", "content": hoisted},
        {"role": "system", "content": ""},
    ]
    prompt = openai_to_anthropic(messages, None)
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]
    assert all(m["content"] for m in prompt.messages)
    assert prompt.last_block[3] == prompt.last_block[2] == ("messages", 1, 0)  # ends where the reply ended
    assert prompt.last_block[5] == prompt.last_block[4] == ("messages", 2, 0)
    assert prompt.part_blocks[3] == [None] and prompt.part_blocks[5] == [None]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (lambda b: b.pop("model"), "model"),
        (lambda b: b.pop("max_tokens"), "max_tokens"),
        (lambda b: b.update(max_tokens=0), "max_tokens"),
        (lambda b: b.update(messages=[]), "messages"),
        (lambda b: b.update(messages="hi"), "messages"),
        (lambda b: b["messages"][0].update(role="robot"), "messages[0].role"),
        (lambda b: b["messages"][0].update(content=5), "messages[0].content"),
        (lambda b: b["messages"][0].update(content=[{"type": "text"}]), "messages[0].content[0].text"),
        (lambda b: b["messages"][0].update(content=[{"text": "x"}]), "messages[0].content[0].type"),
        (
            lambda b: b["messages"][0].update(
                content=[{"type": "tool_use", "id": "1", "name": "n", "input": {}}]
            ),
            "messages[0].content[0]",
        ),
        (
            lambda b: b["messages"][0].update(content=[{"type": "image", "source": {"type": "svg"}}]),
            "messages[0].content[0].source.type",
        ),
        (
            lambda b: b["messages"][0].update(
                content=[{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]
            ),
            "messages[0].content[0].cache_control.ttl",
        ),
        (
            lambda b: b.update(system=[{"type": "image", "source": {"type": "url", "url": "u"}}]),
            "system[0].type",
        ),
        # Before (a fresh-user trial): each was accepted, though the Messages API refuses it
        (lambda b: b.update(system=[{"type": "text", "text": ""}]), "system[0].text"),
        (
            lambda b: b["messages"][0].update(content=[{"type": "text", "text": " \n"}]),
            "messages[0].content[0].text",
        ),
        (lambda b: b.update(metadata={"foo": "x"}), "metadata.foo"),
        (lambda b: b.update(service_tier="gold"), "service_tier"),
        (
            lambda b: b.update(
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "n", "input": {}},
                            {"type": "tool_use", "id": "t1", "name": "n", "input": {}},
                        ],
                    },
                ]
            ),
            "messages[1].content[1].id",
        ),
        (lambda b: b.update(temperature=1.5), "temperature"),
        (lambda b: b.update(top_k=-1), "top_k"),
        (lambda b: b.update(stop_sequences=["ok", ""]), "stop_sequences"),
        (lambda b: b.update(stream="yes"), "stream"),
        (lambda b: b.update(tools=[{"name": "a"}]), "tools[0].input_schema"),
        (
            lambda b: b.update(tools=[{"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]),
            "tools[1].name",
        ),
        (
            lambda b: b.update(
                tool_choice={"type": "tool", "name": "missing"}, tools=[{"name": "a", "input_schema": {}}]
            ),
            "tool_choice.name",
        ),
        (lambda b: b.update(metadata={"user_id": 7}), "metadata.user_id"),
        # before (a protocol trial): accepted, though the Messages API refuses both
        (lambda b: b.update(metadata={"user_id": "u" * 257}), "metadata.user_id"),
        (lambda b: b["messages"].append({"role": "assistant", "content": "The answer: "}), "messages[1]"),
        (
            lambda b: b["messages"].append(
                {"role": "assistant", "content": [{"type": "text", "text": "The answer:\n"}]}
            ),
            "messages[1]",
        ),
        # Before (a fuzzing trial): a 500, an unhashable value tested against a set of strings
        (lambda b: b.update(cache_control={"type": "ephemeral", "ttl": []}), "cache_control.ttl"),
        (
            lambda b: b.update(tool_choice={"type": {"a": 1}}, tools=[{"name": "a", "input_schema": {}}]),
            "tool_choice",
        ),
        # before: accepted (a tool name outside the API's pattern; a tool_result answering no tool_use)
        (lambda b: b.update(tools=[{"name": "bad name!", "input_schema": {}}]), "tools[0].name"),
        (lambda b: b.update(tools=[{"name": "x" * 129, "input_schema": {}}]), "tools[0].name"),
        (
            lambda b: b["messages"][0].update(
                content=[{"type": "tool_result", "tool_use_id": "nope", "content": "42"}]
            ),
            "messages[0].content[0].tool_use_id",
        ),
        (
            lambda b: b["messages"].extend(
                [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t1"},
                            {"type": "tool_result", "tool_use_id": "t0"},
                        ],
                    },
                ]
            ),
            "messages[2].content[1].tool_use_id",
        ),
        (
            lambda b: b["messages"].extend(
                [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                    },
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                ]
            ),
            "messages[3].content[0].tool_use_id",
        ),
        (  # before: served (Anthropic answers 400: every tool_use needs its tool_result in the next message)
            lambda b: b["messages"].extend(
                [
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                            {"type": "tool_use", "id": "t2", "name": "f", "input": {}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t2"},
                            {"type": "text", "text": "go on"},
                        ],
                    },
                ]
            ),
            "messages[1]",
        ),
        # before: served (Anthropic answers 400 for an empty message or text block)
        (lambda b: b["messages"][0].update(content=""), "messages[0]"),
        (lambda b: b["messages"][0].update(content=[]), "messages[0]"),
        (
            lambda b: b["messages"][0].update(
                content=[{"type": "text", "text": ""}, {"type": "text", "text": "x"}]
            ),
            "messages[0].content[0].text",
        ),
        (
            lambda b: b["messages"].extend(
                [{"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]
            ),
            "messages[1]",
        ),
    ],
)
def test_bad_bodies_name_the_field(change, param):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    change(body)
    with pytest.raises(InvalidRequestError) as info:
        parse_messages_body(body)
    assert info.value.param == param and info.value.status_code == 400
    assert anthropic_error_body(info.value)["error"]["type"] == "invalid_request_error"


def test_a_tool_without_input_schema_is_told_the_field_is_required():
    """Before (a tools trial): 'expected a JSON schema object, got null' for a field the client never sent."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "a"}],
    }
    with pytest.raises(InvalidRequestError) as info:
        parse_messages_body(body)
    assert info.value.param == "tools[0].input_schema" and "Field required" in str(info.value)


@pytest.mark.parametrize("content", ["", []])
def test_only_a_final_assistant_message_may_be_empty(content):
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}],
    }
    assert [m["role"] for m in parse_messages_body(body).messages] == ["user", "assistant"]
    body["messages"][0]["content"] = content
    with pytest.raises(InvalidRequestError) as info:
        parse_messages_body(body)
    assert info.value.message == (
        "messages[0]: all messages must have non-empty content except for the optional final assistant message"
    )


def test_a_prefill_may_end_in_anything_but_whitespace():
    body = {"model": "m", "max_tokens": 5, "metadata": {"user_id": "u" * 256}}
    for prefill in ("The answer:", [{"type": "text", "text": "The answer: 4"}], ""):
        body["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": prefill}]
        assert [m["role"] for m in parse_messages_body(body).messages] == ["user", "assistant"]
    body["messages"][-1]["content"] = "The answer: "
    with pytest.raises(
        InvalidRequestError, match="final assistant content cannot end with trailing whitespace"
    ):
        parse_messages_body(body)


def test_non_object_body():
    with pytest.raises(InvalidRequestError):
        parse_messages_body(["not", "an", "object"])


# ---- OpenAI-shaped messages to Anthropic
# ---------------------------------------------------------------------


def test_openai_messages_translate_to_anthropic():
    messages = [
        {"role": "system", "content": "Sys A"},
        {"role": "developer", "content": [{"type": "text", "text": "Sys B"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/"}},
            ],
        },
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "system", "content": "Current time: 09:45"},
        {"role": "user", "content": "next"},
    ]
    prompt = openai_to_anthropic(messages, None)
    assert prompt.system == [{"type": "text", "text": "Sys A"}, {"type": "text", "text": "Sys B"}]
    assert prompt.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "c2", "name": "f", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "r1"},
                {"type": "tool_result", "tool_use_id": "c2", "content": "r2"},
                {"type": "text", "text": "Current time: 09:45"},
            ],
        },  # joins the results' turn
        {"role": "user", "content": "next"},
    ]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}],
            },
            "messages[0].content[0].type",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}],
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"role": "tool", "content": "r"}, "messages[0].tool_call_id"),
    ],
)
def test_content_anthropic_cannot_carry_is_a_400(message, param):
    with pytest.raises(InvalidRequestError) as info:
        openai_to_anthropic([message], None)
    assert info.value.param == param


def test_tool_choice_translation():
    assert openai_to_anthropic_tool_choice("auto") == {"type": "auto"}
    assert openai_to_anthropic_tool_choice("required") == {"type": "any"}
    assert openai_to_anthropic_tool_choice("none") == {"type": "none"}
    assert openai_to_anthropic_tool_choice({"type": "function", "function": {"name": "f"}}) == {
        "type": "tool",
        "name": "f",
    }
    assert openai_to_anthropic_tool_choice(None, parallel_tool_calls=False) == {
        "type": "auto",
        "disable_parallel_tool_use": True,
    }
    assert openai_to_anthropic_tool_choice(None) is None
    with pytest.raises(InvalidRequestError):
        openai_to_anthropic_tool_choice(3)
    with pytest.raises(UnsupportedContentError):
        openai_to_anthropic([{"role": "user", "content": "x"}], [{"type": "retrieval"}])


# ---- formatting
# -----------------------------------------------------------------------------------------------


def deltas_from_openai_fixture(name: str) -> list[Delta]:
    events = parse_sse(fixture_bytes("openai", name))
    out = []
    for event in events:
        if event.data == "[DONE]":
            break
        for choice in json.loads(event.data)["choices"]:
            delta = choice["delta"]
            if delta.get("content") or delta.get("tool_calls"):
                out.append(Delta(text=delta.get("content") or "", tool_calls=delta.get("tool_calls")))
    return out


USAGE = BackendUsage(prompt_tokens=2000, completion_tokens=60, cached_tokens=1536, cache_creation_tokens=256)


def test_usage_as_anthropic_defines_it():
    assert anthropic_usage(USAGE) == {
        "input_tokens": 208,
        "cache_creation_input_tokens": 256,
        "cache_read_input_tokens": 1536,
        "output_tokens": 60,
    }


def test_interleaved_parallel_tool_calls_stream_one_whole_block_after_another():
    """A fresh-user trial: an OpenAI-compatible upstream interleaved two calls' argument deltas (0, 1, 0, 1);
    block 1 got a delta after its ``content_block_stop``, where the Anthropic SDK showed ``input: {}``. A later
    call's block is now held while the open one may still grow, and sent whole after it."""

    def call(index: int, arguments: str, name: str | None = None) -> Delta:
        function = {"arguments": arguments} | ({"name": name} if name else {})
        head = {"id": f"call_{index}", "type": "function"} if name else {}
        return Delta(tool_calls=[{"index": index, **head, "function": function}])

    formatter = StreamFormatter("claude", "req1")
    events = [
        Delta(text="Both."),
        call(0, '{"city": "Pa', "get_weather"),
        call(1, '{"tz":', "get_time"),
        call(0, 'ris"}'),
        call(1, ' "CET"}'),
    ]
    raw = b"".join(formatter.feed(e) for e in events) + formatter.feed(Finish("tool_calls", USAGE))
    parsed = [(e.event, json.loads(e.data)) for e in parse_sse(raw)]
    blocks = [(n, d.get("index")) for n, d in parsed if n.startswith("content_block")]
    assert [n for n, _ in blocks if n != "content_block_delta"] == [
        "content_block_start",
        "content_block_stop",
    ] * 3
    stopped: set[int] = set()
    inputs: dict[int, str] = {}
    for name, data in parsed:
        if name == "content_block_stop":
            stopped.add(data["index"])
        elif name == "content_block_delta":
            assert data["index"] not in stopped  # nothing after a block's stop
            if data["delta"]["type"] == "input_json_delta":
                inputs[data["index"]] = inputs.get(data["index"], "") + data["delta"]["partial_json"]
        elif name == "content_block_start":
            assert data["index"] == len(stopped)  # one block after another, in index order
    assert {i: json.loads(v) for i, v in inputs.items()} == {1: {"city": "Paris"}, 2: {"tz": "CET"}}


def test_stream_event_order_and_content_for_text_then_parallel_tools():
    formatter = StreamFormatter("claude", "req1")
    events = [Delta(text="Checking"), Delta(text=" both.")] + deltas_from_openai_fixture("f82268f2fefd.sse")
    raw = b"".join(formatter.feed(e) for e in events) + formatter.feed(Finish("tool_calls", USAGE))
    parsed = [(e.event, json.loads(e.data)) for e in parse_sse(raw)]
    names = [name for name, _ in parsed]
    assert names[:4] == ["message_start", "content_block_start", "ping", "content_block_delta"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in parsed)
    starts = [d for n, d in parsed if n == "content_block_start"]
    stops = [d["index"] for n, d in parsed if n == "content_block_stop"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"] and stops == [
        0,
        1,
        2,
    ]
    assert [s["content_block"].get("name") for s in starts[1:]] == ["GetWeatherArgs", "get_stock_price"]
    # every block's events sit between its start and its stop
    for index in range(3):
        positions = [i for i, (_, d) in enumerate(parsed) if d.get("index") == index]
        assert (
            parsed[positions[0]][0] == "content_block_start"
            and parsed[positions[-1]][0] == "content_block_stop"
        )
    inputs = {}
    for name, data in parsed:
        if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
            inputs[data["index"]] = inputs.get(data["index"], "") + data["delta"]["partial_json"]
    assert json.loads(inputs[2]) == {"ticker": "AAPL", "exchange": "NASDAQ"}
    final = parsed[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["cache_read_input_tokens"] == 1536 and final["usage"]["input_tokens"] == 208
    assert parsed[0][1]["message"]["model"] == "claude" and parsed[0][1]["message"]["id"].startswith("msg_")


async def _events(items):
    for item in items:
        yield item


async def test_build_message_non_stream():
    items = [Delta(text="I'll check. ")] + deltas_from_openai_fixture("2018feb66ae1.sse")
    items.append(Finish("tool_calls", USAGE))
    message, finish = await build_message(_events(items), "claude", "r2")
    assert message["type"] == "message" and message["role"] == "assistant" and message["model"] == "claude"
    assert message["content"] == [
        {"type": "text", "text": "I'll check. "},
        {
            "type": "tool_use",
            "id": "call_4XzlGBLtUe9dy3GVNV4jhq7h",
            "name": "get_weather",
            "input": {"city": "New York City"},
        },
    ]
    assert message["stop_reason"] == "tool_use" and message["usage"] == anthropic_usage(USAGE)


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"order_id": "}}</tool_call>  # This is', {}),  # the user's runaway string, cut
        ('{"city": "Paris", "days": 3, "unit": "cel', {"city": "Paris", "days": 3}),
        ('{"a": {"b": [1, 2', {"a": {"b": [1, 2]}}),
        ("", {}),  # cut right after the name
        ("[1, 2", {}),  # not an object
        ("nope", {}),  # not JSON at all
    ],
)
async def test_a_tool_use_cut_by_max_tokens_keeps_the_input_members_it_completed(arguments, expected):
    """A call cut inside its arguments arrives with its text so far; ``input`` (an object, always) is that
    text read in jiter's partial mode, as the Anthropic SDK reads the same ``input_json_delta`` fragments of a
    stream (before: ``{}`` whenever the text did not parse whole)."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message, _ = await build_message(_events([Delta(tool_calls=[call]), Finish("length", USAGE)]), "m", "r")
    assert message["content"] == [{"type": "tool_use", "id": "call_1", "name": "f", "input": expected}]
    assert message["stop_reason"] == "max_tokens"


async def test_stop_sequence_and_native_stop_reasons():
    message, _ = await build_message(
        _events([Delta(text="a"), Finish("stop", USAGE, stop_sequence="END")]), "m", "r"
    )
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    message, _ = await build_message(_events([Finish("length", USAGE)]), "m", "r")
    assert message["stop_reason"] == "max_tokens" and message["content"] == []
    message, _ = await build_message(
        _events([Finish("stop", USAGE, anthropic_stop_reason="pause_turn")]), "m", "r"
    )
    assert message["stop_reason"] == "pause_turn"


async def test_build_message_needs_a_finish():
    with pytest.raises(APIError):
        await build_message(_events([Delta(text="a")]), "m", "r")


class FakeOpened:
    """The parts of ``gateway.service.pipeline.OpenedStream`` the face uses (its real ``guarded_events``)."""

    guarded_events = OpenedStream.guarded_events

    def __init__(self, request, items):
        self.request = request
        self.items = items
        self.failed: list[APIError] = []
        self.closed = False

    async def events(self):
        try:
            for item in self.items:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True

    def fail(self, error):
        self.failed.append(error)


async def test_native_events_are_relayed_with_the_client_model_name():
    request = parse_messages_body(
        {"model": "my-claude", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    )
    recorded = [json.loads(e.data) for e in parse_sse(fixture_bytes("anthropic", "stream-b-fallback.sse"))]
    items = [NativeDelta(events=(e,)) for e in recorded] + [Finish("stop", USAGE, native=True)]
    opened = FakeOpened(request, items)
    out = parse_sse(b"".join([chunk async for chunk in message_sse(opened)]))
    relayed = [json.loads(e.data) for e in out]
    assert relayed[0]["message"]["model"] == "my-claude"
    relayed[0]["message"]["model"] = recorded[0]["message"]["model"]
    assert relayed == recorded and [e.event for e in out] == [r["type"] for r in recorded]
    assert opened.closed and not opened.failed


async def test_an_error_mid_stream_ends_with_an_error_event():
    request = parse_messages_body(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    )
    cut = UpstreamCallError(502, "stream_cut", "upstream broke off")
    opened = FakeOpened(request, [Delta(text="partial"), cut])
    out = parse_sse(b"".join([chunk async for chunk in message_sse(opened)]))
    assert [e.event for e in out] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "error",
    ]
    assert json.loads(out[-1].data) == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream broke off"},
    }
    assert opened.failed == [cut] and opened.closed


def test_tool_results_answering_the_previous_tool_uses_and_long_names_are_accepted():
    name = "get-weather_2" + "x" * 115  # 128 characters
    body = {
        "model": "m",
        "max_tokens": 5,
        "tools": [{"name": name, "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": name, "input": {}},
                    {"type": "tool_use", "id": "t2", "name": name, "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t2", "content": "2"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "1"},
                    {"type": "text", "text": "and?"},
                ],
            },
        ],
    }
    request = parse_messages_body(body)
    assert [m.get("tool_call_id") for m in request.messages if m["role"] == "tool"] == ["t2", "t1"]


def test_count_tokens_takes_its_documented_fields_only():
    """Before: a count body with max_tokens (a Messages-only field) was accepted while unknown fields were
    refused."""
    from gateway.protocols.anthropic.parse import parse_count_body

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}
    assert parse_count_body(body).params.max_tokens is None
    for field, value in [("max_tokens", 5), ("stream", True), ("top_k", 3), ("service_tier", "auto")]:
        with pytest.raises(InvalidRequestError) as info:
            parse_count_body({**body, field: value})
        assert (info.value.param, info.value.message) == (field, f"{field}: Extra inputs are not permitted")
        # server.unknown_fields: ignore lets it through (checked, then left out of the count)
        assert parse_count_body({**body, field: value}, refuse_unknown=False).model == "m"
    with pytest.raises(InvalidRequestError) as info:
        parse_count_body({**body, "max_tokens": 0}, refuse_unknown=False)
    assert info.value.param == "max_tokens"


def tool_use_turn_body(*after: dict) -> dict:
    """A Messages body whose assistant turn calls tool ``toolu_1``, then ``after``."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [call]}, *after]
    return {"model": "m", "max_tokens": 5, "messages": messages}


def test_a_tool_use_without_its_result_is_named_in_anthropics_words():
    with pytest.raises(InvalidRequestError) as info:
        parse_messages_body(tool_use_turn_body({"role": "user", "content": "go on"}))
    assert info.value.message == (
        "messages[1]: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1. Each "
        "`tool_use` block must have a corresponding `tool_result` block in the next message."
    )


def test_a_final_assistant_tool_use_turn_is_left_alone():
    assert parse_messages_body(tool_use_turn_body()) is not None


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [('{"city": "Par', {}), ('{"city": "Paris", "unit": "c', {"city": "Paris"}), ("{}", {})],
)
def test_a_cut_call_resent_to_an_anthropic_upstream_keeps_its_complete_members(arguments, expected):
    """A call cut by ``max_tokens`` comes back to an OpenAI-face client with arguments that are not JSON; resent
    to an Anthropic upstream, its ``tool_use`` input holds the members that were complete (jiter's partial mode,
    as the Anthropic SDKs read a cut input); before: 400 "not valid JSON"."""
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    (use,) = openai_to_anthropic(messages, None).messages[1]["content"]
    assert use == {"type": "tool_use", "id": "c1", "name": "w", "input": expected}


@pytest.mark.parametrize("arguments", ["nope", "[1, 2]"])
def test_call_arguments_that_are_no_object_even_cut_are_400(arguments):
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    with pytest.raises(InvalidRequestError) as caught:
        openai_to_anthropic(messages, None)
    assert caught.value.param.endswith("function.arguments")


@pytest.mark.parametrize(
    "first",
    [
        {"type": "text", "text": "here"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
    ],
)
def test_a_block_before_the_tool_results_is_refused_as_anthropic_does(first):
    """Before: text before a tool_result was accepted (found by a user trial); an Anthropic upstream refuses
    it, so the embedded model must too."""
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    with pytest.raises(InvalidRequestError) as info:
        parse_messages_body(tool_use_turn_body({"role": "user", "content": [first, result]}))
    assert info.value.param == "messages[2].content[1]"
    assert "tool_result blocks must come first" in info.value.message
    assert f"messages[2].content[0] is a {first['type']!r} block" in info.value.message
    # after the results, text is fine
    body = tool_use_turn_body({"role": "user", "content": [result, {"type": "text", "text": "here"}]})
    assert [m["role"] for m in parse_messages_body(body).messages][-2:] == ["tool", "user"]


def test_null_markers_are_taken_out_and_a_body_without_one_is_not_copied():
    from gateway.protocols.anthropic.cache_control import drop_null_markers

    plain = {
        "model": "m",
        "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert drop_null_markers(plain) is plain
    nulled = {
        "model": "m",
        "cache_control": None,
        "system": [{"type": "text", "text": "s", "cache_control": None}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "text", "text": "r", "cache_control": None}],
                    }
                ],
            }
        ],
    }
    cleaned = drop_null_markers(nulled)
    assert "cache_control" not in cleaned and "cache_control" not in cleaned["system"][0]
    assert "cache_control" not in cleaned["messages"][0]["content"][0]["content"][0]
    assert nulled["system"][0]["cache_control"] is None  # the caller's body is not changed


async def test_a_tool_input_number_beyond_the_float_range_is_written_as_the_largest_float():
    """Before: a model writing ``1e999`` in a call to a tool that takes any object (the flaky
    test_a_tool_schema_the_engine_cannot_compile_falls_back_unless_strict) made the non-streamed Message hold
    infinity, and writing it failed: a 500."""

    async def events():
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
        call["function"]["arguments"] = '{"a": 1e999, "b": [-1e999, 2]}'
        yield Delta(tool_calls=[call])
        yield Finish(finish_reason="tool_calls", usage=BackendUsage(prompt_tokens=3, completion_tokens=9))

    message, _ = await build_message(events(), "m", "req_1")
    (block,) = [b for b in message["content"] if b["type"] == "tool_use"]
    assert block["input"] == {"a": sys.float_info.max, "b": [-sys.float_info.max, 2]}
    json.dumps(message, allow_nan=False)


def test_a_resent_call_s_out_of_range_number_goes_upstream_as_strict_json():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": -1e999}'}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    history.append({"role": "tool", "tool_call_id": "c1", "content": "ok"})
    prompt = openai_to_anthropic(history, None)
    (use,) = [b for b in prompt.messages[1]["content"] if b["type"] == "tool_use"]
    assert use["input"] == {"a": -sys.float_info.max}
    call["function"]["arguments"] = '{"a": NaN}'
    with pytest.raises(InvalidRequestError, match="NaN"):
        openai_to_anthropic(history, None)
