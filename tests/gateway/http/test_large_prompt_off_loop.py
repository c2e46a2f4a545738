"""A prompt over ``INLINE_CANONICALIZE_CHARS`` is canonicalized in a worker thread, a small one on the event loop, for
a completion and for a token count (a fresh-user trial: a 3.4 MB one-line JSON system prompt held the loop,
``/healthz`` included, for ~50 s)."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from gateway.core import prompt_size
from gateway.service import pipeline
from tests.gateway.server import RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    stub = StubServer(openai_stub(StubState("OAI"))).start()
    data = {
        "models": [{"name": "oa", "backend": "openai", "base_url": f"{stub.base_url}/v1", "api_key": "k"}]
    }
    server = RunningServer(write_config(tmp_path_factory.mktemp("big") / "prefixgate.yaml", data)).start()
    yield server
    server.stop()
    stub.stop()


def recording(fn, on_loop: list[bool]):
    """``fn``, appending to ``on_loop`` for each call whether it ran on an event loop's thread."""

    def wrapper(*args):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return fn(*args)

    return wrapper


def test_a_large_prompt_is_canonicalized_off_the_event_loop(gateway, monkeypatch):
    on_loop: list[bool] = []
    monkeypatch.setattr(pipeline, "canonicalize", recording(pipeline.canonicalize, on_loop))
    big = "Context: {" + ", ".join(f'"k{k}": "v", "now": "2025-03-03T10:00:00Z"' for k in range(3_000)) + "}"
    assert len(big) > prompt_size.INLINE_CANONICALIZE_CHARS
    with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0) as client:
        for system in ("You are brief. Current date: 2026-12-06.", big):
            answer = client.chat.completions.create(
                model="oa",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            )
            assert answer.choices[0].message.content
    assert on_loop == [True, False]
    on_loop.clear()  # count_tokens takes the same path
    with anthropic.Anthropic(base_url=gateway.base_url, api_key="x", max_retries=0) as client:
        for system in ("You are brief.", big):
            counted = client.messages.count_tokens(
                model="oa", system=system, messages=[{"role": "user", "content": "hi"}]
            )
            assert counted.input_tokens > 0
    assert on_loop == [True, False]


def test_a_large_prompt_is_tokenized_for_the_engine_off_the_event_loop(server, monkeypatch):
    """The embedded engine's tokenization of a prompt over ``INLINE_TOKENIZE_CHARS`` runs in a worker thread,
    for a completion and a token count (a fresh-user trial: a 3 MB prompt held ``/healthz`` for ~4 s while the
    engine tokenized it to refuse it)."""
    from engine.async_engine import AsyncEngine

    on_loop: list[bool] = []
    monkeypatch.setattr(AsyncEngine, "prompt_token_ids", recording(AsyncEngine.prompt_token_ids, on_loop))
    big = "word " * 8_000
    assert prompt_size.INLINE_TOKENIZE_CHARS < len(big) < 60_000  # under the server's body limit
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert answer.usage.prompt_tokens > 0
        with pytest.raises(openai.BadRequestError) as refused:  # 40,000 characters: over the context window
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": big}], max_tokens=2
            )
        assert refused.value.code == "context_length_exceeded"
    assert on_loop == [True, False]
    on_loop.clear()
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0) as client:
        for text in ("hi", big):
            counted = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": text}])
            assert counted.input_tokens > 0
    assert on_loop == [True, False]
