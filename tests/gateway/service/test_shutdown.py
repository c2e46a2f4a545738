"""The shutdown drain (``gateway.service.shutdown``): after the grace period the requests waiting on their
backends are cancelled and fail with a 503; other cancellations stay cancellations."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.errors import ServiceUnavailableError
from gateway.service.shutdown import SHUTTING_DOWN, ShutdownDrain


async def wait_on_backend(drain: ShutdownDrain, backend: asyncio.Future) -> str:
    """What the pipeline does around a backend wait."""
    task = drain.track()
    try:
        return await backend
    except asyncio.CancelledError:
        error = drain.shutting_down_error(task)
        if error is None:
            raise
        raise error from None
    finally:
        drain.untrack(task)


async def test_the_grace_period_ends_waiting_requests_with_a_503():
    drain = ShutdownDrain()
    loop = asyncio.get_running_loop()
    slow, quick = loop.create_future(), loop.create_future()
    waiting = asyncio.ensure_future(wait_on_backend(drain, slow))
    answered = asyncio.ensure_future(wait_on_backend(drain, quick))
    bystander = asyncio.ensure_future(asyncio.sleep(10))  # not waiting on a backend: never touched
    await asyncio.sleep(0)
    assert not drain.draining
    drain.begin(0.05)
    drain.begin(60)  # a second signal does not restart the grace period
    assert drain.draining and not drain.expired
    quick.set_result("done")
    assert await answered == "done"  # finished within the grace period
    with pytest.raises(ServiceUnavailableError) as caught:
        await waiting
    assert str(caught.value) == SHUTTING_DOWN and caught.value.status_code == 503
    assert drain.expired and not bystander.done()
    bystander.cancel()
    with pytest.raises(ServiceUnavailableError):  # a request that comes in after it
        drain.track()


async def test_a_cancellation_that_is_not_the_drains_stays_a_cancellation():
    drain = ShutdownDrain()
    backend = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(wait_on_backend(drain, backend))
    await asyncio.sleep(0)
    waiting.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await waiting
    drain.expire()  # nothing is tracked any more
    assert drain.shutting_down_error(asyncio.current_task()) is None


async def test_the_drains_cancellation_is_withdrawn_so_the_task_can_answer():
    drain = ShutdownDrain()
    backend = asyncio.get_running_loop().create_future()

    async def request() -> int:
        with pytest.raises(ServiceUnavailableError):
            await wait_on_backend(drain, backend)
        await asyncio.sleep(0)  # the error event is written after it: no cancellation pending
        return asyncio.current_task().cancelling()

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0)
    drain.expire()
    assert await task == 0
