"""Server-sent events: encoding, parsing, and an ASGI response that cancels its producer on disconnect.

Format: the WHATWG HTML Living Standard, "Server-sent events" (https://html.spec.whatwg.org/multipage/
server-sent-events.html): ``event:``/``data:`` fields, an event ends at a blank line. OpenAI streams are
``data: <json>\\n\\n`` lines ending with ``data: [DONE]\\n\\n``; Anthropic streams add ``event: <type>``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
"""OpenAI's end-of-stream sentinel."""


def json_dumps(obj: Any) -> str:
    """Compact JSON (no spaces after separators, UTF-8 kept), as OpenAI's API writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def encode_event(data: Any, event: str | None = None) -> bytes:
    """One SSE event: optional ``event: <name>`` line, then ``data: <json>``, then a blank line (UTF-8 bytes)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json_dumps(data)}\n\n".encode()


@dataclass(frozen=True)
class SSEEvent:
    """One parsed event: ``event`` name (``"message"`` when absent) and its ``data`` (lines joined by \\n)."""

    event: str
    data: str


class SSEParser:
    """Incremental SSE parser: ``feed(bytes)`` returns the events completed by those bytes.

    Follows the spec's line rules (CR, LF or CRLF line ends; ``:`` comments ignored; one optional space after
    the colon removed; an event with no ``data`` field is not dispatched). ``id``/``retry`` are ignored.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._decoder_tail = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume bytes; return the events they complete, in order."""
        raw = self._decoder_tail + chunk
        try:
            text = raw.decode()
            self._decoder_tail = b""
        except UnicodeDecodeError as exc:  # a multi-byte character split across chunks
            text = raw[: exc.start].decode()
            self._decoder_tail = raw[exc.start :]
        self._buffer += text
        events: list[SSEEvent] = []
        while True:
            line, found = self._next_line()
            if not found:
                return events
            event = self._process_line(line)
            if event is not None:
                events.append(event)

    def _next_line(self) -> tuple[str, bool]:
        for index, char in enumerate(self._buffer):
            if char == "\n" or char == "\r":
                if char == "\r" and index + 1 == len(self._buffer):
                    return "", False  # maybe CRLF split across chunks: wait for more
                end = index + 2 if self._buffer[index : index + 2] == "\r\n" else index + 1
                line = self._buffer[:index]
                self._buffer = self._buffer[end:]
                return line, True
        return "", False

    def _process_line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent(event=self._event or "message", data="\n".join(self._data))
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


def parse_sse(payload: bytes) -> list[SSEEvent]:
    """Parse a whole SSE payload (tests, recorded fixtures)."""
    return SSEParser().feed(payload)


class EventStreamResponse:
    """ASGI response streaming ``text/event-stream`` bytes from an async iterator.

    Unlike Starlette's ``StreamingResponse`` (whose disconnect handling depends on the server's ASGI spec
    version), it always watches ``receive()`` for ``http.disconnect`` while streaming and then cancels the
    producer task (one ``CancelledError``, so the producer's ``finally`` blocks can still await), and it
    always ``aclose()``s the iterator, so the work behind the stream (an engine request, an upstream
    connection) is released at once when the client goes away.
    """

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, body: AsyncIterator[bytes], status_code: int = 200, headers: dict[str, str] | None = None):
        self.body = body
        self.status_code = status_code
        self.headers = {"content-type": self.media_type, "cache-control": "no-cache", "x-accel-buffering": "no"}
        self.headers.update(headers or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(self._watch_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                if not task.done():
                    task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
        if not producer.cancelled() and producer.exception() is not None:
            raise producer.exception()  # type: ignore[misc]

    async def _produce(self, send: Send) -> None:
        raw_headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()]
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": raw_headers})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            return  # the client went away while we were writing (ASGI 2.4 servers raise on send)
        finally:
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()

    @staticmethod
    async def _watch_disconnect(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
