"""An event loop on a virtual clock, for tests of the gateway's own timers (the relay's
keep-alive and stream timeout, the idle trimmer) that run in the test's process with no I/O.

Whenever the loop has nothing ready and would sleep until its next timer, the clock jumps to
that timer instead: every timer fires at exactly its time and in its order, however busy the
machine is, and a test of a 0.18 s timeout takes no time at all. `loop.time()`, `call_later`,
`asyncio.sleep` and `asyncio.timeout` all read that clock. Waiting on a socket would jump the
clock too, so these tests use none.

A candidate for tests.support once another package tests timers this way."""

from __future__ import annotations

import asyncio
import functools
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec

P = ParamSpec("P")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls instead of waiting, and moves the loop's clock on by what it would have waited."""

    def __init__(self, clock: VirtualClockLoop) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            self._clock.now += timeout
            timeout = 0
        events: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        return events


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        """The virtual clock, in seconds from the loop's start."""
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def virtual_time(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run an async test on a `VirtualClockLoop` of its own (a plain test to pytest, so that
    pytest-asyncio leaves it alone; its fixtures are passed through)."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
            runner.run(test(*args, **kwargs))

    return run
