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

This reaches into two places of uvicorn (``HttpToolsProtocol._start_asgi_task``, where each request's cycle
starts, and ``RequestResponseCycle.transport``); ``coalescing_protocol`` checks they are there and returns None
otherwise (uvicorn's own protocol is then used, unchanged).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["WATCH_DISCONNECT", "coalescing_protocol"]

WATCH_DISCONNECT = "prefixgate.watch_disconnect"
"""The scope extension naming a request's disconnect watch: ``watch(callback) -> unwatch`` (module
docstring)."""


class _HeldWrites:
    """A transport stand-in that keeps what is written (the head) instead of sending it; everything else is the
    real transport's."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.data: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.data.append(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _FirstWriteWith:
    """A transport stand-in whose first write is sent after ``head``, in one write; ``flush`` sends the head
    alone when nothing was written."""

    def __init__(self, transport: asyncio.Transport, head: list[bytes]) -> None:
        self._transport = transport
        self._head: list[bytes] | None = head

    def write(self, data: bytes) -> None:
        head, self._head = self._head, None
        self._transport.write(b"".join([*head, data]) if head else data)

    def flush(self) -> None:
        head, self._head = self._head, None
        if head:
            self._transport.write(b"".join(head))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def coalescing_protocol() -> type[asyncio.Protocol] | None:
    """uvicorn's ``HttpToolsProtocol`` holding each response's head until its first body message (module
    docstring), for ``uvicorn.run(http=...)``; None when httptools or the uvicorn internals it relies on are
    missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
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
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "http.response.start" and not self.response_started:
                real = self.transport
                held = _HeldWrites(real)
                self.transport = held  # type: ignore[assignment]
                try:
                    await super().send(message)
                finally:
                    self.transport = real
                self._held = held.data
                return
            head, self._held = self._held, None
            if head is None:
                await super().send(message)
                return
            real = self.transport
            first = _FirstWriteWith(real, head)
            self.transport = first  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = real
                first.flush()

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
