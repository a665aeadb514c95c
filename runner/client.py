"""The runner's transport: one persistent WebSocket to the gateway, forever.

Connects, says hello, waits for welcome, then serves Generate/Cancel frames through the
engine and streams its output back as numbered chunks. It tells the gateway which prefixes
of conversations its KV caches hold (`CacheHeld`: all of them after each welcome, then every
change, in order with the chunks: a request's cache before its last chunk). When the
connection drops, every request it carried is cancelled in the engine (no orphan generation)
and the runner reconnects with exponential backoff and jitter, saying hello again each
time. A gateway silent for the liveness timeout counts as gone. `stop()` (SIGTERM) drains: a
Drain frame, in-flight requests finish (up to the drain timeout), then the socket closes
normally.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import websockets
from websockets.asyncio.client import ClientConnection, connect

from protocol.closecodes import CloseCode
from protocol.codec import decode_gateway_frame, encode
from protocol.errors import ProtocolError
from protocol.frames import (
    PROTOCOL_VERSION,
    RUNNER_PATH,
    Batch,
    CacheHeld,
    Cancel,
    Chunk,
    Generate,
    Hardware,
    Heartbeat,
    Hello,
    ModelInfo,
    ModelStatus,
    Welcome,
)
from protocol.merge import merge
from protocol.session import RunnerSession
from runner.engine.base import CacheChange, Engine, EngineEvent, Failure, Output
from runner.errors import GatewaySilent, Unauthorized
from runner.pinning import pinned_context

# GatewaySilent and Unauthorized live in runner.errors; they are still importable from here.
__all__ = [
    "BACKOFF_MAX",
    "BACKOFF_MIN",
    "GATHER_MIN_REQUESTS",
    "GATHER_S",
    "MAX_FRAME_BYTES",
    "GatewaySilent",
    "Runner",
    "Unauthorized",
    "runner_url",
]

log = logging.getLogger("runner.client")

MAX_FRAME_BYTES = 4 * 1024 * 1024
BACKOFF_MIN = 0.1
"""Seconds before the first reconnection attempt; doubles per failure up to BACKOFF_MAX."""
BACKOFF_MAX = 2.0
GATHER_S = 0.002
"""Default `gather`: how long chunks are gathered into one frame when many requests run."""
GATHER_MIN_REQUESTS = 16
"""Requests in flight from which chunks are gathered (below it, each burst goes out at once)."""
MAX_CONCURRENT = 8
"""Requests a runner started by the `orchard` command runs at once, unless told otherwise."""
DRAIN_TIMEOUT = 30.0
"""Seconds a stopping runner lets its requests finish before cutting them short."""
LIVENESS_TIMEOUT = 3.0
"""Seconds of silence from the gateway after which the runner reconnects."""


# websockets logs handshake headers at DEBUG, the Authorization header included: never
# let this logger go below INFO, whatever --log-level says.
_WS_LOG = logging.getLogger("runner.websockets")
_WS_LOG.setLevel(logging.INFO)


def runner_url(gateway: str) -> str:
    """`http://host:port` (or ws://) → the gateway's runner WebSocket URL."""
    parts = urlsplit(gateway if "://" in gateway else f"http://{gateway}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, RUNNER_PATH, "", ""))


class Runner:
    """Serves one engine to one gateway, reconnecting as needed."""

    def __init__(
        self,
        gateway: str,
        engine: Engine,
        *,
        name: str,
        max_concurrent: int,
        hardware: Hardware,
        drain_timeout: float = DRAIN_TIMEOUT,
        liveness_timeout: float = LIVENESS_TIMEOUT,
        token: str | None = None,
        gather: float = GATHER_S,
        rediscover: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self.url = runner_url(gateway)
        self._token = token
        self._tls: ssl.SSLContext | None = None
        """The context trusting the gateway's pinned authority (wss:// only), once proven."""
        self._pinned: bytes | None = None
        """The gateway's certificate authority once pinned, kept across reconnects and new
        addresses: a leaf it issues again is trusted, another authority refused."""
        self._rediscover = rediscover
        """Where the gateway is now (mDNS), asked after a connection fails or is lost."""
        self.engine = engine
        self.name = name
        self.max_concurrent = max_concurrent
        self.hardware = hardware
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: RunnerSession | None = None
        self._outbox: list[bytes] = []
        self._events: collections.deque[EngineEvent | CacheChange] = collections.deque()
        self._chunks: list[Chunk] = []
        self._drain_scheduled = False
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._last_heard = 0.0
        self._idle = asyncio.Event()  # fired when a request ends
        self._sent = asyncio.Event()  # fired when the outbox has been written
        self.drain_timeout = drain_timeout
        self.liveness_timeout = liveness_timeout
        self.gather = gather
        """Seconds to gather chunks into one frame while GATHER_MIN_REQUESTS or more requests
        run: fewer, larger frames (less CPU here and in the gateway) for at most this much
        latency per token, small beside a model step at that load. 0 sends every burst."""
        self.frames_sent = 0
        self.chunks_sent = 0
        self.most_queued = 0
        """Most frames that waited for the gateway at once (for tests)."""
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def hello(self) -> Hello:
        return Hello(
            PROTOCOL_VERSION,
            self.name,
            self.engine.models,
            self.max_concurrent,
            self.hardware,
            self.engine.memory_budget(),
        )

    async def run(self) -> None:
        """Start the engine, then serve gateways until `stop()` (SIGTERM) has drained."""
        self._loop = asyncio.get_running_loop()
        self.engine.watch_models(self._on_model_change)
        self.engine.watch_cache(self._on_engine_event)
        await asyncio.to_thread(self.engine.start, self._on_engine_event)
        log.info("engine ready: %s", ", ".join(m.id for m in self.engine.models))
        delay = BACKOFF_MIN
        try:
            while not self._stopping.is_set():
                registered = False
                try:
                    tls = await self._tls_context()
                    async with connect(
                        self.url,
                        ssl=tls,
                        compression=None,  # tokens are tiny; deflate costs CPU and memory
                        max_size=MAX_FRAME_BYTES,
                        ping_interval=None,  # liveness is the protocol's own heartbeats
                        open_timeout=10,
                        close_timeout=2,
                        additional_headers=self._headers,
                        logger=_WS_LOG,
                    ) as ws:
                        registered = await self._serve(ws)
                except (OSError, TimeoutError, websockets.WebSocketException) as exc:
                    log.warning("gateway %s: %s", self.url, exc or type(exc).__name__)
                    if isinstance(exc, ssl.SSLCertVerificationError):
                        # Not from the pinned authority: asked again, the gateway proves the
                        # token, and another authority than the pinned one is refused.
                        self._tls = None
                if registered:
                    delay = BACKOFF_MIN  # it was up: come back fast after a blip
                if self._stopping.is_set():
                    break
                if self._rediscover is not None:
                    await self._look_again(self._rediscover)
                    if self._stopping.is_set():
                        break
                # Exponential backoff with jitter, so a restarted gateway is not stampeded.
                pause = delay * random.uniform(0.8, 1.2)
                delay = min(delay * 2, BACKOFF_MAX)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await self._stopping.wait()
        finally:
            await asyncio.to_thread(self.engine.close)

    async def _look_again(self, rediscover: Callable[[], Awaitable[str]]) -> None:
        """Find the gateway again (its address may have changed), unless stopped first."""
        looking = asyncio.ensure_future(rediscover())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({looking, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not looking.done():
            looking.cancel()
            return
        url = runner_url(looking.result())  # AmbiguousGateway goes up: ask the operator
        if url != self.url:
            log.info("the gateway is now at %s", url)
            self.url = url
            self._tls = None

    async def _tls_context(self) -> ssl.SSLContext | None:
        """For a wss:// gateway, the context trusting its certificate authority once it has
        proven that it knows the runner token (`runner.pinning`); None for ws://."""
        if not self.url.startswith("wss://"):
            return None
        if self._tls is None:
            trust = await pinned_context(self.url, self._token, self._pinned)
            self._tls = trust.context
            if trust.root is not None:
                self._pinned = trust.root
        return self._tls

    def stop(self) -> None:
        """Drain: take no new requests, finish those in flight, then leave (SIGTERM)."""
        self._stopping.set()

    async def _serve(self, ws: ClientConnection) -> bool:
        """One connection, until it drops or the runner has drained. True if registered."""
        session = RunnerSession(self.hello())
        try:
            # In the try: a gateway that refuses the runner may close before the hello goes.
            await ws.send(encode(session.hello), text=True)
            async with asyncio.timeout(10):
                welcome = decode_gateway_frame(await ws.recv())
            session.receive(welcome)
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == CloseCode.UNAUTHORIZED:
                raise Unauthorized(exc.rcvd.reason) from exc
            raise
        except ProtocolError as exc:
            log.error("gateway refused the handshake: %s", exc)
            await ws.close(exc.close_code, exc.reason)
            return False
        assert isinstance(welcome, Welcome)
        self.connections += 1
        log.info("registered with %s as %s", self.url, welcome.runner_id)
        self._session = session
        self._outbox.clear()
        self._last_heard = time.monotonic()
        # A model that changed while the hello was on its way (dropped then: no session yet).
        for now, said in zip(self.engine.models, session.hello.models, strict=False):
            if now != said:
                self._queue(encode(ModelStatus(now)))
        for model, held in self.engine.cache_held().items():
            self._queue(encode(CacheHeld(model, held, reset=True)))
        tasks = [
            asyncio.create_task(self._receive_loop(ws, session)),
            asyncio.create_task(self._send_loop(ws)),
            asyncio.create_task(self._heartbeat_loop(welcome.heartbeat_interval)),
            asyncio.create_task(self._drain_when_stopping(session)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        except ProtocolError as exc:
            log.error("gateway broke the protocol: %s", exc)
            await ws.close(exc.close_code, exc.reason)
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == CloseCode.UNAUTHORIZED:
                raise Unauthorized(exc.rcvd.reason) from exc
            log.warning("gateway connection closed: %s", exc)
        except GatewaySilent as exc:
            log.warning("%s; reconnecting", exc)
        finally:
            self._session = None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for request_id in session.close():
                self.engine.cancel(request_id)  # no orphan generation
            if self._stopping.is_set():
                with contextlib.suppress(Exception):
                    await ws.close(CloseCode.NORMAL, "runner drained")
        return True

    async def _drain_when_stopping(self, session: RunnerSession) -> None:
        """On stop: tell the gateway, let in-flight requests finish (up to the deadline)."""
        await self._stopping.wait()
        self._queue(encode(session.drain()))
        log.info("draining %d request(s)", len(session.in_flight))
        if not await self._until(self._idle, lambda: not session.in_flight, self.drain_timeout):
            for request_id in session.in_flight:
                self.engine.cancel(request_id)  # past the deadline: cut them short
            await self._until(self._idle, lambda: not session.in_flight, 5)
        await self._until(self._sent, lambda: not self._outbox, 5)

    @staticmethod
    async def _until(event: asyncio.Event, done: Callable[[], bool], seconds: float) -> bool:
        """Wait for `done()`, re-checked each time `event` fires; False on timeout."""
        try:
            async with asyncio.timeout(seconds):
                while not done():
                    event.clear()
                    await event.wait()
        except TimeoutError:
            return False
        return True

    async def _receive_loop(self, ws: ClientConnection, session: RunnerSession) -> None:
        async for data in ws:
            self._last_heard = time.monotonic()
            frame = decode_gateway_frame(data)
            refusal = session.receive(frame)
            if refusal is not None:
                self._queue(encode(refusal))
            elif isinstance(frame, Generate):
                self.engine.submit(frame)
            elif isinstance(frame, Cancel):
                self.engine.cancel(frame.request_id)

    async def _send_loop(self, ws: ClientConnection) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._outbox = self._outbox, []
            self.most_queued = max(self.most_queued, len(batch))
            for data in batch:
                await ws.send(data, text=True)
            self._sent.set()

    async def _heartbeat_loop(self, interval: float) -> None:
        """Send heartbeats; give up on a gateway that has gone silent (frozen, cut off)."""
        while True:
            kv = self.engine.kv_usage()
            self._queue(
                encode(
                    Heartbeat(
                        time.time(),
                        kv.bytes,
                        kv.limit_bytes,
                        kv.prefix_bytes,
                        kv.disk_bytes,
                        kv.disk_limit_bytes,
                        self.engine.speculation(),
                    )
                )
            )
            await asyncio.sleep(interval)
            silent = time.monotonic() - self._last_heard
            if silent > self.liveness_timeout:
                raise GatewaySilent(f"nothing from the gateway for {silent:.1f} s")

    def _queue(self, data: bytes) -> None:
        self._outbox.append(data)
        self._wake.set()

    def _on_engine_event(self, event: EngineEvent | CacheChange) -> None:
        """Called on the engine's thread: queue the event (an output, a failure or a change
        of the prefixes held, in the order they happened) and wake the loop once per burst."""
        self._events.append(event)
        if self._drain_scheduled:
            return
        self._drain_scheduled = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing during shutdown
                loop.call_soon_threadsafe(self._schedule_drain)

    def _on_model_change(self, info: ModelInfo) -> None:
        """Called on any thread: tell the gateway (a later hello carries the news anyway)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing during shutdown
                loop.call_soon_threadsafe(self._send_model_status, info)

    def _send_model_status(self, info: ModelInfo) -> None:
        if self._session is not None:
            self._queue(encode(ModelStatus(info)))

    def _schedule_drain(self) -> None:
        """On the loop: drain now, or after `gather` when many requests are running."""
        session = self._session
        many = session is not None and session.in_flight_count >= GATHER_MIN_REQUESTS
        if self.gather > 0 and many:
            assert self._loop is not None
            self._loop.call_later(self.gather, self._drain_events)
        else:
            self._drain_events()

    def _drain_events(self) -> None:
        """On the loop: send what the engine produced since the last wake-up.

        Outputs of one request that piled up are merged into one chunk per choice
        (`protocol.merge`, a choice's echo pieces kept apart), so a busy loop sends fewer,
        larger frames; a lone token still goes out at once.
        """
        self._drain_scheduled = False  # before draining: a later event schedules anew
        pending: dict[str, list[Output]] = {}
        while self._events:
            event = self._events.popleft()
            if isinstance(event, CacheChange):
                self._cache_held(event)
                continue
            rid = event.request_id
            if isinstance(event, Output):
                pending.setdefault(rid, []).append(event)
                continue
            for merged in merge(pending.pop(rid, []), echo_apart=True):
                self._emit(merged)
            self._emit(event)
        for piled in pending.values():
            for merged in merge(piled, echo_apart=True):
                self._emit(merged)
        self._flush_chunks()

    def _cache_held(self, change: CacheChange) -> None:
        """Tell the gateway, ahead of the outputs that came after the change."""
        if self._session is None:
            return  # the next connection starts with all that is held
        self._flush_chunks()
        self._queue(encode(CacheHeld(change.model, change.added, change.removed, change.reset)))

    def _flush_chunks(self) -> None:
        """Chunks of one wake-up, of any requests, go out as one message."""
        chunks = self._chunks
        if not chunks:
            return
        self._chunks = []
        self.frames_sent += 1
        self.chunks_sent += len(chunks)
        self._queue(encode(chunks[0] if len(chunks) == 1 else Batch(tuple(chunks))))

    def _emit(self, event: EngineEvent) -> None:
        session = self._session
        if session is None or not session.is_in_flight(event.request_id):
            return  # a request of a connection that is gone
        if isinstance(event, Failure):
            self._flush_chunks()  # keep order: this request's chunks go first
            self._queue(
                encode(session.error(event.request_id, event.code, event.message, event.param))
            )
        else:
            if event.echo is not None:
                self._flush_chunks()  # a piece of a prompt travels alone (frames stay small)
            self._chunks.append(
                session.chunk(
                    event.request_id,
                    text=event.text,
                    reasoning=event.reasoning,
                    tokens=event.tokens,
                    usage=event.usage,
                    finish_reason=event.finish_reason,
                    stats=event.stats,
                    tool_calls=event.tool_calls,
                    logprobs=event.logprobs,
                    index=event.index,
                    choice_finish=event.choice_finish,
                    echo=event.echo,
                    matched_stop=event.matched_stop,
                )
            )
            if event.echo is not None:
                self._flush_chunks()
        if isinstance(event, Failure) or event.finish_reason is not None:
            self._idle.set()
