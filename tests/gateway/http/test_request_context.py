"""run_unless_disconnected: the answer when the client stays, ClientDisconnected (and the stream closed) when
it goes, someone else's cancellation passed on, and no cancellation left behind on the caller."""

from __future__ import annotations

import asyncio

import pytest

from gateway.http.request_context import ClientDisconnected, run_unless_disconnected


class FakeRequest:
    """``receive`` answers ``http.disconnect`` once ``gone`` is set (``fail``: raises instead)."""

    def __init__(self, fail: bool = False) -> None:
        self.gone = asyncio.Event()
        self.fail = fail

    async def receive(self) -> dict:
        await self.gone.wait()
        if self.fail:
            raise OSError("receive channel broken")
        return {"type": "http.disconnect"}


class FakeOpened:
    def __init__(self) -> None:
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


async def test_the_answer_when_the_client_stays():
    request, opened = FakeRequest(), FakeOpened()

    async def work() -> str:
        await asyncio.sleep(0)
        return "answer"

    assert await run_unless_disconnected(request, work(), opened) == "answer"
    assert opened.closed == 0
    assert asyncio.current_task().cancelling() == 0
    request.gone.set()  # a disconnect after the answer touches nothing
    await asyncio.sleep(0.01)
    assert asyncio.current_task().cancelling() == 0 and opened.closed == 0


@pytest.mark.parametrize("fail", [False, True])
async def test_a_disconnect_cancels_the_work_and_closes_the_stream(fail):
    request, opened = FakeRequest(fail), FakeOpened()
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    asyncio.get_running_loop().call_later(0.01, request.gone.set)
    with pytest.raises(ClientDisconnected):
        await run_unless_disconnected(request, work(), opened)
    assert cancelled.is_set() and opened.closed == 1
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left pending on the caller


async def test_work_that_swallows_the_cancellation_and_answers_gives_that_answer():
    request, opened = FakeRequest(), FakeOpened()

    async def work() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return "partial"
        return "never"

    asyncio.get_running_loop().call_later(0.01, request.gone.set)
    assert await run_unless_disconnected(request, work(), opened) == "partial"
    assert opened.closed == 0 and asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)


async def test_an_error_raised_on_the_cancellation_goes_on():
    request, opened = FakeRequest(), FakeOpened()

    async def work() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ValueError("upstream read interrupted") from None
        return "never"

    asyncio.get_running_loop().call_later(0.01, request.gone.set)
    with pytest.raises(ValueError, match="upstream read interrupted"):
        await run_unless_disconnected(request, work(), opened)
    assert opened.closed == 0 and asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)


async def test_the_works_own_error_goes_on():
    async def work() -> str:
        await asyncio.sleep(0)
        raise KeyError("bad event")

    with pytest.raises(KeyError):
        await run_unless_disconnected(FakeRequest(), work(), FakeOpened())


async def test_someone_elses_cancellation_is_passed_on():
    request, opened = FakeRequest(), FakeOpened()
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
