"""Run a coroutine eagerly: up to its first suspension, on the caller's stack.

The gateway writes each token to its client with an ASGI `send` that almost never has to
wait: it hands bytes to the transport and returns. Wrapping each call in a task would cost a
task switch per token; `run_eagerly` runs it right away instead and only leaves a task's
worth of work when the send really suspends (the client's buffer is full). Python 3.12's
eager task factory does this for a whole loop; Orchard supports 3.11 and wants it for these
calls only. (Tried for the runner's frames too: no measurable difference, so not used there.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine, Generator
from typing import Any


def run_eagerly(coro: Coroutine[Any, Any, None]) -> Awaitable[None] | None:
    """Run `coro` until it first suspends. None when it finished; otherwise an awaitable
    that finishes it (await it in a task). Exceptions before the first suspension propagate.
    """
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    except BaseException:
        coro.close()
        raise
    return _Resume(coro, waiting)


class _Resume(Awaitable[None]):
    """Await the rest of a coroutine that was started by hand and suspended on `waiting`.

    Yields what the coroutine yields and sends back what it is sent, so the task awaiting
    this drives it exactly as if it had awaited the coroutine from the start.
    """

    __slots__ = ("_coro", "_waiting")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        self._coro = coro
        self._waiting = waiting

    def __await__(self) -> Generator[Any, Any, None]:
        waiting = self._waiting
        while True:
            try:
                value = yield waiting
            except BaseException as exc:  # cancellation included: the coroutine decides
                try:
                    waiting = self._coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    waiting = self._coro.send(value)
                except StopIteration:
                    return
