"""The runner WebSocket endpoint: handshake, frame routing, heartbeats, liveness.

Each runner connection runs one receive loop (decode → session → pool) and one
watchdog task (sends heartbeats, drops the runner when it has been silent too long, which
also catches a frozen process whose socket stays open). Any protocol violation closes that
runner's socket with the error's 4xxx code; only its own requests fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from litestar import WebSocket, websocket
from litestar.datastructures import State

from gateway.auth import bearer, is_loopback, secret_in
from gateway.config import GatewayConfig
from gateway.pool.placement import Placement, RunnerConn
from gateway.pool.pool import Pool
from protocol.closecodes import CloseCode
from protocol.codec import decode_runner_frame, encode
from protocol.errors import ProtocolError
from protocol.frames import PROTOCOL_VERSION, RUNNER_PATH, Heartbeat, Welcome
from protocol.session import Delivered, GatewaySession, RunnerFailed

log = logging.getLogger("gateway.runner_link")

WATCHDOG_TICK = 0.25
"""Seconds between liveness checks: a silent runner is dropped at most this late."""


class _Closed(Exception):
    """The peer closed the socket."""


class _Link:
    """I/O for one runner socket, over raw ASGI messages (no per-frame wrappers)."""

    def __init__(self, socket: WebSocket[Any, Any, Any], config: GatewayConfig) -> None:
        self.socket = socket
        self.config = config
        self.last_seen = time.monotonic()
        self.closed = False

    async def receive(self) -> bytes | str:
        message: dict[str, Any] = await self.socket.receive()  # type: ignore[assignment]
        if message["type"] == "websocket.disconnect":
            self.closed = True
            raise _Closed
        self.last_seen = time.monotonic()
        data: bytes | str = message.get("text") or message.get("bytes") or b""
        if len(data) > self.config.max_runner_frame_bytes:
            raise ProtocolError(
                f"frame of {len(data)} bytes over the {self.config.max_runner_frame_bytes} limit",
                close_code=CloseCode.FRAME_TOO_LARGE,
            )
        return data

    async def send(self, data: bytes) -> None:
        """Send a frame; a closed socket is noticed by the receive loop, not here."""
        if self.closed:
            return
        try:
            await self.socket.send({"type": "websocket.send", "text": data.decode(), "bytes": None})
        except Exception:  # any transport failure means the link is gone
            self.closed = True

    async def close(self, code: int, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await self.socket.close(code=code, reason=reason)


@websocket(RUNNER_PATH)
async def runner_socket(socket: WebSocket[Any, Any, Any], state: State) -> None:
    """A runner's persistent connection."""
    pool: Pool = state.pool
    config = pool.config
    await socket.accept()
    link = _Link(socket, config)
    session: GatewaySession[Placement] = GatewaySession()
    conn: RunnerConn | None = None
    peer = socket.client.host if socket.client else None
    refusal = runner_refusal(socket, peer, config)
    if refusal is not None:
        log.warning("refused a runner from %s: %s", peer, refusal)
        await link.close(CloseCode.UNAUTHORIZED, refusal)
        return
    try:
        await _handshake(link, session, config)
        conn = RunnerConn(pool.new_runner_id(), session, link.send, link.close)
        await link.send(encode(Welcome(conn.id, PROTOCOL_VERSION, config.heartbeat_interval)))
        pool.add(conn)
        await _serve(link, session, pool, conn)
    except _Closed:
        pass
    except ProtocolError as exc:
        log.warning("closing runner link from %s: %s", peer, exc)
        await link.close(exc.close_code, exc.reason)
    except asyncio.CancelledError:
        await link.close(CloseCode.GOING_AWAY, "gateway shutting down")
        raise
    finally:
        if conn is not None:
            pool.remove(conn)


def runner_refusal(
    socket: WebSocket[Any, Any, Any], peer: str | None, config: GatewayConfig
) -> str | None:
    """Why this runner may not connect, or None."""
    if config.runner_token is not None:
        if not secret_in(bearer(socket.headers), (config.runner_token,)):
            return "missing or wrong runner token"
    elif not config.insecure and not is_loopback(peer):
        return "this gateway takes runners from loopback only (no runner token set)"
    return None


async def _handshake(
    link: _Link, session: GatewaySession[Placement], config: GatewayConfig
) -> None:
    try:
        async with asyncio.timeout(config.handshake_timeout):
            frame = decode_runner_frame(await link.receive())
            session.receive(frame)
    except TimeoutError:
        raise ProtocolError(
            "no hello within the handshake timeout", close_code=CloseCode.HANDSHAKE_TIMEOUT
        ) from None


async def _serve(
    link: _Link, session: GatewaySession[Placement], pool: Pool, conn: RunnerConn
) -> None:
    """Run the receive loop and the watchdog until either ends; re-raise what ended it."""
    tasks = {
        asyncio.create_task(_receive_loop(link, session, pool, conn)),
        asyncio.create_task(_watchdog(link, pool.config)),
    }
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        task.result()


async def _receive_loop(
    link: _Link, session: GatewaySession[Placement], pool: Pool, conn: RunnerConn
) -> None:
    """Every frame goes through the session, which says what it means; the pool acts on it."""
    deliver = pool.deliver
    while True:
        for event in session.receive(decode_runner_frame(await link.receive())):
            if type(event) is Delivered:  # the per-token path, without the dispatch below
                deliver(conn, event.handle, event.chunk)
                continue
            pool.on_event(conn, event)
            if isinstance(event, RunnerFailed):
                await link.close(CloseCode.RUNNER_ERROR, "runner reported an error")
                return


async def _watchdog(link: _Link, config: GatewayConfig) -> None:
    """Send heartbeats; end the link when the runner has been silent too long.

    Silence, not a closed socket, is what catches a frozen (e.g. SIGSTOPped) runner.
    """
    tick = min(config.heartbeat_interval, WATCHDOG_TICK)
    next_beat = time.monotonic()
    while True:
        now = time.monotonic()
        silent = now - link.last_seen
        if silent > config.liveness_timeout:
            raise ProtocolError(
                f"no frame for {silent:.1f} s", close_code=CloseCode.HEARTBEAT_TIMEOUT
            )
        if now >= next_beat:
            await link.send(encode(Heartbeat(time.time())))
            next_beat = now + config.heartbeat_interval
        await asyncio.sleep(tick)
