"""The runner pool: who is connected, what they serve, and which runner gets each request.

A request goes to the runner serving its model with the most free slots (ties spread at
random). When every such runner is full it waits in the model's bounded FIFO queue; a slot
frees when the runner sends a request's final frame, and the oldest waiter that runner can
serve takes it. A runner is never given more than its max_concurrent.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Final

import attrs

from gateway.config import GatewayConfig
from gateway.errors import ModelNotFound, QueueFull, QueueTimeout, RunnerLost
from protocol.codec import encode
from protocol.frames import Chunk, Error, Generate, Hello
from protocol.session import GatewaySession

log = logging.getLogger("gateway.pool")


@attrs.frozen
class Lost:
    """Pushed to a stream whose runner went away."""

    error: RunnerLost


StreamItem = Chunk | Error | Lost


class RequestStream:
    """One request's frames, from the runner link to the HTTP/WebSocket handler."""

    __slots__ = ("_queue", "done", "generate", "runner")

    def __init__(self, generate: Generate) -> None:
        self.generate = generate
        self.runner: RunnerConn | None = None
        self.done = False
        """True once the terminal item has been pushed."""
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()

    @property
    def request_id(self) -> str:
        return self.generate.request_id

    def push(self, item: StreamItem) -> None:
        if isinstance(item, Error | Lost) or item.finish_reason is not None:
            self.done = True
        self._queue.put_nowait(item)

    async def get(self) -> StreamItem:
        return await self._queue.get()

    def get_nowait(self) -> StreamItem | None:
        """The next item if one is ready (lets writers coalesce a burst into one write)."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None


class RunnerConn:
    """One connected, registered runner."""

    def __init__(
        self,
        runner_id: str,
        hello: Hello,
        session: GatewaySession,
        send: Callable[[bytes], Awaitable[None]],
    ) -> None:
        self.id = runner_id
        self.hello = hello
        self.session = session
        self.send = send
        self.models: Final = frozenset(m.id for m in hello.models)
        self.streams: dict[str, RequestStream] = {}
        self.connected_at = time.time()
        self.tokens_generated = 0
        self.requests_served = 0

    @property
    def name(self) -> str:
        return self.hello.runner_name

    @property
    def free(self) -> int:
        return self.hello.max_concurrent - len(self.streams)


@attrs.define
class _Waiter:
    stream: RequestStream
    future: asyncio.Future[RunnerConn]
    seq: int


def _dispatched(future: asyncio.Future[RunnerConn]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


class Pool:
    """Runners by id, and the per-model queues of requests waiting for a slot."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.runners: dict[str, RunnerConn] = {}
        self._waiters: dict[str, collections.deque[_Waiter]] = collections.defaultdict(
            collections.deque
        )
        self._seq = itertools.count()
        self._runner_ids = itertools.count(1)
        self._background: set[asyncio.Future[None]] = set()

    # --- membership -------------------------------------------------------------------

    def new_runner_id(self) -> str:
        return f"runner-{next(self._runner_ids)}"

    def add(self, conn: RunnerConn) -> None:
        self.runners[conn.id] = conn
        log.info(
            "runner %s (%s) joined: %s, %d slots",
            conn.id,
            conn.name,
            ", ".join(sorted(conn.models)),
            conn.hello.max_concurrent,
        )
        self._dispatch(conn)

    def remove(self, conn: RunnerConn) -> None:
        """Drop a runner: its requests fail; waiters for models nobody serves now fail too."""
        if self.runners.pop(conn.id, None) is None:
            return
        conn.session.close()
        lost = RunnerLost(conn.name)
        for stream in conn.streams.values():
            stream.push(Lost(lost))
        conn.streams.clear()
        log.info("runner %s (%s) left", conn.id, conn.name)
        served = self.models()
        for model in conn.models - served:
            for waiter in self._waiters.pop(model, ()):
                if not waiter.future.done():
                    waiter.future.set_exception(ModelNotFound(model))

    def models(self) -> set[str]:
        return {m for conn in self.runners.values() for m in conn.models}

    def queue_depth(self, model: str | None = None) -> int:
        if model is not None:
            return len(self._waiters.get(model, ()))
        return sum(len(q) for q in self._waiters.values())

    # --- requests ---------------------------------------------------------------------

    async def submit(self, generate: Generate) -> RequestStream:
        """Give a request to a runner, waiting in the model's queue if all are busy."""
        model = generate.model
        serving = [c for c in self.runners.values() if model in c.models]
        if not serving:
            raise ModelNotFound(model)
        stream = RequestStream(generate)
        conn = self._pick(serving)
        if conn is None:
            conn = await self._wait(stream)
        else:
            self._assign(conn, stream)
        await conn.send(encode(generate))
        return stream

    def _pick(self, serving: list[RunnerConn]) -> RunnerConn | None:
        best = max(c.free for c in serving)
        if best <= 0:
            return None
        return random.choice([c for c in serving if c.free == best])

    def _assign(self, conn: RunnerConn, stream: RequestStream) -> None:
        conn.session.send_generate(stream.generate)
        conn.streams[stream.request_id] = stream
        stream.runner = conn

    async def _wait(self, stream: RequestStream) -> RunnerConn:
        model = stream.generate.model
        queue = self._waiters[model]
        if len(queue) >= self.config.queue_size:
            raise QueueFull(model, retry_after=1.0)
        future: asyncio.Future[RunnerConn] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(stream, future, next(self._seq))
        queue.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.config.queue_timeout)
        except TimeoutError:
            if _dispatched(future):
                return future.result()  # dispatched in the same tick as the timeout
            raise QueueTimeout(model, retry_after=1.0) from None
        except asyncio.CancelledError:
            if _dispatched(future):
                # The slot was already ours: start and stop the request so that the
                # runner frees it through the normal path.
                self._spawn(self._start_cancelled(future.result(), stream))
            raise
        finally:
            if waiter in queue:
                queue.remove(waiter)
            if not future.done():
                future.cancel()

    async def _start_cancelled(self, conn: RunnerConn, stream: RequestStream) -> None:
        await conn.send(encode(stream.generate))
        self.cancel(stream)

    def _dispatch(self, conn: RunnerConn) -> None:
        """Hand free slots of `conn` to the oldest waiters it can serve."""
        while conn.free > 0:
            heads = [q[0] for m in conn.models if (q := self._waiters.get(m)) and len(q) > 0]
            if not heads:
                return
            waiter = min(heads, key=lambda w: w.seq)
            self._waiters[waiter.stream.generate.model].popleft()
            if waiter.future.done():
                continue
            self._assign(conn, waiter.stream)
            waiter.future.set_result(conn)

    def on_frame(self, conn: RunnerConn, frame: Chunk | Error) -> None:
        """Route a (session-checked) chunk or error to its stream; free the slot at the end."""
        stream = conn.streams.get(frame.request_id or "")
        if stream is None:
            return
        if isinstance(frame, Chunk):
            conn.tokens_generated += frame.tokens
            stream.push(frame)
            if frame.finish_reason is None:
                return
        else:
            stream.push(frame)
        del conn.streams[stream.request_id]
        conn.requests_served += 1
        self._dispatch(conn)

    def cancel(self, stream: RequestStream) -> None:
        """Ask the runner to stop a request; its slot frees when the runner confirms.

        Synchronous (the send runs in the background) so that it can be called from a
        handler that is itself being cancelled by a client disconnect.
        """
        conn = stream.runner
        if conn is None or stream.done or self.runners.get(conn.id) is not conn:
            return
        frame = conn.session.send_cancel(stream.request_id)
        if frame is not None:
            self._spawn(conn.send(encode(frame)))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
