"""Errors after a response started, and backend bookkeeping, through the real server with scripted
backends."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.api import SamplingParams
from engine.errors import SamplingError
from gateway.backends.base import Backend
from gateway.config.loader import parse_config
from gateway.core.errors import UpstreamError
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.transport.sse import parse_sse
from tests.gateway.server import RunningServer


class ScriptedBackend(Backend):
    """Yields the scripted events; an exception in the script is raised at that point. Counts closes."""

    def __init__(self, name: str, script: list) -> None:
        self.name = name
        self.script = script
        self.started = self.closed = 0
        self.streams_closed = 0
        self.seen = []

    async def start(self) -> None:
        self.started += 1

    async def close(self) -> None:
        self.closed += 1

    async def stream(self, request):
        self.seen.append(request)
        try:
            for item in self.script:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.streams_closed += 1


USAGE = BackendUsage(prompt_tokens=10, completion_tokens=2, cached_tokens=0, counted_by="upstream")


@pytest.fixture
def scripted():
    backends = {
        "ok": ScriptedBackend(
            "ok",
            [
                Delta("a"),
                Delta(
                    tool_calls=[
                        {
                            "index": 0,
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": ""},
                        }
                    ]
                ),
                Delta(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]),
                Finish("tool_calls", USAGE),
            ],
        ),
        "fails": ScriptedBackend("fails", [Delta("a"), UpstreamError("upstream went away")]),
        "crashes": ScriptedBackend("crashes", [Delta("a"), RuntimeError("bug")]),
        "early": ScriptedBackend("early", [UpstreamError("no replica")]),
        "sampling": ScriptedBackend(
            "sampling", [Delta("a"), SamplingError("req#1", "RuntimeError: probability tensor contains nan")]
        ),
    }
    config = parse_config(
        {
            "rules": [],
            "models": [{"name": n, "backend": "openai", "base_url": "http://unused"} for n in backends],
        }
    )
    server = RunningServer(config, backends=backends).start()
    yield server, backends
    server.stop()
    assert all(b.started == 1 and b.closed == 1 for b in backends.values())


def post(server, model: str, stream: bool):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)


def test_tool_call_deltas_stream_and_merge(scripted):
    server, backends = scripted
    whole = post(server, "ok", False).json()
    message = whole["choices"][0]["message"]
    assert message["content"] == "a" and message["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    events = parse_sse(post(server, "ok", True).content)
    deltas = [json.loads(e.data)["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[1] == {"content": "a"} and deltas[2]["tool_calls"][0]["id"] == "c1"
    assert backends["ok"].streams_closed == 2
    assert isinstance(backends["ok"].seen[0].params, SamplingParams) and backends["ok"].seen[0].prefix_key


def test_error_after_the_stream_started_is_an_error_event(scripted):
    server, backends = scripted
    response = post(server, "fails", True)
    assert response.status_code == 200
    events = parse_sse(response.content)
    assert json.loads(events[1].data)["choices"][0]["delta"] == {"content": "a"}
    error = json.loads(events[-1].data)["error"]
    assert (error["code"], error["message"]) == ("upstream_error", "upstream went away")
    assert all(e.data != "[DONE]" for e in events)
    crash = json.loads(parse_sse(post(server, "crashes", True).content)[-1].data)["error"]
    assert crash["type"] == "server_error" and "RuntimeError" in crash["message"]
    stats = server.stats()
    assert stats["errors"] == {"500": 1, "502": 1}
    assert stats["models"]["fails"]["requests"] == 0 and stats["models"]["fails"]["errors"] == {"502": 1}
    assert backends["fails"].streams_closed == 1 and backends["crashes"].streams_closed == 1


def test_errors_before_any_output_are_http_errors(scripted):
    server, backends = scripted
    for stream in (False, True):
        response = post(server, "early", stream)
        assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error"
    non_stream = post(server, "fails", False)
    assert non_stream.status_code == 502 and non_stream.json()["error"]["message"] == "upstream went away"
    assert backends["early"].streams_closed == 2 and backends["fails"].streams_closed == 1
    assert server.stats()["errors"] == {"502": 3}


def test_anthropic_face_error_after_the_stream_started_is_an_error_event(scripted):
    server, backends = scripted
    body = {
        "model": "fails",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    events = parse_sse(httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=30).content)
    assert [e.event for e in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "error",
    ]  # fmt: skip
    assert json.loads(events[-1].data) == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream went away"},
    }
    crash = parse_sse(httpx.post(f"{server.base_url}/v1/messages", json={**body, "model": "crashes"}).content)
    error = json.loads(crash[-1].data)["error"]
    assert crash[-1].event == "error" and error["type"] == "api_error" and "RuntimeError" in error["message"]
    assert server.stats()["errors"] == {"500": 1, "502": 1}
    assert backends["fails"].streams_closed == 1 and backends["crashes"].streams_closed == 1


def test_a_sampling_failure_after_the_stream_started_is_a_named_error_event(scripted):
    # the embedded engine ends one request whose sampling failed (engine.errors.SamplingError); mid-stream the
    # client hears it in-band, in each face's error shape, and the gateway counts a 400
    server, backends = scripted
    response = post(server, "sampling", True)
    assert response.status_code == 200
    events = parse_sse(response.content)
    assert json.loads(events[1].data)["choices"][0]["delta"] == {"content": "a"}
    error = json.loads(events[-1].data)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "sampling_failed")
    assert "RuntimeError" in error["message"]
    body = {
        "model": "sampling",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    events = parse_sse(httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=30).content)
    assert events[-1].event == "error"
    assert json.loads(events[-1].data)["error"]["type"] == "invalid_request_error"
    assert server.stats()["errors"] == {"400": 2}
    assert backends["sampling"].streams_closed == 2
