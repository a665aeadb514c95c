"""run_eagerly: a coroutine run on the caller's stack until it first suspends."""

from __future__ import annotations

import asyncio

import pytest

from gateway.streaming.eager import run_eagerly
from tests.support import UNIT


async def test_a_coroutine_that_never_waits_finishes_here() -> None:
    ran: list[str] = []

    async def send() -> None:
        ran.append("sent")

    assert run_eagerly(send()) is None
    assert ran == ["sent"]  # before any task switch


async def test_a_coroutine_that_waits_is_finished_by_awaiting_the_rest() -> None:
    gate = asyncio.get_running_loop().create_future()
    steps: list[object] = []

    async def send() -> None:
        steps.append("written")
        steps.append(await gate)
        await asyncio.sleep(0)
        steps.append("drained")

    rest = run_eagerly(send())
    assert rest is not None
    assert steps == ["written"]
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0)
    assert not task.done()
    gate.set_result("resumed")
    await asyncio.wait_for(task, 1 * UNIT)
    assert steps == ["written", "resumed", "drained"]


async def test_cancelling_the_rest_cancels_the_coroutine() -> None:
    cleaned: list[bool] = []

    async def send() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)

    rest = run_eagerly(send())
    assert rest is not None
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


async def test_errors_before_and_after_the_first_wait_reach_the_caller() -> None:
    async def broken() -> None:
        raise ConnectionResetError("at once")

    with pytest.raises(ConnectionResetError, match="at once"):
        run_eagerly(broken())

    async def later() -> None:
        await asyncio.sleep(0)
        raise ConnectionResetError("after a wait")

    rest = run_eagerly(later())
    assert rest is not None
    with pytest.raises(ConnectionResetError, match="after a wait"):
        await rest
