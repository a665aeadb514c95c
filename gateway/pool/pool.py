"""The runner pool: who is connected, what they serve, and which runner gets each request.

The pool routes and queues; what each runner connection carries (its requests, free slots,
drain state, counters) is its `GatewaySession`, and the pool keeps no copy of it. The session
holds each request's `Placement` (gateway.pool.placement: its runner, attempts, prefix and
meter); the client reads the placement's `RequestStream`.

A request goes to a runner serving its model with a free slot (draining runners have none),
chosen by `gateway.pool.affinity`: the one whose KV caches hold the longest prefix of it, unless
another would start it sooner for the prefill it has waiting (conversations that share
nothing spread over the most free slots, ties at random). When every such runner is full the
request waits in the model's bounded FIFO queue; a slot frees when the runner ends a request,
and the oldest waiter that runner can serve takes it. A runner is never given more than its
max_concurrent.

Failover: a request that ends on its runner before its first token (the session's
`Unstarted`: refused because the runner began draining, or its runner lost) moves once to
another runner without the client noticing. After the first token it fails with
`RunnerLost`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Awaitable
from importlib.metadata import PackageNotFoundError, version
from typing import Final

import attrs

from gateway.config import GatewayConfig
from gateway.errors import (
    GatewayError,
    ModelNotFound,
    ModelUnavailable,
    QueueFull,
    QueueTimeout,
    RunnerLost,
    ShuttingDown,
)
from gateway.observability.collector import PoolCollector
from gateway.observability.metrics import UNKNOWN_MODEL, Dialect, Metrics, error_kind
from gateway.pool.affinity import Choice, Rates, choose
from gateway.pool.memory import IdleTrimmer
from gateway.pool.placement import Placement, RunnerConn
from gateway.streaming.request_stream import Failed, RequestStream
from protocol.closecodes import CloseCode
from protocol.codec import encode
from protocol.frames import Chunk, Generate
from protocol.openai.objects import system_fingerprint
from protocol.prefix import prefix_chain
from protocol.session import (
    CacheReported,
    Delivered,
    Draining,
    GatewayEvent,
    Lost,
    ModelChanged,
    RequestFailed,
    RunnerFailed,
    Unstarted,
)

log = logging.getLogger("gateway.pool")


def _orchard_version() -> str:
    try:
        return version("orchard")
    except PackageNotFoundError:  # run from a source tree without installing
        return "0+unknown"


ORCHARD_VERSION: Final = _orchard_version()

MAX_ATTEMPTS = 2
"""A request may be given to this many runners (the first, plus one failover)."""


@attrs.define
class _Waiter:
    placement: Placement
    future: asyncio.Future[RunnerConn]
    seq: int


def _dispatched(future: asyncio.Future[RunnerConn]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


class Pool:
    """Runners by id, and the per-model queues of requests waiting for a slot."""

    def __init__(self, config: GatewayConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        """What `GET /metrics` reports (gateway.observability.metrics); the pool counts its
        events."""
        self.metrics.registry.register(PoolCollector(self))
        self.runners: dict[str, RunnerConn] = {}
        self.shutting_down = False
        self._waiters: dict[str, collections.deque[_Waiter]] = collections.defaultdict(
            collections.deque
        )
        self._last_served: dict[str, float] = {}
        self._started = time.monotonic()
        """When the gateway started (the start grace counts from it)."""
        self.rates = Rates()
        """What routing has measured (`gateway.pool.affinity`)."""
        self._seq = itertools.count()
        self._runner_ids = itertools.count(1)
        self._background: set[asyncio.Future[None]] = set()
        self._idle = asyncio.Event()
        self.trimmer = IdleTrimmer()
        """Hands freed memory back to the OS once a load of streams is over."""

    # --- membership -------------------------------------------------------------------

    def new_runner_id(self) -> str:
        return f"runner-{next(self._runner_ids)}"

    def add(self, conn: RunnerConn) -> None:
        self.runners[conn.id] = conn
        self.metrics.runner_joins.inc()
        log.info(
            "runner %s (%s) joined: %s, %d slots",
            conn.id,
            conn.name,
            ", ".join(sorted(conn.models)),
            conn.hello.max_concurrent,
        )
        self._dispatch(conn)

    def remove(self, conn: RunnerConn) -> None:
        """Drop a runner. Requests it had not started move on; started ones fail."""
        if self.runners.pop(conn.id, None) is None:
            return
        log.info("runner %s (%s) left", conn.id, conn.name)
        self.metrics.runner_losses.inc()
        now = time.monotonic()
        served = self.models()
        for model in conn.models - served:
            self._last_served[model] = now
        for event in conn.session.close():
            self.on_event(conn, event)
        for model in conn.models - served:
            for waiter in self._waiters.pop(model, ()):
                if not waiter.future.done():
                    waiter.future.set_exception(self._unserved(model))
        self._check_idle()

    def models(self) -> set[str]:
        return {m for conn in self.runners.values() for m in conn.models}

    def queue_depth(self, model: str | None = None) -> int:
        if model is not None:
            return len(self._waiters.get(model, ()))
        return sum(len(q) for q in self._waiters.values())

    def in_flight(self) -> int:
        return sum(c.session.in_flight for c in self.runners.values())

    def fingerprint(self, model: str) -> str:
        """The `system_fingerprint` of completions of `model`: Orchard's version, the model
        and the engine of a runner serving it (runners of one pool run the same build)."""
        engine = next(
            (
                info.engine
                for conn in self.runners.values()
                for info in conn.infos()
                if info.id == model and info.engine is not None
            ),
            None,
        )
        return system_fingerprint(ORCHARD_VERSION, model, engine)

    def check_model(self, model: str, dialect: Dialect | None = None) -> None:
        """Raise `ModelNotFound` (or `ModelUnavailable` in its grace period) for a model no
        runner serves: requests are answered about their model before anything else. With
        `dialect` (a client's request, not a failover) the refusal is counted."""
        if not any(model in c.models for c in self.runners.values()):
            error = self._unserved(model)
            if dialect is not None:
                self.metrics.refused(self.model_label(model), dialect, error_kind(error))
            raise error

    def model_label(self, model: str) -> str:
        """`model` as a metrics label: a name no runner ever served here is "unknown" (clients
        choose it: as a label it would let them add series at will)."""
        if model in self._last_served or any(model in c.models for c in self.runners.values()):
            return model
        return UNKNOWN_MODEL

    def _unserved(self, model: str) -> GatewayError:
        """503 while the model's runners may be on their way (its last one left within the
        model grace, or the gateway started within the start grace); else 404."""
        now = time.monotonic()
        seen = self._last_served.get(model)
        if seen is not None and now - seen < self.config.model_grace:
            return ModelUnavailable(model, retry_after=1.0)
        if now - self._started < self.config.start_grace:
            return ModelUnavailable(model, retry_after=1.0)
        return ModelNotFound(model)

    # --- requests ---------------------------------------------------------------------

    async def submit(self, generate: Generate, dialect: Dialect) -> RequestStream:
        """Give a request to a runner, waiting in the model's queue if all are busy.
        `dialect`: the API the client spoke (a metrics label)."""
        model = generate.model
        if self.shutting_down:
            self.metrics.refused(self.model_label(model), dialect, "shutting_down")
            raise ShuttingDown
        meter = self.metrics.meter(self.model_label(model), dialect)
        chain = prefix_chain(generate)
        placement = Placement(attrs.evolve(generate, prefix=chain.hashes), meter, chain)
        try:
            await self._place(placement)
        except GatewayError as exc:
            meter.end(error_kind(exc))
            raise
        except asyncio.CancelledError:
            if placement.runner is None:  # otherwise the runner ends it, and its end counts
                meter.end("cancelled")
            raise
        return placement.stream

    async def _place(self, placement: Placement) -> None:
        """Find a runner for the request (queueing if needed) and send it the request."""
        model = placement.generate.model
        self.check_model(model)
        conn = self._pick(placement)
        if conn is None:
            queued = time.perf_counter()
            conn = await self._wait(placement)
            self.metrics.queue_wait.labels(self.model_label(model)).observe(
                time.perf_counter() - queued
            )
        else:
            self.metrics.queue_wait.labels(self.model_label(model)).observe(0.0)
            self._assign(conn, placement)
        await conn.send(encode(placement.generate))

    def _pick(self, placement: Placement) -> RunnerConn | None:
        """The runner to start `placement` on now (`gateway.pool.affinity.choose`), among those with
        a free slot that hold its model in memory when any does (`_eligible`); None when
        none has a free slot."""
        model = placement.generate.model
        serving = [c for c in self.runners.values() if self._eligible(c, model)]
        free = [c for c in serving if c.session.free > 0]
        if not free:
            return None
        busy = [c.holdings for c in serving if c.session.free <= 0]
        choice = choose(
            model, placement.prefix, [(c.holdings, c.session.free) for c in free], self.rates, busy
        )
        self._count(model, choice)
        return free[choice.index]

    def _count(self, model: str, choice: Choice) -> None:
        self.metrics.routing.labels(self.model_label(model), choice.decision).inc()

    def _eligible(self, conn: RunnerConn, model: str) -> bool:
        """Whether `conn` may be given a request for `model`: it serves it and either holds
        it in memory (loaded or loading) or no runner does. A model in memory somewhere
        waits for a slot there rather than making another runner load it (a load takes
        seconds to minutes and may unload what that runner serves)."""
        if model not in conn.models:
            return False
        if conn.has_in_memory(model):
            return True
        return not any(c.has_in_memory(model) for c in self.runners.values())

    def _assign(self, conn: RunnerConn, placement: Placement) -> None:
        conn.session.assign(placement.generate, placement)
        model, chain = placement.generate.model, placement.prefix
        conn.holdings.start(
            placement.request_id, model, chain, self.rates.prefill(conn.holdings, model, chain)
        )
        self.trimmer.busy(self.in_flight())
        placement.runner = conn
        if placement.meter is not None:
            placement.meter.runner = conn.name
        placement.attempts += 1

    async def _wait(self, placement: Placement) -> RunnerConn:
        model = placement.generate.model
        queue = self._waiters[model]
        if len(queue) >= self.config.queue_size:
            raise QueueFull(model, retry_after=1.0)
        future: asyncio.Future[RunnerConn] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(placement, future, next(self._seq))
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
                self._spawn(self._start_cancelled(future.result(), placement))
            raise
        finally:
            if waiter in queue:
                queue.remove(waiter)
            if not future.done():
                future.cancel()

    async def _start_cancelled(self, conn: RunnerConn, placement: Placement) -> None:
        await conn.send(encode(placement.generate))
        self._cancel(placement)

    def _dispatch(self, conn: RunnerConn) -> None:
        """Hand free slots of `conn` to the oldest waiters it can serve."""
        while conn.session.free > 0:
            heads = [
                q[0]
                for m in conn.models
                if (q := self._waiters.get(m)) and len(q) > 0 and self._eligible(conn, m)
            ]
            if not heads:
                return
            waiter = min(heads, key=lambda w: w.seq)
            model = waiter.placement.generate.model
            self._waiters[model].popleft()
            if waiter.future.done():
                continue
            others = [
                c.holdings for c in self.runners.values() if c is not conn and model in c.models
            ]
            choice = choose(
                model, waiter.placement.prefix, [(conn.holdings, 1)], self.rates, others
            )
            self._count(model, choice)
            self._assign(conn, waiter.placement)
            waiter.future.set_result(conn)

    def _fail_over(self, placement: Placement, reason: GatewayError) -> None:
        """Move a request that has produced nothing yet to another runner, once."""
        if placement.stream.cancelled or placement.attempts >= MAX_ATTEMPTS:
            placement.stream.push(Failed(reason))
            return
        log.info("request %s moves to another runner (%s)", placement.request_id, reason)
        self.metrics.failovers.inc()
        placement.runner = None
        self._spawn(self._replace(placement, reason))

    async def _replace(self, placement: Placement, reason: GatewayError) -> None:
        try:
            await self._place(placement)
        except GatewayError:
            placement.stream.push(Failed(reason))

    def deliver(self, conn: RunnerConn, placement: Placement, chunk: Chunk) -> None:
        """A chunk for a request (the per-token path); a final one frees its slot."""
        placement.stream.push(chunk)
        if chunk.seq == 0:
            conn.holdings.first_token(placement.request_id)
        if chunk.finish_reason is not None:
            model = placement.generate.model
            self.rates.learn(conn.holdings, model, placement.prefix, chunk)
            conn.holdings.end(placement.request_id, model, placement.prefix)
            self.metrics.prompt_sources(conn.name, self.model_label(model), chunk)
            self._dispatch(conn)
            self._check_idle()

    def _ended(self, conn: RunnerConn, placement: Placement) -> None:
        """The request ended on `conn` without a final chunk."""
        conn.holdings.end(placement.request_id, placement.generate.model, placement.prefix)

    def on_event(self, conn: RunnerConn, event: GatewayEvent[Placement]) -> None:
        """Act on what the runner's session says happened (see protocol.session)."""
        match event:
            case Delivered(handle=placement, chunk=chunk):
                self.deliver(conn, placement, chunk)
                return
            case RequestFailed(handle=placement, error=error):
                self._ended(conn, placement)
                placement.stream.push(error)
            case Unstarted(handle=placement, reason=reason):
                self._ended(conn, placement)
                log.info(
                    "runner %s (%s) did not start %s: %s",
                    conn.id,
                    conn.name,
                    placement.request_id,
                    reason,
                )
                self._fail_over(placement, RunnerLost(conn.name))
            case Lost(handle=placement):
                self._ended(conn, placement)
                placement.stream.push(Failed(RunnerLost(conn.name)))
            case CacheReported(held=held):
                conn.holdings.report(held)
                return
            case Draining(reason=reason):
                log.info("runner %s (%s) is draining: %s", conn.id, conn.name, reason)
                return
            case RunnerFailed(message=message):
                log.warning(
                    "runner %s (%s) gave up its connection: %s", conn.id, conn.name, message
                )
                return
            case ModelChanged(model=info, previous=previous):
                if info.download is None:  # progress is for the console, not the log
                    log.info("runner %s (%s): %s %s", conn.id, conn.name, info.id, info.state)
                if previous.state == "loading" and info.state != "loading":
                    outcome = "ok" if info.state == "loaded" else "failed"
                    self.metrics.model_loads.labels(self.model_label(info.id), outcome).inc()
                # Which runners may take the model's waiters may have changed: all of them.
                for other in list(self.runners.values()):
                    self._dispatch(other)
                return
        self._dispatch(conn)
        self._check_idle()

    def cancel(self, stream: RequestStream) -> None:
        """Ask the runner to stop a request; its slot frees when the runner confirms.

        Synchronous (the send runs in the background) so that it can be called from a
        handler that is itself being cancelled by a client disconnect.
        """
        stream.cancelled = True
        placement = stream.placement
        if isinstance(placement, Placement):  # else no runner feeds it (a fan-in's stream)
            self._cancel(placement)

    def _cancel(self, placement: Placement) -> None:
        stream, conn = placement.stream, placement.runner
        stream.cancelled = True
        if conn is None or stream.done or self.runners.get(conn.id) is not conn:
            return
        frame = conn.session.cancel(placement.request_id)
        if frame is not None:
            if placement.meter is not None:
                placement.meter.cancel()
            self._spawn(conn.send(encode(frame)))

    # --- shutdown -----------------------------------------------------------------------

    async def drain(self, seconds: float) -> None:
        """Refuse new requests, wait (up to `seconds`) for those in flight, close runners."""
        self.shutting_down = True
        for queue in self._waiters.values():
            for waiter in queue:
                if not waiter.future.done():
                    waiter.future.set_exception(ShuttingDown())
        log.info("draining: %d request(s) in flight", self.in_flight())
        try:
            async with asyncio.timeout(seconds):
                while self.in_flight():
                    self._idle.clear()
                    await self._idle.wait()
        except TimeoutError:
            log.warning("drain deadline passed with %d request(s) in flight", self.in_flight())
        for conn in list(self.runners.values()):
            await conn.close(CloseCode.GOING_AWAY, "gateway going away")

    def _check_idle(self) -> None:
        if self.in_flight():
            return
        self.trimmer.idle()
        if self.shutting_down:
            self._idle.set()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
