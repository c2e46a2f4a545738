"""``backend: anthropic`` against respx-mocked Messages API servers, with recorded Anthropic streams."""

from __future__ import annotations

import json

import httpx
import pytest
import respx

from engine.api import SamplingParams
from gateway.backends.anthropic_upstream import AnthropicUpstreamBackend, create_anthropic_backend
from gateway.config.schema import AnthropicUpstream, RingConfig
from gateway.core.errors import APIError
from gateway.core.events import Delta, Finish
from gateway.core.tokens import TokenCounter
from gateway.protocols.anthropic.parse import parse_messages_body
from gateway.protocols.anthropic.render import NativeDelta
from gateway.service.canonicalize import Canonicalizer
from gateway.transport.failures import UpstreamCallError, UpstreamStreamCut
from gateway.transport.sse import parse_sse
from rules import load_ruleset
from tests.gateway.upstream_helpers import (
    API_KEY,
    BreakingStream,
    Sleeps,
    chat_request,
    drain,
    fixture_bytes,
    sse_response,
)

BASE = "https://api.anthropic.test"
URL = f"{BASE}/v1/messages"
WORDS = TokenCounter(count=lambda text: len(text.split()), counted_by="words")
LONG_SYSTEM = " ".join(f"rule{i}" for i in range(1500))


@pytest.fixture
async def http():
    async with httpx.AsyncClient() as client:
        yield client


def backend(http, retries=2, sleeps=None, **kwargs) -> AnthropicUpstreamBackend:
    return AnthropicUpstreamBackend(
        "claude",
        [BASE],
        api_key=API_KEY,
        upstream_model="claude-sonnet-4-5",
        retries=retries,
        client=http,
        sleep=sleeps or Sleeps(),
        counter=WORDS,
        **kwargs,
    )


def recorded_events(name: str) -> list[dict]:
    return [e.json() for e in parse_sse(fixture_bytes("anthropic", name))]


def anthropic_request(body: dict, rules: bool = True, stream: bool = True):
    body = {"model": "claude", "max_tokens": 256, "stream": stream, **body}
    request = parse_messages_body(body)
    request.rules_enabled = rules
    request.canonical = load_ruleset([]).apply(request.messages, request.tools)
    request.prefix_key = "cd" * 16
    return request


CACHE_STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],'
    b'"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":21,'
    b'"cache_creation_input_tokens":188,"cache_read_input_tokens":1800,"output_tokens":1}}}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    b'event: ping\ndata: {"type": "ping"}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Cached!"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"stop_sequence","stop_sequence":"END"},'
    b'"usage":{"output_tokens":4}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


# ---- native passthrough (Anthropic face) -------------------------------------------------------------------


@respx.mock
async def test_native_stream_relays_every_recorded_event(http):
    respx.post(URL).mock(return_value=sse_response(fixture_bytes("anthropic", "tool_use_response.txt")))
    events = await drain(
        backend(http).stream(anthropic_request({"messages": [{"role": "user", "content": "Paris?"}]}))
    )
    native = [e for e in events if isinstance(e, NativeDelta)]
    relayed = [raw for e in native for raw in e.events]
    assert relayed == recorded_events("tool_use_response.txt")
    assert "".join(e.text for e in native) == "I'll check the current weather in Paris for you."
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.native is True
    assert finish.finish_reason == "tool_calls" and finish.anthropic_stop_reason == "tool_use"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens, finish.usage.cached_tokens) == (
        377,
        65,
        0,
    )


@respx.mock
async def test_native_stream_keeps_thinking_and_refusal_details(http):
    respx.post(URL).mock(return_value=sse_response(fixture_bytes("anthropic", "stream-a-refusal.sse")))
    events = await drain(
        backend(http).stream(anthropic_request({"messages": [{"role": "user", "content": "hi"}]}))
    )
    relayed = [raw for e in events if isinstance(e, NativeDelta) for raw in e.events]
    assert relayed == recorded_events("stream-a-refusal.sse")
    assert events[-1].finish_reason == "content_filter" and events[-1].usage.completion_tokens == 106


@respx.mock
async def test_cache_usage_maps_to_backend_usage(http):
    respx.post(URL).mock(return_value=sse_response(CACHE_STREAM))
    events = await drain(
        backend(http).stream(anthropic_request({"messages": [{"role": "user", "content": "q"}]}))
    )
    usage = events[-1].usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.cache_creation_tokens) == (
        21 + 1800 + 188,
        1800,
        188,
    )
    assert usage.completion_tokens == 4 and usage.counted_by == "upstream"
    assert events[-1].stop_sequence == "END"


@respx.mock
async def test_native_request_keeps_the_body_and_client_cache_control(http):
    route = respx.post(URL).mock(return_value=sse_response(CACHE_STREAM))
    body = {
        "system": [
            {"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ],
        "messages": [
            {"role": "user", "content": "first " + LONG_SYSTEM},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "service_tier": "auto",
    }
    request = anthropic_request(body)
    request.forward_headers = {"anthropic-beta": "some-beta-2025"}
    await drain(backend(http).stream(request))
    sent_request = route.calls.last.request
    sent = json.loads(sent_request.content)
    assert (
        sent_request.headers["x-api-key"] == API_KEY
        and sent_request.headers["anthropic-version"] == "2023-06-01"
    )
    assert sent_request.headers["anthropic-beta"] == "some-beta-2025"
    assert sent["model"] == "claude-sonnet-4-5" and sent["stream"] is True
    assert (
        sent["thinking"] == body["thinking"] and sent["service_tier"] == "auto" and sent["max_tokens"] == 256
    )
    assert sent["system"] == body["system"]  # client breakpoint kept, ttl included
    # the client chose its caching: nothing is added (issue 15: explicit client choices stay untouched)
    assert sent["messages"][1]["content"] == "first answer" and "cache_control" not in sent
    assert sent["messages"][0]["content"] == body["messages"][0]["content"]
    assert sent["messages"][2]["content"] == "second question"


@respx.mock
async def test_rules_off_sends_the_client_prompt_exactly(http):
    route = respx.post(URL).mock(return_value=sse_response(CACHE_STREAM))
    body = {
        "system": "short system",
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "x"}, {"type": "text", "text": "a"}],
            },
        ],
    }
    await drain(backend(http).stream(anthropic_request(body, rules=False)))
    sent = json.loads(route.calls.last.request.content)
    assert (
        sent["messages"] == body["messages"] and sent["system"] == "short system"
    )  # below minimum: no marks


@respx.mock
async def test_native_non_stream_returns_the_message(http):
    message = {
        "id": "msg_9",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [
            {"type": "thinking", "thinking": "t", "signature": "s"},
            {"type": "text", "text": "Hello"},
        ],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "cache_read_input_tokens": 1024,
            "cache_creation_input_tokens": 0,
            "output_tokens": 2,
        },
    }
    # an upstream (or a proxy) that answers a JSON Message although it was asked to stream
    route = respx.post(URL).mock(return_value=httpx.Response(200, json=message))
    events = await drain(
        backend(http).stream(
            anthropic_request({"messages": [{"role": "user", "content": "hi"}]}, stream=False)
        )
    )
    assert json.loads(route.calls.last.request.content)["stream"] is True
    assert events[0].events == (message,) and events[0].text == "Hello"
    assert events[-1].usage.cached_tokens == 1024 and events[-1].usage.prompt_tokens == 1029


def anthropic_sse(events: list[dict]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


@respx.mock
async def test_native_non_stream_is_streamed_upstream_and_assembled_into_the_message(http):
    start = {
        "id": "msg_7",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "cache_read_input_tokens": 1024,
            "cache_creation_input_tokens": 0,
            "output_tokens": 1,
        },
    }
    cite = {
        "type": "char_location",
        "cited_text": "Paris",
        "document_index": 0,
        "start_char_index": 0,
        "end_char_index": 5,
    }
    events = [
        {"type": "message_start", "message": start},
        {"type": "ping"},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "Let me "},
        },
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "look."}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "sig=="},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "It is "}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "citations_delta", "citation": cite}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Paris."}},
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"word": '},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'},
        },
        {"type": "content_block_stop", "index": 2},
        {
            "type": "content_block_start",
            "index": 3,
            "content_block": {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}},
        },
        {"type": "content_block_stop", "index": 3},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 42},
        },
        {"type": "message_stop"},
    ]
    route = respx.post(URL).mock(return_value=sse_response(anthropic_sse(events)))
    got = await drain(
        backend(http).stream(
            anthropic_request({"messages": [{"role": "user", "content": "hi"}]}, stream=False)
        )
    )
    assert json.loads(route.calls.last.request.content)["stream"] is True
    assert got[0].events == (
        {
            **start,
            "content": [
                {"type": "thinking", "thinking": "Let me look.", "signature": "sig=="},
                {"type": "text", "text": "It is Paris.", "citations": [cite]},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}},
            ],
            "stop_reason": "tool_use",
            "usage": {**start["usage"], "output_tokens": 42},
        },
    )
    assert got[-1].finish_reason == "tool_calls" and got[-1].usage.completion_tokens == 42


@respx.mock
@pytest.mark.parametrize(
    ("events", "message"),
    [
        (
            [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}],
            "'content_block_start' before message_start",
        ),
        (
            [
                {"type": "message_start", "message": {"type": "message", "content": []}},
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}},
            ],
            "content_block_delta for unknown block 0",
        ),
        (
            [
                {"type": "message_start", "message": {"type": "message", "content": []}},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                {"type": "content_block_delta", "index": 0, "delta": {"type": "hologram_delta", "x": 1}},
            ],
            "a delta of unknown type 'hologram_delta'",
        ),
        (
            [
                {"type": "message_start", "message": {"type": "message", "content": []}},
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "tool_use", "id": "t", "input": {}},
                },
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "input_json_delta", "partial_json": "{oops"},
                },
                {"type": "content_block_stop", "index": 0},
            ],
            "block 0 has tool input that is not JSON",
        ),
    ],
)
async def test_a_stream_that_cannot_be_assembled_is_a_protocol_cut(http, events, message):
    respx.post(URL).mock(return_value=sse_response(anthropic_sse([*events, {"type": "message_stop"}])))
    request = anthropic_request({"messages": [{"role": "user", "content": "q"}]}, stream=False)
    with pytest.raises(UpstreamStreamCut, match=message) as info:
        await drain(backend(http).stream(request))
    assert (info.value.kind, info.value.status_code) == ("protocol", 502)


# ---- translation (OpenAI face)
# ------------------------------------------------------------------------------


@respx.mock
async def test_openai_request_translated_and_stream_turned_into_deltas(http):
    route = respx.post(URL).mock(
        return_value=sse_response(fixture_bytes("anthropic", "tool_use_response.txt"))
    )
    messages = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location":"Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "user", "content": "And Paris?"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {
        "model": "claude",
        "messages": messages,
        "tools": tools,
        "temperature": 0.5,
        "parallel_tool_calls": False,
    }
    request = chat_request(
        messages,
        model="claude",
        body=body,
        tools=tools,
        tool_choice="required",
        params=SamplingParams(max_tokens=None, temperature=0.5, stop=("END",)),
        user="u-7",
    )
    request.canonical = load_ruleset([]).apply(messages, tools)
    events = await drain(backend(http).stream(request))
    sent = json.loads(route.calls.last.request.content)
    assert sent["system"] == [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    assert sent["messages"] == [
        # where the previous request ended: its entry is read exactly (however many blocks this turn added)
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"location": "Rome"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18C"},
                {"type": "text", "text": "And Paris?"},
            ],
        },
    ]
    # automatic caching (issue 15): the top-level marker follows the conversation, the system keeps its own
    assert sent["cache_control"] == {"type": "ephemeral"}
    assert sent["tools"] == [{"name": "get_weather", "input_schema": {"type": "object"}}]
    assert sent["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert sent["max_tokens"] == 4096 and sent["temperature"] == 0.5 and "top_p" not in sent
    assert sent["stop_sequences"] == ["END"] and sent["metadata"] == {"user_id": "u-7"}
    assert not any(isinstance(e, NativeDelta) for e in events)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    assert text == "I'll check the current weather in Paris for you."
    calls = [c for e in events if isinstance(e, Delta) for c in (e.tool_calls or [])]
    assert calls[0] == {
        "index": 0,
        "id": "toolu_01NRLabsLyVHZPKxbKvkfSMn",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"location": "Paris"}'
    assert events[-1].finish_reason == "tool_calls" and events[-1].native is False


async def test_completion_requests_are_refused(http):
    request = chat_request([], kind="completion", prompt="x")
    with pytest.raises(APIError) as info:
        await drain(backend(http).stream(request))
    assert info.value.status_code == 400


# ---- faults
# -------------------------------------------------------------------------------------------------


@respx.mock
async def test_overloaded_is_retried_then_reported_as_529(http):
    sleeps = Sleeps()
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    route = respx.post(URL).mock(return_value=httpx.Response(529, json=overloaded))
    with pytest.raises(UpstreamCallError) as info:
        await drain(
            backend(http, retries=1, sleeps=sleeps).stream(
                anthropic_request({"messages": [{"role": "user", "content": "q"}]})
            )
        )
    assert route.call_count == 2 and len(sleeps.calls) == 1
    assert info.value.status_code == 529 and info.value.upstream_error == overloaded["error"]


@respx.mock
async def test_an_error_event_mid_stream_is_a_cut_with_the_upstream_type(http):
    body = CACHE_STREAM.split(b"event: content_block_stop")[0] + (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    )
    respx.post(URL).mock(return_value=sse_response(body, headers={"request-id": "req_011Overloaded"}))
    with pytest.raises(UpstreamStreamCut) as info:
        await drain(backend(http).stream(anthropic_request({"messages": [{"role": "user", "content": "q"}]})))
    assert info.value.upstream_error == {"type": "overloaded_error", "message": "Overloaded"}
    assert info.value.status_code == 529
    assert info.value.upstream_request_id == "req_011Overloaded"  # the answer's id, for a provider ticket


@respx.mock
async def test_a_reset_after_the_first_byte_is_a_cut_and_not_retried(http):
    first = CACHE_STREAM.split(b"event: content_block_delta")[0]
    route = respx.post(URL).mock(
        return_value=httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=BreakingStream([first], httpx.RemoteProtocolError("peer closed")),
        )
    )
    with pytest.raises(UpstreamStreamCut):
        await drain(backend(http).stream(anthropic_request({"messages": [{"role": "user", "content": "q"}]})))
    assert route.call_count == 1


@respx.mock
async def test_a_stream_without_message_stop_is_a_cut(http):
    respx.post(URL).mock(return_value=sse_response(CACHE_STREAM.split(b"event: message_stop")[0]))
    with pytest.raises(UpstreamStreamCut, match="before message_stop"):
        await drain(backend(http).stream(anthropic_request({"messages": [{"role": "user", "content": "q"}]})))


@respx.mock
async def test_invalid_request_passes_through_without_the_key(http):
    error = {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"bad key {API_KEY} given"},
    }
    respx.post(URL).mock(return_value=httpx.Response(400, json=error))
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http).stream(anthropic_request({"messages": [{"role": "user", "content": "q"}]})))
    assert info.value.status_code == 400 and info.value.upstream_error["type"] == "invalid_request_error"
    assert API_KEY not in info.value.message and API_KEY not in json.dumps(info.value.upstream_error)


def test_factory_reads_the_model_entry():
    model = AnthropicUpstream(
        name="claude",
        base_url=(BASE,),
        api_key=API_KEY,
        upstream_model="claude-haiku-4-5",
        timeout_s=30.0,
        retries=1,
    )
    be = create_anthropic_backend(model)
    assert be.upstream_model == "claude-haiku-4-5" and be.upstream.policy.retries == 1
    assert be.upstream.ring.replicas == (BASE,)


@respx.mock
@pytest.mark.usefixtures("respx_upstreams")
async def test_factory_passes_version_breakpoint_settings_and_ring():
    route = respx.post(URL).mock(return_value=sse_response(CACHE_STREAM))
    system = " ".join(f"rule{i}" for i in range(60))  # far below the built-in 4096-token minimum of haiku 4.5
    body = {"system": system, "messages": [{"role": "user", "content": "q"}]}

    async def sent_with(**settings) -> tuple[httpx.Request, dict]:
        model = AnthropicUpstream(
            name="claude", base_url=(BASE,), api_key=API_KEY, upstream_model="claude-haiku-4-5", **settings
        )
        be = create_anthropic_backend(model)
        try:
            await drain(be.stream(anthropic_request(body)))
        finally:
            await be.close()
        return route.calls.last.request, json.loads(route.calls.last.request.content)

    request, sent = await sent_with(
        anthropic_version="2024-01-01", min_cacheable_tokens=(("claude-haiku", 5),)
    )
    assert request.headers["anthropic-version"] == "2024-01-01"
    assert sent["system"] == [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    _, sent = await sent_with(min_cacheable_tokens=(("claude-haiku", 5),), auto_breakpoints=False)
    assert sent["system"] == system  # no automatic breakpoint
    _, sent = await sent_with()
    assert sent["system"] == system  # the built-in minimum: too short to cache
    be = create_anthropic_backend(
        AnthropicUpstream(name="c", base_url=(BASE,), ring=RingConfig(load_factor=2.0, vnodes=3))
    )
    assert (be.upstream.ring.load_factor, be.upstream.ring.vnodes) == (2.0, 3)


@respx.mock
@pytest.mark.parametrize("shape", ["string", "one block", "own block"])
async def test_native_passthrough_sends_the_canonical_prompt_with_the_date_hoisted(http, shape):
    """The default rules move ``Current date:`` out of the system prompt for Anthropic-face requests forwarded
    natively, so two days send the same system prompt (the provider's cache hits on it)."""
    route = respx.post(URL).mock(return_value=sse_response(CACHE_STREAM))
    canonicalizer = Canonicalizer(["default"])

    def system_of(date: str):
        if shape == "string":
            return f"{LONG_SYSTEM}\nCurrent date: {date}"
        if shape == "one block":
            return [{"type": "text", "text": f"{LONG_SYSTEM}\nCurrent date: {date}"}]
        return [
            {"type": "text", "text": LONG_SYSTEM},
            {"type": "text", "text": f"Current date: {date}", "cache_control": {"type": "ephemeral"}},
        ]

    sent = []
    for date in ("2025-05-14", "2025-05-15"):
        body = {
            "model": "claude",
            "max_tokens": 64,
            "stream": True,
            "system": system_of(date),
            "messages": [{"role": "user", "content": "What day is it?"}],
        }
        request = parse_messages_body(body)
        canonicalizer.apply(request)
        assert Canonicalizer.applied(request) == {"dates.current-datetime-line": 1}
        await drain(backend(http).stream(request))
        sent.append(json.loads(route.calls.last.request.content))
    assert sent[0]["system"] == sent[1]["system"]
    # the system prompt is long enough for an automatic breakpoint, so even a string is sent as a block
    assert "".join(b["text"] for b in sent[0]["system"]).strip() == LONG_SYSTEM
    assert sent[0]["system"][-1]["cache_control"] == {"type": "ephemeral"} and sent[0]["system"][-1]["text"]
    for day, body in zip(("14", "15"), sent, strict=True):
        assert f"Current date: 2025-05-{day}" in json.dumps(body["messages"][-1])


@respx.mock
@pytest.mark.parametrize(
    ("answer", "stream", "message"),
    [
        (sse_response(b"event: message_start\ndata: {not json\n\n"), True, "sent an event that is not JSON"),
        (sse_response(b"event: message_start\ndata: [1, 2]\n\n"), True, "an event that is not a JSON object"),
        (httpx.Response(200, content=b"<html>"), False, "sent an answer that is not JSON"),
        (httpx.Response(200, json=["message"]), False, "an answer that is not a JSON object"),
        (httpx.Response(200, json={"type": "completion"}), False, "JSON that is not a Message"),
    ],
)
async def test_unreadable_answers_are_protocol_cuts(http, answer, stream, message):
    respx.post(URL).mock(return_value=answer)
    request = anthropic_request({"messages": [{"role": "user", "content": "q"}]}, stream=stream)
    with pytest.raises(UpstreamStreamCut, match=message) as info:
        await drain(backend(http).stream(request))
    assert info.value.kind == "protocol" and info.value.status_code == 502


@respx.mock
@pytest.mark.parametrize("stream", [True, False])
async def test_an_event_of_an_unexpected_shape_is_a_protocol_cut(http, stream):
    events = [
        {"type": "message_start", "message": {"type": "message", "content": [], "usage": "lots"}},
        {"type": "content_block_start", "index": 0, "content_block": "text"},
        {"type": "message_stop"},
    ]
    respx.post(URL).mock(return_value=sse_response(anthropic_sse(events)))
    request = anthropic_request({"messages": [{"role": "user", "content": "q"}]}, stream=stream)
    with pytest.raises(
        UpstreamStreamCut, match="event of an unexpected shape|content_block_start without"
    ) as info:
        await drain(backend(http).stream(request))
    assert (info.value.kind, info.value.status_code) == ("protocol", 502)


@respx.mock
async def test_a_tool_input_cut_by_max_tokens_and_null_citations_still_assemble(http):
    start = {
        "id": "msg_8",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    cite = {
        "type": "char_location",
        "cited_text": "x",
        "document_index": 0,
        "start_char_index": 0,
        "end_char_index": 1,
    }
    events = [
        {"type": "message_start", "message": start},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": "", "citations": None},
        },
        {"type": "content_block_delta", "index": 0, "delta": {"type": "citations_delta", "citation": cite}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_9", "name": "trip", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": "Paris", "days": [1, 2'},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"output_tokens": 16},
        },
        {"type": "message_stop"},
    ]
    respx.post(URL).mock(return_value=sse_response(anthropic_sse(events)))
    got = await drain(
        backend(http).stream(
            anthropic_request({"messages": [{"role": "user", "content": "hi"}]}, stream=False)
        )
    )
    content = got[0].events[0]["content"]
    assert content[0] == {"type": "text", "text": "", "citations": [cite]}
    assert content[1]["input"] == {"city": "Paris", "days": [1, 2]}  # complete members kept, as the SDKs do
    assert got[-1].finish_reason == "length"


@respx.mock
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "message_delta",
    [
        {"delta": {"stop_reason": ["end_turn"]}, "usage": {"output_tokens": 1}},
        {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": "five"}},
    ],
)
async def test_a_malformed_stop_reason_or_usage_is_a_protocol_cut(http, stream, message_delta):
    start = {"id": "m", "type": "message", "role": "assistant", "model": "m", "content": [], "usage": {}}
    events = [
        {"type": "message_start", "message": start},
        {"type": "message_delta", **message_delta},
        {"type": "message_stop"},
    ]
    respx.post(URL).mock(return_value=sse_response(anthropic_sse(events)))
    request = anthropic_request({"messages": [{"role": "user", "content": "q"}]}, stream=stream)
    with pytest.raises(UpstreamStreamCut, match="malformed stop_reason or usage") as info:
        await drain(backend(http).stream(request))
    assert (info.value.kind, info.value.status_code) == ("protocol", 502)


# ---- OpenAI fields an Anthropic model cannot honour ----------------------------------------------------------

OPENAI_ONLY = [
    ({"seed": 7}, "seed"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"logit_bias": {"15": 10}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"temperature": 1.5}, "temperature"),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"n": 2}, "n"),
]


@respx.mock
@pytest.mark.parametrize(("fields", "param"), OPENAI_ONLY)
async def test_openai_fields_an_anthropic_model_cannot_honour_are_400s(http, fields, param):
    """Before: seed, penalties, logit_bias, response_format... were dropped from the forwarded body, 200."""
    from gateway.protocols.openai.parse import parse_chat_request

    route = respx.post(URL).mock(
        return_value=sse_response(fixture_bytes("anthropic", "tool_use_response.txt"))
    )
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}], **fields}
    request = parse_chat_request(body, {})
    with pytest.raises(APIError) as info:
        await drain(backend(http).stream(request))
    error = info.value
    assert (error.status_code, error.param) == (400, param)
    assert f"'{param}'" in error.message and "Anthropic upstream" in error.message
    assert route.call_count == 0


@respx.mock
async def test_neutral_and_harmless_openai_fields_are_served(http):
    from gateway.protocols.openai.parse import parse_chat_request

    route = respx.post(URL).mock(
        return_value=sse_response(fixture_bytes("anthropic", "tool_use_response.txt"))
    )
    body = {
        "model": "claude",
        "messages": [{"role": "user", "content": "hi"}],
        "seed": None,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "metadata": {"run": "7"},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "user": "u-1",
        "temperature": 1,
    }
    events = await drain(backend(http).stream(parse_chat_request(body, {})))
    assert isinstance(events[-1], Finish)
    sent = json.loads(route.calls.last.request.content)
    assert sent["metadata"] == {"user_id": "u-1"} and sent["temperature"] == 1.0
    assert not {"seed", "logit_bias", "response_format", "store", "prompt_cache_key"} & set(sent)


def test_every_openai_chat_field_is_decided_for_anthropic():
    from gateway.protocols.anthropic.openai_fields import IGNORED, MAPPED, REFUSED
    from gateway.protocols.openai.parse import CHAT_FIELDS

    decided = [*MAPPED, *IGNORED, *REFUSED]
    assert len(decided) == len(set(decided))  # one decision per field
    assert set(decided) == CHAT_FIELDS


# ---- structured outputs: response_format json_schema -> output_config.format -----------------------------------

CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "plan": {"type": "string", "enum": ["free", "pro"]},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "plan", "email"],
    "additionalProperties": False,
}
JSON_TEXT_STREAM = anthropic_sse(
    [
        {
            "type": "message_start",
            "message": {
                "id": "msg_s",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "claude-sonnet-4-5",
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 30, "output_tokens": 1},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": '{"name": "Ada",'},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": ' "plan": "pro", "email": "ada@example.com"}'},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 20}},
        {"type": "message_stop"},
    ]
)


@respx.mock
@pytest.mark.parametrize("strict", [True, False, None])
async def test_openai_json_schema_goes_to_anthropic_as_output_config_format(http, strict):
    """Before: a 400 (``response_format`` was refused for Anthropic upstreams). Now the schema goes as Anthropic's
    generally available ``output_config.format``, byte for byte, with no beta header; ``name`` has no place
    there and ``strict`` false is enforced all the same."""
    from gateway.protocols.openai.parse import parse_chat_request

    route = respx.post(URL).mock(return_value=sse_response(JSON_TEXT_STREAM))
    spec = {"name": "contact", "schema": CONTACT} | ({} if strict is None else {"strict": strict})
    body = {
        "model": "claude",
        "messages": [{"role": "user", "content": "Ada, pro plan, ada@example.com"}],
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": spec},
    }
    events = await drain(backend(http, auto_breakpoints=False).stream(parse_chat_request(body, {})))
    sent_request = route.calls.last.request
    assert json.loads(sent_request.content) == {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Ada, pro plan, ada@example.com"}],
        "output_config": {"format": {"type": "json_schema", "schema": CONTACT}},
        "stream": True,
    }
    headers = sent_request.headers
    assert headers["anthropic-version"] == "2023-06-01" and headers["x-api-key"] == API_KEY
    assert "anthropic-beta" not in headers
    text = "".join(e.text for e in events if isinstance(e, Delta))
    assert json.loads(text) == {"name": "Ada", "plan": "pro", "email": "ada@example.com"}
    assert events[-1].finish_reason == "stop"


@respx.mock
async def test_the_format_description_is_sent_as_the_schema_description(http):
    from gateway.protocols.openai.parse import parse_chat_request

    route = respx.post(URL).mock(return_value=sse_response(JSON_TEXT_STREAM))
    spec = {"name": "contact", "description": "A contact card.", "schema": CONTACT, "strict": True}
    body = {
        "model": "claude",
        "messages": [{"role": "user", "content": "Ada"}],
        "response_format": {"type": "json_schema", "json_schema": spec},
    }
    await drain(backend(http, auto_breakpoints=False).stream(parse_chat_request(body, {})))
    sent = json.loads(route.calls.last.request.content)
    assert sent["output_config"] == {
        "format": {"type": "json_schema", "schema": {**CONTACT, "description": "A contact card."}}
    }


@respx.mock
@pytest.mark.parametrize(
    ("schema", "param"),
    [
        (
            {**CONTACT, "properties": {**CONTACT["properties"], "age": {"type": "integer", "minimum": 0}}},
            "response_format.json_schema.schema.properties.age.minimum",
        ),
        ({"type": "object", "properties": {}}, "response_format.json_schema.schema.additionalProperties"),
        (
            {"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}},
                             "additionalProperties": False}}, "$ref": "#/$defs/N"},
            "response_format.json_schema.schema.$defs.N.properties.next.$ref",
        ),
    ],
)  # fmt: skip
async def test_a_schema_anthropic_cannot_enforce_is_a_400_before_any_call(http, schema, param):
    from gateway.protocols.openai.parse import parse_chat_request

    route = respx.post(URL).mock(return_value=sse_response(JSON_TEXT_STREAM))
    body = {
        "model": "claude",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    with pytest.raises(APIError) as info:
        await drain(backend(http).stream(parse_chat_request(body, {})))
    assert (info.value.status_code, info.value.param, info.value.code) == (400, param, "unsupported_value")
    assert route.call_count == 0


@respx.mock
async def test_count_tokens_sends_the_output_format_too(http):
    """The count endpoint takes ``output_config`` (the format's schema counts as input)."""
    from gateway.protocols.openai.parse import parse_chat_request

    route = respx.post(f"{BASE}/v1/messages/count_tokens").mock(
        return_value=httpx.Response(200, json={"input_tokens": 91})
    )
    body = {
        "model": "claude",
        "messages": [{"role": "user", "content": "Ada"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CONTACT}},
    }
    count = await backend(http, auto_breakpoints=False).count_tokens(parse_chat_request(body, {}))
    assert (count.input_tokens, count.counted_by) == (91, "upstream")
    sent = json.loads(route.calls.last.request.content)
    assert sent["output_config"] == {"format": {"type": "json_schema", "schema": CONTACT}}


OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


@respx.mock
@pytest.mark.parametrize("face", ["openai", "anthropic-streamed", "anthropic"])
async def test_an_error_answered_as_json_with_200_keeps_the_upstreams_type_and_words(http, face):
    """Before: a 200 whose JSON body is an error became a 502 that lost the upstream's words ("the upstream
    stream ended before message_stop" on the OpenAI face, "JSON that is not a Message" on the Anthropic one).
    Now it is the upstream's error, as the same error sent as an SSE ``error`` event is (529 overloaded)."""
    respx.post(URL).mock(return_value=httpx.Response(200, json=OVERLOADED))
    messages = [{"role": "user", "content": "hi"}]
    if face == "openai":
        request = chat_request(messages, model="claude")
    else:
        request = anthropic_request(
            {"model": "claude", "max_tokens": 5, "messages": messages}, stream=face == "anthropic-streamed"
        )
    with pytest.raises(UpstreamStreamCut, match="the upstream answered an error: Overloaded") as info:
        await drain(backend(http).stream(request))
    assert info.value.status_code == 529 and info.value.upstream_error["type"] == "overloaded_error"


@respx.mock
async def test_a_json_answer_to_a_streamed_call_that_is_no_error_is_named(http):
    respx.post(URL).mock(return_value=httpx.Response(200, json={"type": "message", "content": []}))
    with pytest.raises(UpstreamStreamCut, match="answered JSON where an event stream was asked for") as info:
        await drain(backend(http).stream(chat_request([{"role": "user", "content": "hi"}], model="claude")))
    assert (info.value.kind, info.value.status_code) == ("protocol", 502)
