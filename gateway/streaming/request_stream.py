"""One request's frames on their way from a runner link to its client's relay.

While its client keeps up, each item goes straight to the relay (`sink`, gateway.streaming.relay);
otherwise it queues here. The buffer is bounded: the runner link never waits for a client,
so when a slow reader lets more than `MAX_PENDING` chunks pile up, new text is merged into
the last pending chunk. The client then gets fewer, larger chunks; nothing is lost, and
memory stays bounded by the request's own text (itself bounded by max_tokens).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Protocol

import attrs

from gateway.errors import GatewayError
from protocol.frames import Chunk, Error, Generate
from protocol.merge import merge

log = logging.getLogger("gateway.stream")

MAX_PENDING = 64
"""Chunks buffered per request before new ones are merged into the last."""


@attrs.frozen
class Failed:
    """Pushed to a stream that ends without a runner's answer (runner lost, timeout)."""

    error: GatewayError


StreamItem = Chunk | Error | Failed


class StreamMeter(Protocol):
    """What counts the request in the gateway's metrics (gateway.observability.metrics.Meter),
    as its stream and its readers use it."""

    def chunk(self, chunk: Chunk, cancelled: bool) -> None: ...

    def fail(self, problem: GatewayError | Error, cancelled: bool) -> None: ...

    def end(self, outcome: str) -> None: ...


class Placed(Protocol):
    """Where the request runs, as its stream's readers may ask (the pool's placement,
    gateway.pool.placement.Placement)."""

    def model_loading(self) -> bool: ...


class RequestStream:
    """A request's frames not yet consumed by its reader (relay, fan-in or collector)."""

    __slots__ = (
        "_items",
        "_overflow",
        "_waiter",
        "cancelled",
        "done",
        "generate",
        "merged",
        "meter",
        "placement",
        "sink",
    )

    def __init__(
        self,
        generate: Generate,
        meter: StreamMeter | None = None,
        placement: Placed | None = None,
    ) -> None:
        self.generate = generate
        self.meter = meter
        """Counts the request in the gateway's metrics (gateway.observability.metrics)."""
        self.placement = placement
        """Where the pool put the request; None for a stream no runner feeds (a fan-in's)."""
        self.cancelled = False
        """The client asked to stop it (or went away)."""
        self.done = False
        """True once the terminal item has been pushed."""
        self.merged = 0
        """Chunks merged because the reader fell behind."""
        self._items: collections.deque[StreamItem] = collections.deque()
        self._overflow: list[StreamItem] = []
        """What came after MAX_PENDING items; merged into one chunk when the reader gets there."""
        self._waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[StreamItem], bool] | None = None
        """Takes items as they arrive, while nothing is queued (see gateway.streaming.relay);
        returns False to have an item queued instead (its client is not reading)."""

    @property
    def request_id(self) -> str:
        return self.generate.request_id

    def model_loading(self) -> bool:
        """Its runner is loading its model (downloading it, perhaps): silence is expected
        until it is loaded, and does not count toward the stream timeout (the runner's
        heartbeats say it is alive)."""
        placement = self.placement
        return placement is not None and placement.model_loading()

    def push(self, item: StreamItem) -> None:
        """Called by the runner link: never raises, whatever the client side does."""
        meter = self.meter
        if type(item) is Chunk:
            self.done = item.finish_reason is not None
            if meter is not None:
                meter.chunk(item, self.cancelled)
        else:
            self.done = True
            if meter is not None and not isinstance(item, Chunk):
                meter.fail(item.error if isinstance(item, Failed) else item, self.cancelled)
        sink = self.sink
        if sink is not None and not self._items and not self._overflow:
            try:
                if sink(item):
                    return
            except Exception:
                # Relays guard themselves; this is the last line between a client and the
                # runner link that called us. The item stays queued for nobody.
                log.exception("the client of request %s failed; detached", self.request_id)
                self.sink = None
        if self._overflow or (len(self._items) >= MAX_PENDING and isinstance(item, Chunk)):
            self._overflow.append(item)
            self.merged += 1
        else:
            self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _refill(self) -> None:
        """The reader caught up: what overflowed comes back as one merged chunk."""
        chunks: list[Chunk] = []
        rest: list[StreamItem] = []
        for item in self._overflow:
            if isinstance(item, Chunk) and not rest:
                chunks.append(item)
            else:
                rest.append(item)
        self._overflow = []
        if chunks:
            self._items.extend(merge(chunks))
        self._items.extend(rest)

    async def get(self) -> StreamItem:
        if not self._items and self._overflow:
            self._refill()
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> StreamItem | None:
        """The next item if one is ready (lets writers coalesce a burst into one write)."""
        if not self._items and self._overflow:
            self._refill()
        return self._items.popleft() if self._items else None

    def pending(self) -> int:
        return len(self._items) + len(self._overflow)


async def next_item(stream: RequestStream, seconds: float) -> StreamItem | None:
    """The stream's next item, or None after `seconds` of silence."""
    item = stream.get_nowait()
    if item is not None:
        return item
    try:
        async with asyncio.timeout(seconds):
            return await stream.get()
    except TimeoutError:
        # An item pushed as the wait ran out is queued, not lost: it ends the silence (else a
        # check made now, such as "is its model still loading?", would see a later state).
        return stream.get_nowait()
