"""One request's frames on their way from a runner link to an HTTP or WebSocket handler.

The buffer is bounded: the runner link never waits for a client, so when a slow reader lets
more than `MAX_PENDING` chunks pile up, new text is merged into the last pending chunk. The
client then gets fewer, larger chunks; nothing is lost, and memory stays bounded by the
request's own text (itself bounded by max_tokens).
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

import attrs

from gateway.errors import GatewayError
from protocol.frames import Chunk, Error, Generate

if TYPE_CHECKING:
    from gateway.pool import RunnerConn

MAX_PENDING = 64
"""Chunks buffered per request before new ones are merged into the last."""


@attrs.frozen
class Failed:
    """Pushed to a stream that ends without a runner's answer (runner lost, timeout)."""

    error: GatewayError


StreamItem = Chunk | Error | Failed


def merge(first: Chunk, second: Chunk) -> Chunk:
    """Two consecutive chunks of one request as one."""
    return Chunk(
        first.request_id,
        second.seq,
        first.text + second.text,
        first.reasoning + second.reasoning,
        first.tokens + second.tokens,
        second.usage,
        second.finish_reason,
        second.stats,
    )


class RequestStream:
    """A request in flight: where it runs, and its frames not yet consumed."""

    __slots__ = (
        "_items",
        "_waiter",
        "attempts",
        "cancelled",
        "done",
        "generate",
        "merged",
        "runner",
        "started",
    )

    def __init__(self, generate: Generate) -> None:
        self.generate = generate
        self.runner: RunnerConn | None = None
        self.attempts = 0
        """Runners this request has been given to (failover retries once)."""
        self.started = False
        """True once a chunk has arrived: from then on it cannot move to another runner."""
        self.cancelled = False
        self.done = False
        """True once the terminal item has been pushed."""
        self.merged = 0
        """Chunks merged because the reader fell behind."""
        self._items: collections.deque[StreamItem] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    @property
    def request_id(self) -> str:
        return self.generate.request_id

    def push(self, item: StreamItem) -> None:
        if isinstance(item, Chunk):
            self.started = True
            if item.finish_reason is not None:
                self.done = True
            items = self._items
            if len(items) >= MAX_PENDING and isinstance(last := items[-1], Chunk):
                items[-1] = merge(last, item)
                self.merged += 1
            else:
                items.append(item)
        else:
            self.done = True
            self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> StreamItem:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> StreamItem | None:
        """The next item if one is ready (lets writers coalesce a burst into one write)."""
        return self._items.popleft() if self._items else None

    def pending(self) -> int:
        return len(self._items)


async def next_item(stream: RequestStream, seconds: float) -> StreamItem | None:
    """The stream's next item, or None after `seconds` of silence."""
    item = stream.get_nowait()
    if item is not None:
        return item
    try:
        async with asyncio.timeout(seconds):
            return await stream.get()
    except TimeoutError:
        return None
