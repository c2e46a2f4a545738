"""Stub upstream servers on real sockets (uvicorn in a thread): an OpenAI-compatible one and an Anthropic one.

They are test doubles of a provider: they stream answers in the providers' wire format, emulate a provider
prompt cache (a prefix seen before is reported as cached), record every request, count requests in flight, and
can be told to fail (an HTTP status before the first byte, or a connection cut after it).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.upstream_helpers import fixture_bytes

CACHE_GRANULE = 128  # tokens: the stub caches prompts in 128-token steps, like OpenAI


class StubServer:
    """uvicorn serving an ASGI app on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> StubServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Shut down and close the listening socket: new connections are refused from now on."""
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


class StubState:
    """What a stub saw and what it is told to do (shared between the test and the server thread)."""

    def __init__(self, name: str, delay_s: float = 0.0) -> None:
        self.name = name
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.inflight = 0
        self.max_inflight = 0
        self.fail_next: list[int] = []  # statuses to answer before the first byte, one per request
        self.cut_next = 0  # requests to cut off after the first events
        self.seen_prefixes: set[str] = set()
        self.diagnostics: dict[str, Any] | None = None  # Anthropic ``diagnostics`` sent in ``message_delta``

    def enter(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[int | None, bool]:
        with self.lock:
            self.requests.append(body)
            self.headers.append(headers)
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            status = self.fail_next.pop(0) if self.fail_next else None
            cut = False
            if status is None and self.cut_next:
                self.cut_next -= 1
                cut = True
            return status, cut

    def leave(self) -> None:
        with self.lock:
            self.inflight -= 1

    def cached(self, prefix: str, prompt_tokens: int) -> int:
        """The provider-cache emulation: a prefix seen before is cached in whole granules."""
        with self.lock:
            hit = prefix in self.seen_prefixes
            self.seen_prefixes.add(prefix)
        return (prompt_tokens // CACHE_GRANULE) * CACHE_GRANULE if hit else 0


def fake_tokens(value: Any) -> int:
    """The stubs' token count: 1 token per 4 characters of the JSON (any deterministic count does)."""
    return max(len(json.dumps(value, ensure_ascii=False)) // 4, 1)


class CutConnection(Exception):
    """Raised inside a streaming body: uvicorn drops the connection mid-response."""


def openai_stub(state: StubState) -> Starlette:
    """``POST /v1/chat/completions``: streams ``served by <name>`` word by word, then usage."""

    async def chat(request: Request) -> Response:
        body = await request.json()
        status, cut = state.enter(body, dict(request.headers))
        if status is not None:
            state.leave()
            return JSONResponse(
                {"error": {"message": f"stub {state.name} failing", "type": "server_error"}},
                status,
                # Retry-After longer than the gateway waits; the provider's own id for its answer
                headers={"x-request-id": f"req_fail_{state.name}"}
                | ({"retry-after": "120"} if status == 429 else {}),
            )
        prompt_tokens = fake_tokens(body["messages"])
        key = body.get("prompt_cache_key") or json.dumps(body["messages"][:1])
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 3,
            "total_tokens": prompt_tokens + 3,
            "prompt_tokens_details": {"cached_tokens": state.cached(key, prompt_tokens)},
        }
        words = ["served", " by", f" {state.name}"]

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            data = {
                "id": "chatcmpl-stub",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(data)}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            try:
                await asyncio.sleep(state.delay_s)
                yield chunk({"role": "assistant", "content": ""})
                for i, word in enumerate(words):
                    if cut and i == 1:
                        raise CutConnection(state.name)
                    yield chunk({"content": word})
                yield chunk({}, "stop")
                if (body.get("stream_options") or {}).get("include_usage"):
                    final = {
                        "id": "chatcmpl-stub",
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "usage": usage,
                    }
                    yield f"data: {json.dumps(final)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                state.leave()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"x-request-id": f"req_{state.name}"}
        )

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def _anthropic_events(state: StubState, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The events of one answer: a recorded stream when the request asks for thinking, else text."""
    if body.get("thinking"):
        from gateway.transport.sse import parse_sse

        return [
            (e.event, json.loads(e.data))
            for e in parse_sse(fixture_bytes("anthropic", "stream-a-refusal.sse"))
        ]
    prompt_tokens = fake_tokens([body.get("system"), body["messages"], body.get("tools")])
    marked = "cache_control" in json.dumps(body)
    read = state.cached(json.dumps(body.get("system")), prompt_tokens) if marked else 0
    written = 0 if read or not marked else (prompt_tokens // CACHE_GRANULE) * CACHE_GRANULE
    usage = {
        "input_tokens": prompt_tokens - read - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
        "output_tokens": 1,
    }
    start = {
        "id": "msg_stub",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": body["model"],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    text = ["served", " by", f" {state.name}"]
    events = [("message_start", {"type": "message_start", "message": start})]
    events.append(
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )
    )
    events.append(("ping", {"type": "ping"}))
    for word in text:
        events.append(
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}},
            )
        )
    events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 3},
                **({"diagnostics": state.diagnostics} if state.diagnostics is not None else {}),
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def anthropic_stub(state: StubState) -> Starlette:
    """``POST /v1/messages``: a text answer (or a recorded thinking stream), with cache usage."""

    async def messages(request: Request) -> Response:
        body = await request.json()
        status, cut = state.enter(body, dict(request.headers))
        if status is not None:
            state.leave()
            kind = "overloaded_error" if status == 529 else "api_error"
            return JSONResponse(
                {"type": "error", "error": {"type": kind, "message": f"stub {state.name} says {kind}"}},
                status,
                headers={"request-id": f"req_fail_{state.name}"},
            )
        events = _anthropic_events(state, body)
        if not body.get("stream"):
            state.leave()
            start = events[0][1]["message"]
            content, blocks = [], {}
            for _, data in events:
                if data["type"] == "content_block_start":
                    blocks[data["index"]] = dict(data["content_block"])
                    content.append(blocks[data["index"]])
                elif data["type"] == "content_block_delta" and data["delta"]["type"] == "text_delta":
                    blocks[data["index"]]["text"] += data["delta"]["text"]
            final = events[-2][1]
            usage = {**start["usage"], "output_tokens": final["usage"]["output_tokens"]}
            return JSONResponse(
                {**start, "content": content, "stop_reason": final["delta"]["stop_reason"], "usage": usage}
            )

        async def stream() -> AsyncIterator[bytes]:
            try:
                for i, (name, data) in enumerate(events):
                    if cut and i == 4:
                        raise CutConnection(state.name)
                    yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            finally:
                state.leave()

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"request-id": f"req_{state.name}"}
        )

    return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])
