"""A non-streamed request whose upstream answer broke off is asked again (``UpstreamBackend.stream``): its client
has seen nothing. A streamed one's cut, an error the upstream reported, and an unreadable answer are not."""

from __future__ import annotations

import json

import httpx
import pytest
import respx

from gateway.backends.anthropic_upstream import AnthropicUpstreamBackend
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.core.events import Delta, Finish
from gateway.core.tokens import TokenCounter
from gateway.protocols.anthropic.parse import parse_messages_body
from gateway.transport.failures import UpstreamStreamCut
from rules import load_ruleset
from tests.gateway.upstream_helpers import (
    API_KEY,
    BreakingStream,
    Sleeps,
    chat_request,
    drain,
    sse_body,
    sse_response,
)

BASES = ("http://replica-a:8000/v1", "http://replica-b:8000/v1")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


def chunk(delta=None, finish=None, usage=None):
    body = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "up-model"}
    body["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if usage is None else []
    if usage is not None:
        body["usage"] = usage
    return body


GOOD = sse_body(
    [
        chunk({"role": "assistant", "content": "Sunny"}),
        chunk({}, finish="stop"),
        chunk(usage={"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}),
    ]
)


def broken(error: Exception | None = None) -> httpx.Response:
    """An answer whose first chunk arrives and whose connection then resets."""
    first = sse_body([chunk({"role": "assistant", "content": "Rai"})], done=False)
    return httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        stream=BreakingStream([first], error or httpx.ReadError("connection reset")),
    )


@pytest.fixture
async def http():
    async with httpx.AsyncClient() as client:
        yield client


def openai_backend(http, retries=2, sleeps=None, **kwargs) -> OpenAIUpstreamBackend:
    return OpenAIUpstreamBackend(
        "gw-model",
        list(BASES),
        api_key=API_KEY,
        upstream_model="up-model",
        retries=retries,
        client=http,
        sleep=sleeps or Sleeps(),
        **kwargs,
    )


def routes(be, request):
    home, other = be.upstream.ring.ring_order(request.prefix_key)
    return home, other


@respx.mock
async def test_a_non_streamed_answer_that_broke_off_is_asked_again_on_another_replica(http):
    """A trial: a replica killed while generating a non-streamed answer was a 502, though another replica was
    up and the client had seen nothing."""
    sleeps = Sleeps()
    be = openai_backend(http, sleeps=sleeps)
    request = chat_request(MESSAGES, stream=False)
    home, other = routes(be, request)
    cut = respx.post(f"{home}/chat/completions").mock(return_value=broken())
    good = respx.post(f"{other}/chat/completions").mock(return_value=sse_response(GOOD))
    events = await drain(be.stream(request))
    assert [e.text for e in events if isinstance(e, Delta)] == ["Sunny"]  # nothing of the broken answer
    assert isinstance(events[-1], Finish) and events[-1].replica == other
    assert cut.call_count == 1 and good.call_count == 1 and len(sleeps.calls) == 1
    assert be.upstream.ring.snapshot()[home]["state"] == "down"
    assert be.upstream.ring.inflight == {home: 0, other: 0}


@respx.mock
async def test_a_streamed_answer_that_broke_off_is_not_asked_again(http):
    be = openai_backend(http)
    request = chat_request(MESSAGES, stream=True)
    home, other = routes(be, request)
    respx.post(f"{home}/chat/completions").mock(return_value=broken())
    good = respx.post(f"{other}/chat/completions").mock(return_value=sse_response(GOOD))
    seen = []
    with pytest.raises(UpstreamStreamCut):
        async for event in be.stream(request):
            seen.append(event)
    assert [e.text for e in seen] == ["Rai"] and good.call_count == 0  # the client has its first part


@respx.mock
async def test_an_answer_that_ends_before_its_final_chunk_is_asked_again(http):
    be = openai_backend(http)
    request = chat_request(MESSAGES, stream=False)
    home, other = routes(be, request)
    truncated = sse_body([chunk({"role": "assistant", "content": "Rai"})], done=False)
    respx.post(f"{home}/chat/completions").mock(return_value=sse_response(truncated))
    respx.post(f"{other}/chat/completions").mock(return_value=sse_response(GOOD))
    events = await drain(be.stream(request))
    assert events[-1].replica == other


@respx.mock
@pytest.mark.parametrize(
    "body",
    [
        sse_body([chunk({"content": "Rai"}), {"error": {"message": "engine died", "code": 500}}], done=False),
        b"data: {not json\n\n",
    ],
    ids=["the upstream's own error", "an unreadable answer"],
)
async def test_an_error_the_upstream_sent_or_an_unreadable_answer_is_not_asked_again(http, body):
    be = openai_backend(http)
    request = chat_request(MESSAGES, stream=False)
    home, other = routes(be, request)
    first = respx.post(f"{home}/chat/completions").mock(return_value=sse_response(body))
    good = respx.post(f"{other}/chat/completions").mock(return_value=sse_response(GOOD))
    with pytest.raises(UpstreamStreamCut):
        await drain(be.stream(request))
    assert first.call_count == 1 and good.call_count == 0


@respx.mock
async def test_the_asks_again_are_bounded_by_the_retry_policy(http):
    sleeps = Sleeps()
    be = openai_backend(http, retries=1, sleeps=sleeps)
    request = chat_request(MESSAGES, stream=False)
    calls = [respx.post(f"{base}/chat/completions").mock(side_effect=lambda _r: broken()) for base in BASES]
    with pytest.raises(UpstreamStreamCut) as info:
        await drain(be.stream(request))
    assert sum(route.call_count for route in calls) == 2 and len(sleeps.calls) == 1  # one ask, one ask again
    assert info.value.kind == "stream_cut" and info.value.status_code == 502
    assert all(n == 0 for n in be.upstream.ring.inflight.values())


@respx.mock
async def test_a_cache_aware_route_that_broke_off_is_not_credited_with_the_prompt(http):
    """The replica that broke off the answer (killed, as like as not) is not recorded as holding the prompt,
    so the conversation's next turn goes where it was served, not back to an empty restarted replica."""
    be = openai_backend(http, routing="cache_aware")
    policy = be.upstream.routing
    request = chat_request(MESSAGES, stream=False)
    answered = []

    def answer(http_request: httpx.Request) -> httpx.Response:
        replica = str(http_request.url).removesuffix("/chat/completions")
        answered.append(replica)
        return broken() if len(answered) == 1 else sse_response(GOOD)

    for base in BASES:
        respx.post(f"{base}/chat/completions").mock(side_effect=answer)
    events = await drain(be.stream(request))
    failed, served = answered
    assert failed != served and events[-1].replica == served
    assert policy.approx.size(failed) == 0 and policy.approx.size(served) > 0


WORDS = TokenCounter(count=lambda text: len(text.split()), counted_by="words")


def anthropic_sse(events: list[dict]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


MESSAGE_EVENTS = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 1},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
    {"type": "message_stop"},
]


@respx.mock
async def test_an_anthropic_message_that_broke_off_is_asked_again(http):
    bases = ("https://anthropic-a.test", "https://anthropic-b.test")
    be = AnthropicUpstreamBackend(
        "claude",
        list(bases),
        api_key=API_KEY,
        upstream_model="claude-sonnet-4-5",
        client=http,
        sleep=Sleeps(),
        counter=WORDS,
    )
    body = {"model": "claude", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    request = parse_messages_body(body)
    request.canonical = load_ruleset([]).apply(request.messages, request.tools)
    request.prefix_key = "cd" * 16
    home, other = be.upstream.ring.ring_order(request.prefix_key)
    first = anthropic_sse(MESSAGE_EVENTS[:3])
    respx.post(f"{home}/v1/messages").mock(
        return_value=httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=BreakingStream([first], httpx.RemoteProtocolError("peer closed connection")),
        )
    )
    respx.post(f"{other}/v1/messages").mock(return_value=sse_response(anthropic_sse(MESSAGE_EVENTS)))
    events = await drain(be.stream(request))
    message = events[0].events[0]
    assert message["content"] == [{"type": "text", "text": "Hello"}] and message["stop_reason"] == "end_turn"
    assert isinstance(events[-1], Finish) and events[-1].native
