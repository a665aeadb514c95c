"""The runner's transport: one persistent WebSocket to the gateway, forever.

Connects, says hello, waits for welcome, then serves Generate/Cancel frames through the
engine and streams its output back as numbered chunks. When the connection drops, every
request it carried is cancelled in the engine (no orphan generation) and the runner
reconnects with exponential backoff and jitter (websockets' `connect` iterator), saying
hello again each time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import websockets
from websockets.asyncio.client import ClientConnection, connect

from protocol.closecodes import CloseCode
from protocol.codec import decode_gateway_frame, encode
from protocol.errors import ProtocolError
from protocol.frames import (
    PROTOCOL_VERSION,
    Cancel,
    Generate,
    Hardware,
    Heartbeat,
    Hello,
    Welcome,
)
from protocol.session import RunnerSession
from runner.engine.base import Engine, EngineEvent, Failure, Output

log = logging.getLogger("runner.client")

RUNNER_PATH = "/v1/runner/ws"
MAX_FRAME_BYTES = 4 * 1024 * 1024


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
    ) -> None:
        self.url = runner_url(gateway)
        self.engine = engine
        self.name = name
        self.max_concurrent = max_concurrent
        self.hardware = hardware
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: RunnerSession | None = None
        self._outbox: list[bytes] = []
        self._events: collections.deque[EngineEvent] = collections.deque()
        self._drain_scheduled = False
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    def hello(self) -> Hello:
        return Hello(
            PROTOCOL_VERSION, self.name, self.engine.models, self.max_concurrent, self.hardware
        )

    async def run(self) -> None:
        """Start the engine, then serve gateways until `stop()`."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.engine.start, self._on_engine_event)
        log.info("engine ready: %s", ", ".join(m.id for m in self.engine.models))
        try:
            async for ws in connect(
                self.url,
                compression=None,  # tokens are tiny; deflate costs CPU and ~64 KiB/conn
                max_size=MAX_FRAME_BYTES,
                ping_interval=None,  # liveness is the protocol's own heartbeats
                open_timeout=10,
                logger=logging.getLogger("runner.websockets"),
            ):
                if self._stopping.is_set():
                    await ws.close()
                    break
                try:
                    await self._serve(ws)
                except websockets.ConnectionClosed as exc:
                    log.warning("gateway connection closed: %s", exc)
                if self._stopping.is_set():
                    break
                await asyncio.sleep(0.1)  # then reconnect (backoff applies to failures)
        finally:
            await asyncio.to_thread(self.engine.close)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def _serve(self, ws: ClientConnection) -> None:
        session = RunnerSession(self.hello())
        await ws.send(encode(session.hello), text=True)
        try:
            async with asyncio.timeout(10):
                welcome = decode_gateway_frame(await ws.recv())
            session.receive(welcome)
        except ProtocolError as exc:
            await ws.close(exc.close_code, exc.reason)
            return
        assert isinstance(welcome, Welcome)
        self.connections += 1
        log.info("registered with %s as %s", self.url, welcome.runner_id)
        self._session = session
        self._outbox.clear()
        tasks = [
            asyncio.create_task(self._receive_loop(ws, session)),
            asyncio.create_task(self._send_loop(ws)),
            asyncio.create_task(self._heartbeat_loop(welcome.heartbeat_interval)),
            asyncio.create_task(self._stopping.wait()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        except ProtocolError as exc:
            log.error("gateway broke the protocol: %s", exc)
            await ws.close(exc.close_code, exc.reason)
        finally:
            self._session = None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for request_id in session.close():
                self.engine.cancel(request_id)  # no orphan generation
            if self._stopping.is_set():
                with contextlib.suppress(Exception):
                    await ws.close(CloseCode.NORMAL, "runner stopping")

    async def _receive_loop(self, ws: ClientConnection, session: RunnerSession) -> None:
        async for data in ws:
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
            for data in batch:
                await ws.send(data, text=True)

    async def _heartbeat_loop(self, interval: float) -> None:
        while True:
            self._queue(encode(Heartbeat(time.time())))
            await asyncio.sleep(interval)

    def _queue(self, data: bytes) -> None:
        self._outbox.append(data)
        self._wake.set()

    def _on_engine_event(self, event: EngineEvent) -> None:
        """Called on the engine's thread: queue the event and wake the loop once per burst."""
        self._events.append(event)
        if self._drain_scheduled:
            return
        self._drain_scheduled = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing during shutdown
                loop.call_soon_threadsafe(self._drain_events)

    def _drain_events(self) -> None:
        """On the loop: send what the engine produced since the last wake-up.

        Outputs of one request that piled up are merged into one chunk, so a busy loop
        sends fewer, larger frames; a lone token still goes out at once.
        """
        self._drain_scheduled = False  # before draining: a later event schedules anew
        pending: dict[str, Output] = {}
        while self._events:
            event = self._events.popleft()
            rid = event.request_id
            prev = pending.get(rid)
            if isinstance(event, Output) and prev is not None:
                pending[rid] = Output(
                    rid,
                    prev.text + event.text,
                    prev.reasoning + event.reasoning,
                    prev.tokens + event.tokens,
                    event.usage,
                    event.finish_reason,
                    event.stats,
                )
            elif isinstance(event, Output):
                pending[rid] = event
            else:
                if prev is not None:
                    self._emit(pending.pop(rid))
                self._emit(event)
        for output in pending.values():
            self._emit(output)

    def _emit(self, event: EngineEvent) -> None:
        session = self._session
        if session is None or not session.is_in_flight(event.request_id):
            return  # a request of a connection that is gone
        if isinstance(event, Failure):
            frame: Any = session.error(event.request_id, event.code, event.message)
        else:
            assert isinstance(event, Output)
            frame = session.chunk(
                event.request_id,
                text=event.text,
                reasoning=event.reasoning,
                tokens=event.tokens,
                usage=event.usage,
                finish_reason=event.finish_reason,
                stats=event.stats,
            )
        self._queue(encode(frame))
