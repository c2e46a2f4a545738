"""An upstream stream read to its terminal event (OpenAI ``[DONE]``, Anthropic ``message_stop``) gives its connection back to the pool
(``OpenedResponse.completed``); one closed early is cut."""

from __future__ import annotations

import httpx

from gateway.backends.anthropic_events import anthropic_events
from gateway.transport.affinity import AffinityRing
from gateway.transport.upstream_http import Upstream, open_response

BODY = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n", b""]


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.sent = 0
        self.closed = False

    async def __aiter__(self):
        for chunk in self.chunks:
            self.sent += 1
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


async def _opened(body: _Body):
    client = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, stream=body)),
    )
    upstream = Upstream(ring=AffinityRing(["http://up/v1"]), timeout=httpx.Timeout(5.0))

    def build(base_url: str) -> httpx.Request:
        return client.build_request("POST", f"{base_url}/chat/completions", content=b"{}")

    return client, await open_response(client, upstream, "key", build)


async def test_completed_stream_reads_the_rest_of_the_body_before_closing():
    body = _Body(BODY)
    client, opened = await _opened(body)
    events = []
    async for event in opened.events():  # as the OpenAI backend reads: up to [DONE]
        if event.data.strip() == "[DONE]":
            opened.completed()
            break
        events.append(event)
    assert body.sent == 2  # the empty tail chunk was not read yet
    await opened.aclose()
    assert body.sent == 3 and opened.response.is_stream_consumed
    assert opened.upstream.ring.snapshot()["http://up/v1"]["inflight"] == 0
    assert len(events) == 1
    await client.aclose()


async def test_a_stream_closed_early_is_not_read_further():
    body = _Body(BODY)
    client, opened = await _opened(body)
    await opened.aclose()  # never completed: e.g. the client left
    assert body.sent == 1 and body.closed
    assert opened.upstream.ring.snapshot()["http://up/v1"]["inflight"] == 0
    await client.aclose()


async def test_an_anthropic_stream_read_to_message_stop_keeps_its_connection():
    body = _Body(
        [
            b'event: message_start\ndata: {"type": "message_start"}\n\n',
            b'event: message_stop\ndata: {"type": "message_stop"}\n\n',
            b"",
        ]
    )
    client, opened = await _opened(body)
    types = [event["type"] async for event in anthropic_events(opened)]
    assert types == ["message_start", "message_stop"]
    await opened.aclose()
    assert body.sent == 3 and opened.response.is_stream_consumed
    await client.aclose()
