"""The chat route's hot path against an OpenAI-compatible upstream on a real socket (the shared aiohttp-backed
client): no async generator of a request is left for the event loop's finalizer (each one costs a task and a
wake-up of the loop per request, docs/overhead.md session 6), streamed or not, and the upstream connection is
kept."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from gateway.config.loader import parse_config
from gateway.http.app import create_app
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub


@pytest.fixture(scope="module")
def stub():
    state = StubState("OAI")
    server = StubServer(openai_stub(state)).start()
    yield server, state
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_no_async_generator_is_left_to_the_loops_finalizer(stub, stream):
    server, state = stub
    config = parse_config(
        {"models": [{"name": "m", "backend": "openai", "base_url": f"{server.base_url}/v1", "api_key": "k"}]}
    )
    app = create_app(config)
    backend = app.state.gateway.registry.get("m")
    finalized: list[str] = []
    hooks = sys.get_asyncgen_hooks()

    def finalizer(agen):
        finalized.append(agen.__qualname__)
        hooks.finalizer(agen)

    sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)
    try:
        await backend.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
            for n in range(3):
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"question {n}"}],
                    "stream": stream,
                }
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200 and "OAI" in response.text
                await asyncio.sleep(0)  # what the finalizer would schedule runs now
        await backend.close()
    finally:
        sys.set_asyncgen_hooks(*hooks)
    assert finalized == []
    assert len(state.requests) >= 3
