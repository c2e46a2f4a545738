"""The load client of ``bench.overhead``: HTTP/1.1 keep-alive connections over asyncio, each sending one
prebuilt request after another and timing each from the write to the last byte of the answer (parsed by
``httptools``, uvicorn's C parser, so chunked and fixed-length answers alike).

It has to be cheap: its own cost is in every figure, but it is the same for every target, so it cancels in the
added latency (target p50 - direct p50). Every answer's status must be 200 and its body must hold
``expect`` (the stub's reply text): an error from a gateway fails the run instead of timing it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httptools


class AnswerError(RuntimeError):
    """A target answered something other than a 200 holding the expected reply."""


def build_request(host: str, port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """The raw bytes of a keep-alive ``POST path`` with ``body`` as JSON."""
    payload = json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class _Connection(asyncio.Protocol):
    """One keep-alive connection; ``send`` writes a request and waits for its whole answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(AnswerError(f"unparsable answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(AnswerError(f"connection closed before the answer ended ({exc})"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    async def send(self, request: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.body = []
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class Batch:
    """One batch against one target: per-request latencies (seconds), the batch's wall time (seconds) and the CPU
    seconds the target's server process used meanwhile (set by the caller)."""

    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0


async def run_batch(host: str, port: int, requests: list[bytes], connections: int, expect: bytes) -> Batch:
    """Send ``requests`` (raw request bytes) over ``connections`` keep-alive connections (connection ``i`` sends
    ``requests[i::connections]`` one after another) and time them; connections are opened before the clock
    starts.

    Raises:
        AnswerError: an answer that is not a 200 holding ``expect``.
    """
    loop = asyncio.get_running_loop()
    conns = [(await loop.create_connection(_Connection, host, port))[1] for _ in range(connections)]
    batch = Batch()

    async def drive(conn: _Connection, mine: list[bytes]) -> None:
        for request in mine:
            start = time.perf_counter()
            status, body = await conn.send(request)
            batch.latencies.append(time.perf_counter() - start)
            if status != 200 or expect not in body:
                raise AnswerError(f"port {port} answered {status}: {body[:300]!r}")

    started = time.perf_counter()
    try:
        await asyncio.gather(*(drive(conn, requests[i::connections]) for i, conn in enumerate(conns)))
    finally:
        batch.wall_s = time.perf_counter() - started
        for conn in conns:
            conn.close()
    return batch


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` by the nearest-rank method; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
