"""uvicorn's HTTP/1.1 protocol (httptools) with each response's head and its first body bytes in one write.

uvicorn writes a response's status line and headers to the socket as soon as the app sends
``http.response.start``, and the body as a second write: two TCP segments, so a client on the other end wakes
up for the head, finds the answer incomplete, and wakes again for the body; each write is also a system call
that wakes the peer. Measured under ``bench.overhead`` (docs/overhead.md, session 6) the head's write was the
largest single frame of the gateway's samples at one connection. ASGI lets a server hold the head: "the
protocol server must not start sending the response to the client until it has received at least one
response body event" (ASGI HTTP spec, ``http.response.start``). ``HeadCoalescingProtocol`` holds it until
then and writes head and body together; every later body message is written as before.

Invariants: the bytes on the wire are uvicorn's, in the same order; a held head is written with the first body
message whatever that message holds (an empty body, the chunked terminator, nothing at all for ``HEAD``), so a
response never waits on anything but its own first body message, as the spec allows. Streams are not delayed:
an SSE response's head goes out with its first event, which the handlers send right after the head.

The protocol also tells the app of a client that leaves without a task waiting in ``receive``: a request's
scope carries ``extensions["prefixgate.watch_disconnect"]``, a function taking a callback that is called once
(from the connection's ``connection_lost``, or soon when the client is already gone) if the connection is lost
before the response completes, and returning a function that takes the callback back. A non-streamed answer
used a watcher task per request blocked in ``receive`` for this (``gateway.http.request_context``); uvicorn
itself only learns of the disconnect in ``connection_lost``, which is where the callback runs.

The cycle's ``send`` is uvicorn's ``RequestResponseCycle.send`` written out with the hold built in (the same
checks, errors, state changes and bytes, in the same order; the tests compare the wire bytes with uvicorn's
own protocol): one coroutine per message, where wrapping uvicorn's ``send`` took a second coroutine and a
transport stand-in object per message (docs/overhead.md, session 11). This reaches into uvicorn's
``httptools_impl`` (``HttpToolsProtocol._start_asgi_task``, where each request's cycle starts, the cycle's
state attributes, ``STATUS_LINE`` and the two header checks); ``coalescing_protocol`` checks they are there and
returns None otherwise (uvicorn's own protocol is then used, unchanged).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["WATCH_DISCONNECT", "coalescing_protocol"]

WATCH_DISCONNECT = "prefixgate.watch_disconnect"
"""The scope extension naming a request's disconnect watch: ``watch(callback) -> unwatch`` (module
docstring)."""


def coalescing_protocol() -> type[asyncio.Protocol] | None:
    """uvicorn's ``HttpToolsProtocol`` holding each response's head until its first body message (module
    docstring), for ``uvicorn.run(http=...)``; None when httptools or the uvicorn internals it relies on are
    missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import (
            HEADER_RE,
            HEADER_VALUE_RE,
            STATUS_LINE,
            HttpToolsProtocol,
            RequestResponseCycle,
            get_client_addr,
            get_path_with_query_string,
        )
    except ImportError:
        return None
    if not hasattr(HttpToolsProtocol, "_start_asgi_task") or not hasattr(RequestResponseCycle, "send"):
        return None

    class HeadCoalescingCycle(RequestResponseCycle):
        """``RequestResponseCycle`` whose ``http.response.start`` is written with the first body message."""

        _held: list[bytes] | None = None
        _watchers: list[Callable[[], None]] | None = None

        def watch_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
            """Call ``callback()`` once if the client disconnects before the response completes (soon, when
            it already has); returns the function that takes it back."""
            if self.disconnected:
                handle = asyncio.get_running_loop().call_soon(callback)
                return handle.cancel
            if self._watchers is None:
                self._watchers = []
            self._watchers.append(callback)

            def unwatch() -> None:
                if self._watchers and callback in self._watchers:
                    self._watchers.remove(callback)

            return unwatch

        def lost(self) -> None:
            """The connection is gone: call the watchers when that was before the response completed."""
            watchers, self._watchers = self._watchers, None
            if watchers and self.disconnected:
                for callback in watchers:
                    callback()

        async def send(self, message: Any) -> None:
            """uvicorn's ``RequestResponseCycle.send``, step for step (the same checks, errors, state and bytes),
            except that the head is kept (``_held``, its parts) instead of written, and written with the first
            body message's bytes in one ``transport.write``."""
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            if not self.response_started:
                if message["type"] != "http.response.start":
                    raise RuntimeError(
                        f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
                    )
                self.response_started = True
                self.waiting_for_100_continue = False
                status_code = message["status"]
                headers = self.default_headers + list(message.get("headers", []))
                if self.access_log:
                    self.access_logger.info(
                        '%s - "%s %s HTTP/%s" %d',
                        get_client_addr(self.scope),
                        self.scope["method"],
                        get_path_with_query_string(self.scope),
                        self.scope["http_version"],
                        status_code,
                    )
                content = [STATUS_LINE[status_code]]
                has_connection_close = False
                for name, value in headers:
                    if HEADER_RE.search(name):
                        raise RuntimeError("Invalid HTTP header name.")
                    if HEADER_VALUE_RE.search(value):
                        raise RuntimeError("Invalid HTTP header value.")
                    name = name.lower()
                    if name == b"content-length" and self.chunked_encoding is None:
                        self.expected_content_length = int(value.decode())
                        self.chunked_encoding = False
                    elif name == b"transfer-encoding" and value.lower() == b"chunked":
                        self.expected_content_length = 0
                        self.chunked_encoding = True
                    elif name == b"connection":
                        connection = [token.lower().strip() for token in value.split(b",")]
                        if b"close" in connection:
                            self.keep_alive = False
                            has_connection_close = True
                    content.extend([name, b": ", value, b"\r\n"])
                if not self.keep_alive and not has_connection_close:
                    content.append(b"connection: close\r\n")
                if (
                    self.chunked_encoding is None
                    and self.scope["method"] != "HEAD"
                    and status_code not in (204, 304)
                ):
                    self.chunked_encoding = True
                    content.append(b"transfer-encoding: chunked\r\n")
                content.append(b"\r\n")
                self._held = content  # written with the first body message
                return
            if self.response_complete:
                raise RuntimeError(
                    f"Unexpected ASGI message '{message['type']}' sent, after response already completed."
                )
            if message["type"] != "http.response.body":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
                )
            body = message.get("body", b"")
            more_body = message.get("more_body", False)
            head, self._held = self._held, None
            if self.scope["method"] == "HEAD":
                self.expected_content_length = 0
                if head:
                    self.transport.write(b"".join(head))
            elif self.chunked_encoding:
                content = head or []
                if body:
                    content += [b"%x\r\n" % len(body), body, b"\r\n"]
                if not more_body:
                    content.append(b"0\r\n\r\n")
                self.transport.write(b"".join(content))
            else:
                num_bytes = len(body)
                if num_bytes > self.expected_content_length:
                    if head:
                        self.transport.write(b"".join(head))
                    raise RuntimeError("Response content longer than Content-Length")
                self.expected_content_length -= num_bytes
                if head:
                    head.append(body)
                    self.transport.write(b"".join(head))
                else:
                    self.transport.write(body)
            if not more_body:
                if self.expected_content_length != 0:
                    raise RuntimeError("Response content shorter than Content-Length")
                self.response_complete = True
                self.message_event.set()
                if not self.keep_alive:
                    self.transport.close()
                self.on_response()

    class HeadCoalescingProtocol(HttpToolsProtocol):
        """``HttpToolsProtocol`` whose requests run in ``HeadCoalescingCycle``."""

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if type(cycle) is RequestResponseCycle:
                cycle.__class__ = HeadCoalescingCycle
                cycle.scope.setdefault("extensions", {})[WATCH_DISCONNECT] = cycle.watch_disconnect
            super()._start_asgi_task(cycle, app)

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = self.cycle
            super().connection_lost(exc)
            if isinstance(cycle, HeadCoalescingCycle):
                cycle.lost()

    return HeadCoalescingProtocol
