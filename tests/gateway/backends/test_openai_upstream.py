"""``backend: openai`` against respx-mocked OpenAI-compatible servers, with recorded OpenAI streams."""

from __future__ import annotations

import json

import httpx
import pytest
import respx

from engine.api import SamplingParams
from gateway.backends.openai_upstream import OpenAIUpstreamBackend, create_openai_backend
from gateway.backends.upstream import error_body
from gateway.config.schema import OpenAIUpstream, RingConfig
from gateway.core.events import Delta, Finish
from gateway.protocols.anthropic.parse import parse_messages_body
from gateway.protocols.anthropic.prompt import UnsupportedContentError
from gateway.protocols.openai.render import merge_tool_call_deltas
from gateway.transport.failures import UpstreamCallError, UpstreamStreamCut
from gateway.transport.upstream_http import join_url
from tests.gateway.upstream_helpers import (
    API_KEY,
    BreakingStream,
    Sleeps,
    chat_request,
    drain,
    fixture_bytes,
    sse_body,
    sse_response,
)

BASE = "http://vllm-a:8000/v1"
BASE_B = "http://vllm-b:8000/v1"
URL = f"{BASE}/chat/completions"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


def chunk(delta=None, finish=None, usage=None, choices=True):
    body = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "up-model"}
    body["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else []
    if usage is not None:
        body["usage"] = usage
    return body


CACHED_STREAM = sse_body(
    [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Sunny"}),
        chunk({"content": " and 21C."}),
        chunk({}, finish="stop"),
        chunk(
            choices=False,
            usage={
                "prompt_tokens": 2006,
                "completion_tokens": 300,
                "total_tokens": 2306,
                "prompt_tokens_details": {"cached_tokens": 1920},
            },
        ),
    ]
)


@pytest.fixture
async def http():
    async with httpx.AsyncClient() as client:
        yield client


def backend(http, urls=(BASE,), retries=2, sleeps=None, **kwargs) -> OpenAIUpstreamBackend:
    return OpenAIUpstreamBackend(
        "gw-model",
        list(urls),
        api_key=API_KEY,
        upstream_model="up-model",
        retries=retries,
        client=http,
        sleep=sleeps or Sleeps(),
        **kwargs,
    )


@respx.mock
async def test_recorded_parallel_tool_call_stream(http):
    respx.post(URL).mock(return_value=sse_response(fixture_bytes("openai", "f82268f2fefd.sse")))
    events = await drain(backend(http).stream(chat_request(MESSAGES)))
    assert all(isinstance(e, Delta) for e in events[:-1]) and isinstance(events[-1], Finish)
    calls: dict[int, dict] = {}
    for event in events[:-1]:
        merge_tool_call_deltas(calls, event.tool_calls or [])
    assert [c["function"]["name"] for c in calls.values()] == ["GetWeatherArgs", "get_stock_price"]
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Edinburgh",
        "country": "GB",
        "units": "c",
    }
    assert json.loads(calls[1]["function"]["arguments"]) == {"ticker": "AAPL", "exchange": "NASDAQ"}
    finish = events[-1]
    assert finish.finish_reason == "tool_calls"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens, finish.usage.cached_tokens) == (
        149,
        60,
        0,
    )
    assert finish.usage.counted_by == "upstream" and finish.replica == BASE


@respx.mock
async def test_request_body_headers_and_prompt_cache_key(http):
    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    body = {
        "model": "gw-model",
        "messages": [{"role": "user", "content": "original"}],
        "seed": 7,
        "response_format": {"type": "json_object"},
        "stream": False,
    }
    request = chat_request(MESSAGES, body=body, stream=False)
    await drain(backend(http).stream(request))
    sent = json.loads(route.calls.last.request.content)
    assert sent["messages"] == MESSAGES  # the canonical messages, not the original body's
    assert sent["model"] == "up-model" and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}  # always, whatever the client asked
    assert sent["seed"] == 7 and sent["response_format"] == {"type": "json_object"}
    assert sent["prompt_cache_key"] == request.prefix_key
    assert route.calls.last.request.headers["authorization"] == f"Bearer {API_KEY}"


@respx.mock
async def test_a_base_url_with_a_query_string_keeps_it_after_the_path(http):
    """A fresh-user trial: ``base_url: http://h/v1?apikey=X`` sent to ``/v1?apikey=X/chat/completions``."""
    route = respx.post("http://vllm-a:8000/v1/chat/completions", params={"api-version": "2024-10-21"}).mock(
        return_value=sse_response(CACHED_STREAM)
    )
    await drain(backend(http, urls=(f"{BASE}?api-version=2024-10-21",)).stream(chat_request(MESSAGES)))
    sent = route.calls.last.request.url
    assert (sent.path, sent.params["api-version"]) == ("/v1/chat/completions", "2024-10-21")


def test_join_url_puts_the_path_before_the_query():
    assert join_url("http://h:1/v1", "/chat/completions") == "http://h:1/v1/chat/completions"
    assert join_url("http://h/v1?a=1&b=2", "/m") == "http://h/v1/m?a=1&b=2"
    assert join_url("http://h/v1/?a=1", "/m") == "http://h/v1/m?a=1"
    assert join_url("http://h/v1#f", "/m") == "http://h/v1/m#f"


@respx.mock
async def test_client_prompt_cache_key_wins(http):
    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    body = {"model": "gw-model", "messages": MESSAGES, "prompt_cache_key": "mine"}
    await drain(backend(http).stream(chat_request(MESSAGES, body=body)))
    assert json.loads(route.calls.last.request.content)["prompt_cache_key"] == "mine"


@respx.mock
async def test_cached_tokens_pass_through_streamed(http):
    respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    events = await drain(backend(http).stream(chat_request(MESSAGES)))
    assert "".join(e.text for e in events[:-1]) == "Sunny and 21C."
    usage = events[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (2006, 300, 1920)


@respx.mock
async def test_cached_tokens_pass_through_from_a_json_answer(http):
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 1500,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 1280},
        },
    }
    respx.post(URL).mock(return_value=httpx.Response(200, json=completion))
    events = await drain(backend(http).stream(chat_request(MESSAGES, stream=False)))
    assert [e.text for e in events[:-1]] == ["Hi!"]
    assert events[-1].usage.cached_tokens == 1280 and events[-1].finish_reason == "stop"


@respx.mock
async def test_a_server_without_usage_is_counted_and_says_so(http):
    body = sse_body([chunk({"content": "hello there"}), chunk({}, finish="stop")])
    respx.post(URL).mock(return_value=sse_response(body))
    events = await drain(backend(http).stream(chat_request(MESSAGES)))
    usage = events[-1].usage
    assert usage.counted_by == "tiktoken:cl100k_base"
    assert usage.completion_tokens == 2 and usage.prompt_tokens > 10 and usage.cached_tokens == 0


@respx.mock
async def test_vllm_stop_reason_becomes_the_stop_sequence(http):
    stop = {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "\n\n"}]}
    respx.post(URL).mock(return_value=sse_response(sse_body([chunk({"content": "a"}), stop])))
    events = await drain(backend(http).stream(chat_request(MESSAGES)))
    assert events[-1].stop_sequence == "\n\n"


@respx.mock
async def test_completion_requests_go_to_completions(http):
    route = respx.post(f"{BASE}/completions").mock(
        return_value=sse_response(
            sse_body(
                [
                    {"choices": [{"index": 0, "text": "Once", "finish_reason": None}]},
                    {"choices": [{"index": 0, "text": " upon", "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
                ]
            )
        )
    )
    request = chat_request([], kind="completion", prompt="Tell a story:", params=SamplingParams(max_tokens=2))
    events = await drain(backend(http).stream(request))
    sent = json.loads(route.calls.last.request.content)
    assert sent["prompt"] == "Tell a story:" and sent["max_tokens"] == 2 and "messages" not in sent
    assert "".join(e.text for e in events[:-1]) == "Once upon" and events[-1].finish_reason == "length"


# ---- faults ----------------------------------------------------------------------------------------------


@respx.mock
async def test_5xx_and_connection_errors_are_retried_before_the_first_byte(http):
    sleeps = Sleeps()
    route = respx.post(URL).mock(
        side_effect=[
            httpx.Response(503, json={"error": {"message": "loading"}}),
            httpx.ConnectError("connection refused"),
            sse_response(CACHED_STREAM),
        ]
    )
    be = backend(http, retries=2, sleeps=sleeps)
    events = await drain(be.stream(chat_request(MESSAGES)))
    assert route.call_count == 3 and len(sleeps.calls) == 2
    assert isinstance(events[-1], Finish)
    assert {k: be.upstream.ring.snapshot()[BASE][k] for k in ("state", "inflight", "failures")} == {
        "state": "up",
        "inflight": 0,
        "failures": 0,
    }


@respx.mock
async def test_429_waits_for_retry_after(http):
    sleeps = Sleeps()
    route = respx.post(URL).mock(
        side_effect=[
            httpx.Response(429, headers={"retry-after": "3"}, json={"error": {"message": "slow down"}}),
            sse_response(CACHED_STREAM),
        ]
    )
    await drain(backend(http, sleeps=sleeps).stream(chat_request(MESSAGES)))
    assert route.call_count == 2 and sleeps.calls[0] >= 3.0


@respx.mock
async def test_retry_after_waits_are_bounded_in_all_per_request(http):
    """A fresh-user trial: ``Retry-After: 25`` was waited out twice (50 s) before the 429 went to the client
    anyway. The waits of one request are bounded in all (``RetryPolicy.max_retry_after_s``, 30 s): the second
    25 s is not waited, the 429 goes out with its ``Retry-After``."""
    sleeps = Sleeps()
    limited = httpx.Response(429, headers={"retry-after": "25"}, json={"error": {"message": "slow down"}})
    route = respx.post(URL).mock(side_effect=[limited, limited, sse_response(CACHED_STREAM)])
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http, retries=2, sleeps=sleeps).stream(chat_request(MESSAGES)))
    assert route.call_count == 2 and sleeps.calls == [25.0]
    assert (info.value.status_code, info.value.retry_after_s) == (429, 25.0)


@respx.mock
async def test_retry_after_ms_is_read_before_retry_after(http):
    sleeps = Sleeps()
    route = respx.post(URL).mock(
        side_effect=[
            httpx.Response(
                429,
                headers={"retry-after-ms": "1500", "retry-after": "9"},
                json={"error": {"message": "wait"}},
            ),
            httpx.Response(429, headers={"retry-after-ms": "40000"}, json={"error": {"message": "wait"}}),
        ]
    )
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http, retries=2, sleeps=sleeps).stream(chat_request(MESSAGES)))
    assert route.call_count == 2 and sleeps.calls[0] >= 1.5 and sleeps.calls[0] < 9
    assert info.value.retry_after_s == 40.0  # over the bound: at once, the client told to wait 40 s


@respx.mock
async def test_retries_exhausted_give_a_typed_error(http):
    route = respx.post(URL).mock(side_effect=httpx.ReadTimeout("read timed out"))
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http, retries=2).stream(chat_request(MESSAGES)))
    assert route.call_count == 3
    error = info.value
    assert (error.status_code, error.kind, error.code) == (504, "timeout", "upstream_timeout")
    assert error.openai_body()["error"]["type"] == "server_error"


@respx.mock
@pytest.mark.parametrize(
    ("failure", "expected", "retried"),
    [
        (httpx.ConnectTimeout("connect timed out"), (504, "timeout"), True),
        (httpx.ConnectError(f"refused while sending {API_KEY}"), (502, "connection"), True),
        (httpx.RemoteProtocolError("peer closed"), (502, "connection"), True),
        (httpx.UnsupportedProtocol("no such scheme"), (502, "protocol"), False),
        (httpx.LocalProtocolError("bad header"), (502, "protocol"), False),
    ],
)
async def test_transport_failures_are_typed_and_redacted(http, failure, expected, retried):
    route = respx.post(URL).mock(side_effect=failure)
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http, retries=1).stream(chat_request(MESSAGES)))
    assert (info.value.status_code, info.value.kind) == expected
    assert route.call_count == (2 if retried else 1) and API_KEY not in info.value.message


@respx.mock
async def test_4xx_is_not_retried_and_passes_through_with_the_key_redacted(http):
    upstream_error = {
        "error": {
            "message": "This model's maximum context length is 4096 tokens "
            f"(request sent with key {API_KEY}).",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    route = respx.post(URL).mock(return_value=httpx.Response(400, json=upstream_error))
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http).stream(chat_request(MESSAGES)))
    assert route.call_count == 1
    error = info.value
    assert (error.status_code, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert API_KEY not in error.message and API_KEY not in json.dumps(error.openai_body())
    assert API_KEY not in json.dumps(error.upstream_error)


@pytest.mark.parametrize("status", [401, 403])
@respx.mock
async def test_the_upstream_refusing_the_gateway_key_is_a_502_not_the_clients_401(http, status):
    upstream_error = {
        "error": {
            "message": f"Incorrect API key provided: {API_KEY}.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    route = respx.post(URL).mock(return_value=httpx.Response(status, json=upstream_error))
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http).stream(chat_request(MESSAGES)))
    error = info.value
    assert route.call_count == 1 and not error.retryable
    assert (error.status_code, error.kind, error.code, error.error_type) == (
        502,
        "upstream_auth",
        "upstream_auth_failed",
        "server_error",
    )
    assert "refused the gateway's credentials" in error.message and "check api_key" in error.message
    assert API_KEY not in error.message and API_KEY not in json.dumps(error.openai_body())


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(404, text="Not Found"),  # a base_url without /v1: the server's own 404 page
        httpx.Response(404, json={"detail": "Not Found"}),
        httpx.Response(
            404,
            json={
                "error": {
                    "message": "The model `gpt-4o-mini` does not exist",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "model_not_found",
                }
            },
        ),
    ],
)
@respx.mock
async def test_an_upstream_404_is_the_gateways_config_a_502_naming_it(http, answer):
    route = respx.post(URL).mock(return_value=answer)
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http).stream(chat_request(MESSAGES)))
    error = info.value
    assert route.call_count == 1 and not error.retryable
    assert (error.status_code, error.kind, error.code, error.error_type) == (
        502,
        "upstream_not_found",
        "upstream_not_found",
        "server_error",
    )
    assert "answered 404" in error.message and "base_url" in error.message and error.upstream_error is None


@respx.mock
async def test_a_stream_cut_after_the_first_byte_is_not_retried(http):
    first = sse_body([chunk({"content": "Sun"})], done=False)
    route = respx.post(URL).mock(
        return_value=httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=BreakingStream([first], httpx.ReadError("connection reset")),
        )
    )
    be = backend(http)
    seen = []
    with pytest.raises(UpstreamStreamCut) as info:
        async for event in be.stream(chat_request(MESSAGES)):
            seen.append(event)
    assert [e.text for e in seen] == ["Sun"] and route.call_count == 1
    assert info.value.kind == "stream_cut" and info.value.status_code == 502
    assert be.upstream.ring.snapshot()[BASE]["state"] == "down"  # a reset counts against the replica
    assert be.upstream.ring.inflight[BASE] == 0


@respx.mock
async def test_a_stream_that_ends_early_is_a_cut(http):
    respx.post(URL).mock(return_value=sse_response(sse_body([chunk({"content": "Sun"})], done=False)))
    with pytest.raises(UpstreamStreamCut, match="ended before its final chunk"):
        await drain(backend(http).stream(chat_request(MESSAGES)))


@respx.mock
async def test_an_error_chunk_mid_stream_is_a_cut(http):
    body = sse_body(
        [chunk({"content": "Sun"}), {"error": {"message": "engine died", "code": 500}}], done=False
    )
    respx.post(URL).mock(return_value=sse_response(body))
    with pytest.raises(UpstreamStreamCut) as info:
        await drain(backend(http).stream(chat_request(MESSAGES)))
    assert "engine died" in info.value.message


@respx.mock
async def test_failover_to_the_next_replica(http):
    be = backend(http, urls=(BASE, BASE_B))
    request = chat_request(MESSAGES)
    home, other = be.upstream.ring.ring_order(request.prefix_key)
    respx.post(f"{home}/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
    good = respx.post(f"{other}/chat/completions").mock(return_value=sse_response(CACHED_STREAM))
    events = await drain(be.stream(request))
    assert good.call_count == 1 and events[-1].replica == other
    assert be.upstream.ring.snapshot()[home]["state"] == "down"


# ---- Anthropic-face requests (translated) ------------------------------------------------------------------


@respx.mock
async def test_anthropic_face_request_is_translated(http):
    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    body = {
        "model": "gw-model",
        "max_tokens": 100,
        "system": [
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "c2ln"},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"}],
            },
        ],
        "tools": [
            {"name": "weather", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "metadata": {"user_id": "u-1"},
    }
    request = parse_messages_body(body)
    request.prefix_key = "ab" * 16
    await drain(backend(http).stream(request))
    sent = json.loads(route.calls.last.request.content)
    assert sent["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
    ]
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]
    assert sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is False
    assert sent["stop"] == ["END"] and sent["temperature"] == 0.2 and sent["max_tokens"] == 100
    assert sent["user"] == "u-1" and "top_p" not in sent


async def test_anthropic_only_blocks_are_refused_for_openai_servers(http):
    body = {
        "model": "gw-model",
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}
        ],
    }
    with pytest.raises(UnsupportedContentError) as info:
        await drain(backend(http).stream(parse_messages_body(body)))
    assert info.value.status_code == 400 and info.value.param == "messages[0].content[0]"


def test_factory_reads_the_model_entry():
    model = OpenAIUpstream(
        name="gpt",
        base_url=(BASE, BASE_B),
        api_key=API_KEY,
        upstream_model="gpt-4o-mini",
        timeout_s=12.0,
        retries=4,
    )
    be = create_openai_backend(model)
    assert be.upstream_model == "gpt-4o-mini" and be.upstream.policy.retries == 4
    assert be.upstream.timeout.read == 12.0 and set(be.upstream.ring.replicas) == {BASE, BASE_B}
    assert API_KEY not in json.dumps(be.replicas())


@respx.mock
@pytest.mark.usefixtures("respx_upstreams")
async def test_factory_passes_prompt_cache_key_and_ring_settings():
    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    model = OpenAIUpstream(
        name="gpt",
        base_url=(BASE,),
        prompt_cache_key=False,
        ring=RingConfig(load_factor=1.5, vnodes=7, cooldown_s=2.0, max_cooldown_s=9.0),
    )
    be = create_openai_backend(model)
    ring = be.upstream.ring
    assert (ring.load_factor, ring.vnodes, ring.cooldown_s, ring.max_cooldown_s) == (1.5, 7, 2.0, 9.0)
    try:
        await drain(be.stream(chat_request(MESSAGES)))
    finally:
        await be.close()
    assert "prompt_cache_key" not in json.loads(route.calls.last.request.content)


@respx.mock
@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (b"data: {oops\n\n", "a chunk that is not JSON"),
        (b'data: "text"\n\n', "a chunk that is not a JSON object"),
        (b'data: {"choices": ["x"]}\n\n', "a chunk that is not a completion chunk"),
        (b'data: {"choices": [{"delta": {"content": 5}}]}\n\n', "a chunk that is not a completion chunk"),
        (b'data: {"choices": [{"delta": "hi"}]}\n\n', "a chunk that is not a completion chunk"),
    ],
)
async def test_unreadable_chunks_are_protocol_cuts(http, stream, message):
    respx.post(URL).mock(return_value=sse_response(stream))
    with pytest.raises(UpstreamStreamCut, match=message) as info:
        await drain(backend(http).stream(chat_request(MESSAGES)))
    assert info.value.kind == "protocol"


def test_a_header_error_never_quotes_the_key():
    from gateway.transport.failures import transport_failure
    from gateway.transport.redact import redact

    key = "hunter2-secret\n"
    exc = httpx.LocalProtocolError(f"Illegal header value {('Bearer ' + key).encode()!r}")
    status, kind, message = transport_failure(exc, "http://vllm-a:8000/v1")
    assert (
        (status, kind) == (502, "protocol") and "hunter2" not in message and "LocalProtocolError" in message
    )
    # and redact() removes a key in the forms an exception text shows it: verbatim, stripped, repr-escaped
    for shown in (key, key.strip(), "hunter2-secret\\n"):
        assert "hunter2" not in redact(f"boom: {shown!s}", [key])


@respx.mock
async def test_a_replica_url_httpx_cannot_parse_is_a_typed_error_and_releases_its_lease(http):
    url = "http://user:s3cret-pass@[::1"
    be = backend(http, urls=(url,), retries=0)
    with pytest.raises(UpstreamCallError) as info:
        await drain(be.stream(chat_request(MESSAGES)))
    assert (info.value.status_code, info.value.kind) == (502, "protocol")
    assert "s3cret-pass" not in info.value.message and "cannot be parsed" in info.value.message
    assert be.upstream.ring.inflight[url] == 0


@respx.mock
async def test_a_body_that_cannot_be_decoded_is_a_typed_502(http):
    bad_gzip = {"content-encoding": "gzip", "content-type": "application/json"}
    route = respx.post(URL).mock(
        return_value=httpx.Response(200, headers=bad_gzip, stream=httpx.ByteStream(b"not gzip at all"))
    )
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http, retries=1).stream(chat_request(MESSAGES)))
    assert (info.value.status_code, info.value.kind, route.call_count) == (502, "protocol", 1)


@respx.mock
async def test_a_redirect_is_a_502_naming_the_location_not_a_success(http):
    moved = httpx.Response(301, headers={"location": "https://vllm-a:8000/v1/chat/completions"})
    route = respx.post(URL).mock(return_value=moved)
    be = backend(http, retries=2)
    with pytest.raises(UpstreamCallError) as info:
        await drain(be.stream(chat_request(MESSAGES)))
    error = info.value
    assert (error.status_code, error.kind, route.call_count) == (502, "protocol", 1)
    assert "answered 301 (Location: https://vllm-a:8000/v1/chat/completions); check base_url" in error.message
    assert {k: be.upstream.ring.snapshot()[BASE][k] for k in ("state", "inflight", "failures")} == {
        "state": "up",
        "inflight": 0,
        "failures": 0,
    }


@respx.mock
async def test_an_upstream_504_is_a_retried_504(http):
    route = respx.post(URL).mock(return_value=httpx.Response(504, json={"error": "gateway timeout"}))
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http, retries=1).stream(chat_request(MESSAGES)))
    assert (info.value.status_code, info.value.kind, route.call_count) == (504, "timeout", 2)


@respx.mock
@pytest.mark.parametrize(
    "answer",
    [{"choices": [{"message": "hi"}]}, {"choices": [{"message": {"content": ["a"]}}]}, {"choices": ["x"]}],
)
async def test_a_json_answer_not_shaped_like_a_completion_is_a_protocol_cut(http, answer):
    respx.post(URL).mock(return_value=httpx.Response(200, json=answer))
    with pytest.raises(
        UpstreamStreamCut, match="the upstream answered JSON that is not a completion"
    ) as info:
        await drain(backend(http).stream(chat_request(MESSAGES)))
    assert (info.value.kind, info.value.status_code) == ("protocol", 502)


@respx.mock
async def test_a_string_error_mid_stream_keeps_its_text(http):
    respx.post(URL).mock(
        return_value=sse_response(sse_body([chunk({"content": "Sun"}), {"error": "boom"}], done=False))
    )
    with pytest.raises(UpstreamStreamCut, match="the upstream reported an error mid-stream: boom"):
        await drain(backend(http).stream(chat_request(MESSAGES)))


@respx.mock
@pytest.mark.parametrize(
    ("params", "param"), [(SamplingParams(n=2), "n"), (SamplingParams(logprobs=0), "logprobs")]
)
async def test_choices_and_logprobs_are_refused_before_any_call(http, params, param):
    from gateway.core.errors import InvalidRequestError

    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    with pytest.raises(InvalidRequestError) as caught:
        await drain(backend(http).stream(chat_request(MESSAGES, params=params)))
    assert (caught.value.status_code, caught.value.param) == (400, param) and not route.called


@respx.mock
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
        ({"thinking": {"type": "adaptive", "budget_tokens": 5}}, "thinking"),
        ({"container": "container_1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "https://mcp.test", "name": "m"}]}, "mcp_servers"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management"),
        ({"inference_geo": "us"}, "inference_geo"),
    ],
)
async def test_anthropic_only_fields_are_400s_not_dropped(http, fields, param):
    """Before: ``thinking: enabled`` (and the others) were dropped and the request answered 200."""
    from gateway.core.errors import APIError

    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    body = {"model": "gw-model", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(APIError) as info:
        await drain(backend(http).stream(parse_messages_body(body)))
    assert (info.value.status_code, info.value.param) == (400, param)
    assert info.value.message.startswith(f"{param}: ") and "OpenAI-compatible upstream" in info.value.message
    assert route.call_count == 0


@respx.mock
async def test_neutral_anthropic_only_fields_are_served(http):
    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    body = {
        "model": "gw-model",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
        "service_tier": "auto",
        "cache_control": {"type": "ephemeral"},
        "mcp_servers": [],
    }
    await drain(backend(http).stream(parse_messages_body(body)))
    sent = json.loads(route.calls.last.request.content)
    assert not {"thinking", "service_tier", "cache_control", "mcp_servers"} & set(sent)
    # Claude Code's defaults (before: each a 400): adaptive thinking, an effort hint, clearing thinking blocks
    body |= {
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    await drain(backend(http).stream(parse_messages_body(body)))
    sent = json.loads(route.calls.last.request.content)
    assert not {"thinking", "output_config", "context_management"} & set(sent)


# ---- Anthropic structured outputs -> response_format json_schema -------------------------------------------

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@respx.mock
@pytest.mark.parametrize(
    "fields",
    [
        {"output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}},
        {"output_format": {"type": "json_schema", "schema": ANSWER_SCHEMA}},  # the deprecated beta form
    ],
)
async def test_anthropic_output_format_goes_as_a_strict_json_schema_response_format(http, fields):
    """Before: a 400 (``output_config`` / ``output_format`` were Anthropic-only). Anthropic always enforces its
    format, so the upstream is asked for ``strict`` json_schema; the schema goes byte for byte."""
    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    body = {
        "model": "gw-model",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "Yes?"}],
        **fields,
    }
    await drain(backend(http, set_prompt_cache_key=False).stream(parse_messages_body(body)))
    sent = json.loads(route.calls.last.request.content)
    assert sent == {
        "messages": [{"role": "user", "content": "Yes?"}],
        "max_tokens": 10,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": ANSWER_SCHEMA, "strict": True},
        },
        "model": "up-model",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert route.calls.last.request.headers["authorization"] == f"Bearer {API_KEY}"


@respx.mock
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "output_format": {"type": "json_schema", "schema": ANSWER_SCHEMA},
                "output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}},
            },
            "output_format",
        ),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
        ({"output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}, "effort": 1}},
         "output_config.effort"),
    ],
)  # fmt: skip
async def test_an_anthropic_output_format_the_upstream_cannot_take_is_a_400(http, fields, param):
    from gateway.core.errors import APIError

    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    body = {"model": "gw-model", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(APIError) as info:
        await drain(backend(http).stream(parse_messages_body(body)))
    assert (info.value.status_code, info.value.param) == (400, param)
    assert route.call_count == 0


@respx.mock
@pytest.mark.parametrize(
    ("answer", "status", "kind"),
    [
        (
            {"error": {"message": "upstream says no", "type": "invalid_request_error"}},
            400,
            "invalid_request_error",
        ),
        ({"error": "upstream says no"}, 502, "api_error"),
        (
            {"object": "error", "message": "upstream says no", "type": "BadRequestError", "code": 400},
            502,
            "BadRequestError",
        ),
    ],
)
async def test_an_error_answered_as_json_with_200_keeps_the_upstreams_words(http, answer, status, kind):
    """Before: "the upstream answered JSON that is not a completion" (a protocol 502, the upstream's words lost)."""
    respx.post(URL).mock(return_value=httpx.Response(200, json=answer))
    with pytest.raises(UpstreamStreamCut, match="the upstream answered an error: upstream says no") as info:
        await drain(backend(http).stream(chat_request(MESSAGES)))
    assert info.value.status_code == status and info.value.upstream_error["type"] == kind


@pytest.mark.parametrize(
    "data",
    [None, [], "error", {"choices": []}, {"type": "message", "content": []}, {"object": "chat.completion"}],
)
def test_an_answer_that_is_no_error_is_not_taken_for_one(data):
    assert error_body(data) is None


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("empty", ["", None, [{"type": "text", "text": ""}]])
def test_a_system_message_the_rules_emptied_is_not_sent(http, protocol, empty):
    messages = [
        {"role": "system", "content": empty},
        {"role": "user", "content": "<request_context>\nCurrent date: 2026-12-05\n</request_context>\n\nHi"},
    ]
    client = {"model": "gw-model", "messages": messages} if protocol == "openai" else None
    body = backend(http).build_body(chat_request(messages, protocol=protocol, body=client))
    assert [m["role"] for m in body["messages"]] == ["user"]
    kept = [{"role": "system", "content": "You are terse."}, *messages[1:]]
    request = chat_request(kept, protocol=protocol, body=client)
    assert backend(http).build_body(request)["messages"][0]["content"] == "You are terse."
    if protocol == "openai":  # nothing to drop: the request's own list is sent (no copy)
        assert backend(http).build_body(request)["messages"] is request.messages


@respx.mock
async def test_the_upstreams_request_id_is_kept_for_the_log_and_the_client(http):
    route = respx.post(URL).mock(
        return_value=httpx.Response(
            200,
            headers={"content-type": "text/event-stream", "x-request-id": "req_up_123"},
            content=sse_body(
                [
                    chunk({"content": "Hi"}),
                    chunk(finish="stop", usage={"prompt_tokens": 3, "completion_tokens": 1}),
                ]
            ),
        )
    )
    request = chat_request(MESSAGES)
    await drain(backend(http).stream(request))
    assert route.call_count == 1 and request.upstream_request_id == "req_up_123"
    respx.post(URL).mock(
        return_value=httpx.Response(500, headers={"x-request-id": "req_up_500"}, text="boom")
    )
    with pytest.raises(UpstreamCallError) as info:
        await drain(backend(http, retries=0).stream(chat_request(MESSAGES)))
    assert "its request id req_up_500" in info.value.message
