"""new_request_id: 24 lowercase hex digits, fresh each time. run_unless_disconnected: the answer when the client
stays, ClientDisconnected (and the stream closed) when it goes, someone else's cancellation passed on, and no
cancellation left behind on the caller. open_unless_disconnected: the same watch over the stream's opening (a
prefill), the opening cancelled and the request recorded aborted when the client goes."""

from __future__ import annotations

import asyncio
import re

import pytest

from gateway.http import request_context
from gateway.http.request_context import (
    ClientDisconnected,
    new_request_id,
    open_unless_disconnected,
    run_unless_disconnected,
)
from gateway.http.server_protocol import WATCH_DISCONNECT


class FakeRequest:
    """``receive`` answers ``http.disconnect`` once the client ``leave``s (``fail``: raises instead); with
    ``watched``, the scope offers the server's disconnect watch (``WATCH_DISCONNECT``, what
    ``gateway.http.server_protocol`` gives) and ``receive`` must not be called."""

    def __init__(self, fail: bool = False, watched: bool = False) -> None:
        self.gone = asyncio.Event()
        self.fail = fail
        self.watched = watched
        self.watchers: list = []
        self.scope: dict = {"extensions": {WATCH_DISCONNECT: self.watch}} if watched else {}

    def watch(self, callback):
        self.watchers.append(callback)
        return lambda: self.watchers.remove(callback)

    def leave(self) -> None:
        self.gone.set()
        for callback in list(self.watchers):
            callback()

    async def receive(self) -> dict:
        assert not self.watched, "a watched request is not polled"
        await self.gone.wait()
        if self.fail:
            raise OSError("receive channel broken")
        return {"type": "http.disconnect"}


class FakeOpened:
    def __init__(self) -> None:
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


async def test_the_answer_when_the_client_stays(watched):
    request, opened = FakeRequest(watched=watched), FakeOpened()

    async def work() -> str:
        await asyncio.sleep(0)
        return "answer"

    assert await run_unless_disconnected(request, work(), opened) == "answer"
    assert opened.closed == 0
    assert asyncio.current_task().cancelling() == 0
    request.leave()  # a disconnect after the answer touches nothing
    await asyncio.sleep(0.01)
    assert asyncio.current_task().cancelling() == 0 and opened.closed == 0


@pytest.fixture(params=[False, True], ids=["watcher-task", "server-watch"])
def watched(request) -> bool:
    """Each test runs with a watcher task polling ``receive`` and with the server's disconnect watch."""
    return request.param


@pytest.mark.parametrize("fail", [False, True])
async def test_a_disconnect_cancels_the_work_and_closes_the_stream(fail, watched):
    request, opened = FakeRequest(fail, watched), FakeOpened()
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    asyncio.get_running_loop().call_later(0.01, request.leave)
    with pytest.raises(ClientDisconnected):
        await run_unless_disconnected(request, work(), opened)
    assert cancelled.is_set() and opened.closed == 1
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left pending on the caller


async def test_work_that_swallows_the_cancellation_and_answers_gives_that_answer(watched):
    request, opened = FakeRequest(watched=watched), FakeOpened()

    async def work() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return "partial"
        return "never"

    asyncio.get_running_loop().call_later(0.01, request.leave)
    assert await run_unless_disconnected(request, work(), opened) == "partial"
    assert opened.closed == 0 and asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)


async def test_an_error_raised_on_the_cancellation_goes_on(watched):
    request, opened = FakeRequest(watched=watched), FakeOpened()

    async def work() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ValueError("upstream read interrupted") from None
        return "never"

    asyncio.get_running_loop().call_later(0.01, request.leave)
    with pytest.raises(ValueError, match="upstream read interrupted"):
        await run_unless_disconnected(request, work(), opened)
    assert opened.closed == 0 and asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)


async def test_the_works_own_error_goes_on(watched):
    async def work() -> str:
        await asyncio.sleep(0)
        raise KeyError("bad event")

    with pytest.raises(KeyError):
        await run_unless_disconnected(FakeRequest(watched=watched), work(), FakeOpened())


async def test_someone_elses_cancellation_is_passed_on(watched):
    request, opened = FakeRequest(watched=watched), FakeOpened()
    started = asyncio.Event()

    async def work() -> str:
        started.set()
        await asyncio.sleep(3600)
        return "never"

    caller = asyncio.create_task(run_unless_disconnected(request, work(), opened))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert opened.closed == 0


async def test_the_server_watch_is_taken_back_when_the_work_ends():
    request, opened = FakeRequest(watched=True), FakeOpened()

    async def work() -> str:
        assert len(request.watchers) == 1  # watched while the work runs
        return "answer"

    assert await run_unless_disconnected(request, work(), opened) == "answer"
    assert request.watchers == []


class FakeOpening:
    """Stands in for ``open_stream`` (waits until ``answer`` is set or it is cancelled) and ``record_abandoned``."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.cancelled = 0
        self.abandoned: list[tuple] = []

    async def open_stream(self, gateway, request, path, started):
        try:
            await self.answer.wait()
        except asyncio.CancelledError:
            self.cancelled += 1  # open_stream closes the backend's stream here (the engine request aborted)
            raise
        return "opened"

    def record_abandoned(self, gateway, request, path, started) -> None:
        self.abandoned.append((gateway, request, path, started))


@pytest.fixture
def opening(monkeypatch) -> FakeOpening:
    fake = FakeOpening()
    monkeypatch.setattr(request_context, "open_stream", fake.open_stream)
    monkeypatch.setattr(request_context, "record_abandoned", fake.record_abandoned)
    return fake


async def test_a_disconnect_while_the_stream_opens_cancels_the_opening_and_records_it(opening, watched):
    request = FakeRequest(watched=watched)
    asyncio.get_running_loop().call_later(0.01, request.leave)
    with pytest.raises(ClientDisconnected) as raised:
        await open_unless_disconnected(request, "gw", "req", "/v1/messages", 1.0)
    assert raised.value.logged  # its 499 line is written by record_abandoned, not by the app's handler
    assert opening.cancelled == 1 and opening.abandoned == [("gw", "req", "/v1/messages", 1.0)]
    assert asyncio.current_task().cancelling() == 0 and request.watchers == []
    await asyncio.sleep(0)  # no cancellation left pending on the caller


async def test_a_stream_that_opens_is_returned_and_the_watch_taken_back(opening, watched):
    request = FakeRequest(watched=watched)
    asyncio.get_running_loop().call_soon(opening.answer.set)
    assert await open_unless_disconnected(request, "gw", "req", "/v1/responses", 1.0) == "opened"
    assert opening.cancelled == 0 and opening.abandoned == [] and request.watchers == []
    request.leave()  # a disconnect once the stream is open is the answer's own watch's business
    await asyncio.sleep(0.01)
    assert asyncio.current_task().cancelling() == 0 and opening.abandoned == []


def test_request_ids_are_24_hex_digits_and_fresh():
    ids = [new_request_id() for _ in range(2000)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", request_id) for request_id in ids)
    assert len(set(ids)) == len(ids)
    assert {request_id[12] for request_id in ids} != {"4"}  # every digit random (uuid4's 13th was always 4)
