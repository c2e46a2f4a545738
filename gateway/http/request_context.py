"""Per-HTTP-request context the handlers and the exception handler share: the app's ``Gateway``
(``gateway_of``), the request id (made on first use), the arrival time stamped by the app's middleware, and
cancelling the backend's work when the client goes: while the stream opens (``open_unless_disconnected``: a
prefill, for the embedded engine) and while a non-streamed answer is collected (``run_unless_disconnected``);
a streamed answer's own watch is ``gateway.transport.sse.EventStreamResponse``'s.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from gateway.core.headers import INSTANCE_HEADER
from gateway.core.request import ChatRequest
from gateway.http.server_protocol import WATCH_DISCONNECT
from gateway.service.gateway import Gateway
from gateway.service.pipeline import OpenedStream, open_stream, record_abandoned

T = TypeVar("T")


def new_request_id() -> str:
    """A random 24-hex-digit id for logs and response ids: 96 bits from the OS's random source (``os.urandom``,
    ~1 µs; ``uuid.uuid4().hex[:24]`` took ~5 µs for 90 random bits and a fixed version digit)."""
    return os.urandom(12).hex()


def begin(http_request: Request, request: ChatRequest) -> None:
    """Note the parsed request on the HTTP request so the exception handler can attribute errors to it."""
    if not request.request_id:
        request.request_id = getattr(http_request.state, "request_id", "") or new_request_id()
    http_request.state.request_id = request.request_id
    http_request.state.model = request.model
    http_request.state.stream = request.stream


def request_id_of(http_request: Request) -> str:
    """The request's id (made on first use)."""
    request_id = getattr(http_request.state, "request_id", None)
    if not request_id:
        request_id = new_request_id()
        http_request.state.request_id = request_id
    return request_id


def answer_headers(http_request: Request, request: ChatRequest, opened: OpenedStream) -> dict[str, str]:
    """The headers every model answer starts with: ``x-request-id`` (the gateway's id of the request), the
    upstream's request id where one sent it (``OpenedStream.upstream_headers``), and ``x-prefixgate-instance``
    (``INSTANCE_HEADER``: the serving app's ``instance_id``, new at each start; a front gateway reads it to see
    a replica that restarted, ``gateway.transport.replica_instances``)."""
    headers = {"x-request-id": request.request_id}
    headers.update(opened.upstream_headers())
    instance = getattr(http_request.app, "instance_id", None)
    if instance:
        headers[INSTANCE_HEADER] = instance
    return headers


def started_at(http_request: Request) -> float:
    """``time.monotonic()`` when the app first saw the request (set by the app's middleware)."""
    return getattr(http_request.state, "started_at", None) or time.monotonic()


async def open_unless_disconnected(
    http_request: Request, gateway: Gateway, request: ChatRequest, path: str, started: float
) -> OpenedStream:
    """``open_stream`` (the backend's work up to its first event: for the embedded engine, the whole prefill)
    unless the client disconnects first; then the opening is cancelled, which closes the backend's stream (the
    engine request is aborted and its blocks freed at once, with at most the prefill chunk already running
    computed: docs/serving-path.md), the request is counted aborted and logged 499, and ``ClientDisconnected``
    is raised. The same watch as ``run_unless_disconnected``: the server's callback under ``prefixgate
    serve``, no task per request.

    Raises:
        ClientDisconnected: the client went away before the first event (``logged``: its 499 line written).
        CancelledError: the caller was cancelled by someone else.
        whatever ``open_stream`` raises.
    """
    opened = await _unless_disconnected(http_request, open_stream(gateway, request, path, started))
    if opened is _GONE:
        record_abandoned(gateway, request, path, started)
        raise ClientDisconnected()
    return opened


async def run_unless_disconnected(http_request: Request, work: Awaitable[T], opened: OpenedStream) -> T:
    """Await ``work`` (a non-streamed answer being collected) unless the client disconnects first; then cancel
    it, close ``opened`` (freeing the backend's work) and raise ``ClientDisconnected``.

    Raises:
        ClientDisconnected: the client went away first (``opened`` closed).
        CancelledError: the caller was cancelled by someone else.
        whatever ``work`` raises.
    """
    result = await _unless_disconnected(http_request, work)
    if result is _GONE:
        await opened.aclose()
        raise ClientDisconnected()
    return result


_GONE: Any = object()
"""What ``_unless_disconnected`` returns when the client left and the work ended cancelled."""


async def _unless_disconnected(http_request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it and return ``_GONE``.

    Under ``prefixgate serve`` (``gateway.http.server_protocol``) the server calls back when the connection is
    lost (the scope's ``WATCH_DISCONNECT`` extension) and no task is made; elsewhere ``work`` runs in the
    calling task and one watcher task waits for the disconnect and cancels the caller when it
    comes (one task per request instead of two, and no ``asyncio.wait``); what the caller gets is what it got
    from the two-task form in every case (the answer, the work's own error, or ``_GONE`` when the
    work ended cancelled). The watcher's callback acts only
    while the caller is inside ``await work`` (``active``), so its cancellation always lands there; a
    cancellation from elsewhere (the server shutting down) is passed on as it is.
    """
    current = asyncio.current_task()
    if current is None:
        raise RuntimeError("run_unless_disconnected must run inside a task")
    active = True
    disconnected = False

    def gone() -> None:
        nonlocal disconnected
        if active:
            disconnected = True
            current.cancel()

    def on_watcher_done(watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled():
            return
        watcher.exception()  # retrieved: a failed receive counts as the client gone, as it always did
        gone()

    watch = getattr(http_request, "scope", {}).get("extensions", {}).get(WATCH_DISCONNECT)
    if watch is not None:  # the server calls ``gone`` when the connection is lost: no task per request
        stop = watch(gone)
    else:
        watcher = asyncio.ensure_future(_wait_disconnect(http_request))
        watcher.add_done_callback(on_watcher_done)
        stop = watcher.cancel
    try:
        result = await work
    except asyncio.CancelledError:
        if not disconnected or current.uncancel() > 0:
            raise
    except BaseException:
        if disconnected:
            current.uncancel()  # our cancellation became another error inside the work: that one goes on
        raise
    else:
        if disconnected:
            current.uncancel()  # the work swallowed our cancellation and answered: that answer goes on
        return result
    finally:
        active = False
        stop()
    return _GONE


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (nobody reads the response).

    Args:
        logged: whether the request's 499 line was already written (by the pipeline, for a request whose
            backend stream was open); False when the client left while its body was being read.
    """

    def __init__(self, logged: bool = True) -> None:
        super().__init__()
        self.logged = logged


async def _wait_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


def gateway_of(request: Request) -> Gateway:
    """The ``Gateway`` of the app serving ``request`` (``request.app.state.gateway``, set by
    ``create_app``)."""
    return request.app.state.gateway


def refuse_unknown_fields(gateway: Gateway) -> bool:
    """Whether the faces refuse an unknown top-level body field (``server.unknown_fields: refuse``)."""
    return gateway.config.server.unknown_fields == "refuse"
