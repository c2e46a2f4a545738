"""The shutdown drain: what happens to requests in flight when the server is told to stop (SIGTERM, Ctrl-C).

``prefixgate serve`` stops accepting connections at once and gives the requests in flight ``grace_s`` seconds
to finish (``server.shutdown_grace_s``). Those still running then are ended by the gateway, not cut by the
server: each one's task is cancelled where it waits for its backend (which aborts its engine request or closes
its upstream connection, freeing what it held) and the request fails with a 503 ``service_unavailable``, "the
server is shutting down": a JSON answer not yet sent is that error, and a stream already under way gets the
protocol's own in-band error event and then its clean end (``OpenedStream.guarded_events``). The request's log
line says 503, not 499: the server cut it, not the client. uvicorn's own graceful timeout is longer (by
``SHUTDOWN_MARGIN_S`` in ``gateway.cli``), so those last events go out before it closes what is left.

Invariants: a task is tracked only while it waits on its backend (``track`` / ``untrack`` around each wait, so
it is never cancelled while writing to its client; its next wait is refused instead); the drain cancels only
tracked tasks, once, after ``begin``; ``shutting_down_error`` turns only the drain's own cancellation into the
503 (a client's disconnect or the server's stays a cancellation).
"""

from __future__ import annotations

import asyncio

from gateway.core.errors import ServiceUnavailableError

SHUTTING_DOWN = "The server is shutting down; retry the request."
"""The message of the 503 a request in flight gets when the drain ends it."""


class ShutdownDrain:
    """Requests waiting on their backends, and the timer that ends them after a shutdown began.

    One per ``Gateway``; used from the event loop's thread only (``begin`` through
    ``loop.call_soon_threadsafe`` from a signal handler).
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self._cancelled: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.expired = False
        """True once the grace period is over: every tracked task was cancelled, new ones are refused."""

    @property
    def draining(self) -> bool:
        """Whether a shutdown began (``begin`` was called)."""
        return self._timer is not None or self.expired

    def track(self) -> asyncio.Task[object] | None:
        """Register the current task as waiting on its backend; returns it for ``untrack``.

        Raises:
            ServiceUnavailableError: the grace period is over (a request that got in on a kept-alive
                connection after it).
        """
        if self.expired:
            raise ServiceUnavailableError(SHUTTING_DOWN)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        return task

    def untrack(self, task: asyncio.Task[object] | None) -> None:
        """The task no longer waits on its backend."""
        if task is not None:
            self._tasks.discard(task)

    def begin(self, grace_s: float) -> None:
        """Start the grace period (idempotent: a second signal does not restart it). Call on the loop."""
        if self._timer is not None or self.expired:
            return
        self._timer = asyncio.get_running_loop().call_later(max(grace_s, 0.0), self.expire)

    def expire(self) -> None:
        """End the grace period now: cancel every tracked task (each then fails with the 503)."""
        self.expired = True
        self._cancelled = set(self._tasks)
        for task in self._cancelled:
            task.cancel()

    def shutting_down_error(self, task: asyncio.Task[object] | None) -> ServiceUnavailableError | None:
        """In an ``except asyncio.CancelledError`` of ``task``: the 503 to raise instead when the cancellation
        was the drain's (the task's cancel request is then withdrawn, ``Task.uncancel``), else None (re-raise
        the cancellation)."""
        if task is None or task not in self._cancelled:
            return None
        self._cancelled.discard(task)
        task.uncancel()
        return ServiceUnavailableError(SHUTTING_DOWN)
