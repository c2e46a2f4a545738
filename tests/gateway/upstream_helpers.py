"""Helpers for the upstream backend tests: recorded fixtures, requests, fake sleeps, breaking streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx

from engine.api import SamplingParams
from gateway.core.request import ChatRequest, given_sampling
from gateway.protocols.anthropic.parse import parallel_tool_calls as anthropic_parallel_tool_calls

FIXTURES = Path(__file__).parent / "fixtures" / "protocol"
API_KEY = "sk-test-upstream-key-0123456789abcdef"


def fixture_bytes(kind: str, name: str) -> bytes:
    """A recorded stream from ``tests/gateway/fixtures/protocol/<kind>/<name>``."""
    return (FIXTURES / kind / name).read_bytes()


def sse_response(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(
        status, content=body, headers={"content-type": "text/event-stream", **(headers or {})}
    )


def sse_body(chunks: list[Any], done: bool = True, event_names: bool = False) -> bytes:
    """``data: <json>`` events (``event: <type>`` lines too when asked), then ``data: [DONE]``."""
    out = []
    for chunk in chunks:
        head = f"event: {chunk['type']}\n" if event_names else ""
        out.append(f"{head}data: {json.dumps(chunk)}\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


class BreakingStream(httpx.AsyncByteStream):
    """A response body that yields ``chunks`` and then fails with ``error`` (a reset after the first byte)."""

    def __init__(self, chunks: list[bytes], error: Exception) -> None:
        self.chunks = chunks
        self.error = error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise self.error

    async def aclose(self) -> None:
        return None


class Sleeps:
    """Records backoff sleeps instead of sleeping."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def chat_request(
    messages: list[dict[str, Any]],
    *,
    model: str = "gw-model",
    body: dict[str, Any] | None = None,
    protocol: Literal["openai", "anthropic"] = "openai",
    tools: list[dict[str, Any]] | None = None,
    stream: bool = True,
    prefix_key: str = "0123456789abcdef0123456789abcdef",
    params: SamplingParams | None = None,
    **kwargs: Any,
) -> ChatRequest:
    return ChatRequest(
        model=model,
        messages=messages,
        params=params or SamplingParams(max_tokens=64),
        tools=tools,
        stream=stream,
        **_client_body(protocol, body if body is not None else {}),
        prefix_key=prefix_key,
        request_id="req0123456789",
        **kwargs,
    )


def _client_body(protocol: Literal["openai", "anthropic"], body: dict[str, Any]) -> dict[str, Any]:
    """The ``ChatRequest`` fields the face of ``protocol`` sets from a client body."""
    if protocol == "anthropic":
        parallel = anthropic_parallel_tool_calls(body)
        return {
            "anthropic_body": body,
            "sampling_given": given_sampling(body),
            "parallel_tool_calls": parallel,
        }
    parallel = body.get("parallel_tool_calls")
    return {
        "openai_body": body,
        "sampling_given": given_sampling(body),
        "parallel_tool_calls": parallel if isinstance(parallel, bool) else None,
    }


async def drain(events: AsyncIterator[Any]) -> list[Any]:
    return [event async for event in events]


def httpcore_client(max_connections: int = 256, max_keepalive: int = 64) -> httpx.AsyncClient:
    """An upstream client on httpx's default transport (httpcore), the one respx intercepts: the gateway's
    shared client sends over aiohttp (``gateway.transport.aiohttp_transport``), which respx cannot see."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive),
        follow_redirects=False,
    )
