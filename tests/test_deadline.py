"""``_timeouts.Deadline``: the per-request deadline, checked against asyncio.timeout's
semantics (it replaces it on the hot path)."""

from __future__ import annotations

import asyncio

import pytest

from asyncsync._timeouts import Deadline

pytestmark = pytest.mark.asyncio


async def test_expiry_raises_timeout_error_from_the_cancellation() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError) as info:
        async with Deadline(loop, 0.05):
            await asyncio.sleep(10)
    assert 0.04 <= loop.time() - started < 5
    assert isinstance(info.value.__cause__, asyncio.CancelledError)
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # the deadline's cancel was undone


async def test_no_expiry_returns_normally_and_leaves_no_timer() -> None:
    loop = asyncio.get_running_loop()
    deadline = Deadline(loop, 10)
    async with deadline:
        await asyncio.sleep(0)
    assert deadline._handle is None
    async with Deadline(loop, None):  # no limit
        await asyncio.sleep(0.01)


async def test_a_cancellation_from_outside_propagates_untouched() -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()

    async def body() -> None:
        async with Deadline(loop, 10):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_outer_cancel_racing_the_expiry_is_not_swallowed() -> None:
    """The deadline fires and, in the same iteration, the task is also cancelled from
    outside: the outer cancellation wins (as with asyncio.timeout)."""
    loop = asyncio.get_running_loop()

    async def body() -> None:
        async with Deadline(loop, 0):
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    await asyncio.sleep(0)  # entered; the zero deadline fires on the next iteration
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nested_inside_asyncio_timeout() -> None:
    loop = asyncio.get_running_loop()

    async def inner_expires() -> None:
        async with asyncio.timeout(10), Deadline(loop, 0.01):
            await asyncio.sleep(10)

    async def outer_expires() -> None:
        async with asyncio.timeout(0.01), Deadline(loop, 10):
            await asyncio.sleep(10)

    with pytest.raises(TimeoutError):
        await inner_expires()
    # the outer (stdlib) deadline still works around one of ours
    with pytest.raises(TimeoutError):
        await outer_expires()


async def test_outside_a_task_is_an_error() -> None:
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[BaseException] = loop.create_future()

    def callback() -> None:  # a plain loop callback: no current task
        coro = Deadline(loop, 1).__aenter__()
        try:
            coro.send(None)
        except RuntimeError as exc:
            seen.set_result(exc)
        finally:
            coro.close()

    loop.call_soon(callback)
    assert "inside a task" in str(await seen)
