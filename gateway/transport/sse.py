"""Server-sent events: the one parser (client streams in tests, upstream streams in the backends),
and an ASGI response that cancels its producer on disconnect. Encoding one event is
``gateway.core.event_stream``'s (the protocol renderers need it and sit beside this layer, not above it).

Format: the WHATWG HTML Living Standard, "Server-sent events", section 9.2.6 "Interpreting an event stream"
(https://html.spec.whatwg.org/multipage/server-sent-events.html): lines end in CRLF, LF or CR; ``event:`` /
``data:`` / ``id:`` fields; an event ends at a blank line. OpenAI streams are ``data: <json>\\n\\n`` lines
ending with ``data: [DONE]\\n\\n``; Anthropic streams add ``event: <type>``.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

_NEWLINE = re.compile(r"\r\n|\r|\n")


class LineSplitter:
    """Incremental UTF-8 decoding and SSE line splitting: lines end in CRLF, LF or CR (a CR at a chunk end
    waits for a possible LF); one leading byte order mark is dropped; bytes that are not UTF-8 become
    U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
        self._buffer = ""
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[str]:
        """Complete lines (without terminators) found so far."""
        return self._split(self._decoder.decode(chunk), final=False)

    def flush(self) -> list[str]:
        """The last line when the stream ended without a terminator."""
        return self._split(self._decoder.decode(b"", final=True), final=True)

    def _split(self, text: str, final: bool) -> list[str]:
        if self._pending_cr:
            text = "\r" + text
            self._pending_cr = False
        if text.endswith("\r") and not final:
            text = text[:-1]
            self._pending_cr = True
        text = self._buffer + text
        # without a CR the only terminator is LF: str.split, a C scan (the regex split was ~2 % of the gateway's
        # CPU per request under bench.overhead, docs/overhead.md session 7); the same parts either way
        parts = _NEWLINE.split(text) if "\r" in text else text.split("\n")
        self._buffer = parts.pop()
        if final and self._buffer:
            parts.append(self._buffer)
            self._buffer = ""
        return parts


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: ``event`` is ``"message"`` when the stream named none; ``data`` is its ``data``
    lines joined by LF; ``id`` the last event id seen so far (None before any)."""

    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        """``data`` parsed as JSON. Raises ``json.JSONDecodeError``."""
        return json.loads(self.data)


class SSEParser:
    """Incremental SSE parser: ``feed(bytes)`` returns the events those bytes complete, ``close()`` the rest.

    Follows the spec's interpretation rules (section 9.2.6): ``:`` lines are comments, one space after the
    colon is dropped, ``data`` lines join with LF, a blank line dispatches, an event without ``data`` is not
    dispatched, ``id`` (without NUL) is remembered, ``retry`` and unknown fields are ignored. Unlike a
    browser, ``close`` also dispatches an event still pending at the end of input: recorded streams often lack
    the final blank line (a line cut short by a broken connection then shows up as bad JSON to the caller).
    """

    def __init__(self) -> None:
        self._lines = LineSplitter()
        self._event = ""
        self._data: list[str] = []
        self._last_id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume bytes; return the events they complete, in order."""
        return self._process(self._lines.feed(chunk))

    def close(self) -> list[SSEEvent]:
        """End of input: the events of the last line and the pending event, if any."""
        events = self._process(self._lines.flush())
        if self._data:
            events.append(self._dispatch())
        return events

    def _process(self, lines: list[str]) -> list[SSEEvent]:
        events = []
        for line in lines:
            if line == "":
                if self._data:
                    events.append(self._dispatch())
                self._event = ""
                continue
            if line.startswith(":"):
                continue
            name, sep, value = line.partition(":")
            if sep and value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value
            elif name == "id" and "\0" not in value:
                self._last_id = value
        return events

    def _dispatch(self) -> SSEEvent:
        event = SSEEvent(event=self._event or "message", data="\n".join(self._data), id=self._last_id)
        self._event, self._data = "", []
        return event


def parse_sse(payload: bytes) -> list[SSEEvent]:
    """Parse a whole SSE payload (recorded fixtures, a buffered response), the last event included even
    without its blank line."""
    parser = SSEParser()
    return parser.feed(payload) + parser.close()


async def iter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[SSEEvent]:
    """Events from a stream of body bytes (an upstream response), as they complete; the pending event at the
    end of input too (see ``SSEParser``). Closing it closes ``chunks`` (when it has ``aclose``)."""
    parser = SSEParser()
    try:
        async for chunk in chunks:
            for event in parser.feed(chunk):
                yield event
        for event in parser.close():
            yield event
    finally:
        aclose = getattr(
            chunks, "aclose", None
        )  # closed here, not left to the loop's async-generator finalizer
        if aclose is not None:
            await aclose()


class EventStreamResponse:
    """ASGI response streaming ``text/event-stream`` bytes from an async iterator.

    Unlike Starlette's ``StreamingResponse`` (whose disconnect handling depends on the server's ASGI spec
    version), it always watches ``receive()`` for ``http.disconnect`` while streaming and then cancels the
    producer task (one ``CancelledError``, so the producer's ``finally`` blocks can still await), and it
    always ``aclose()``s the iterator, so the work behind the stream (an engine request, an upstream
    connection) is released at once when the client goes away.
    """

    media_type = "text/event-stream; charset=utf-8"

    def __init__(
        self, body: AsyncIterator[bytes], status_code: int = 200, headers: dict[str, str] | None = None
    ):
        self.body = body
        self.status_code = status_code
        self.headers = {
            "content-type": self.media_type,
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
        }
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
        raw_headers = [
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()
        ]
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
