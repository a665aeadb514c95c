"""The I/O every client WebSocket shares: the browser socket (`/v1/ws`, gateway.browser) and
the Responses API's WebSocket mode (`/v1/responses`, gateway.openai.responses.socket).

- `serve_socket`: the handler's frame around a socket: accept, the origin rule (4011), the
  cap on open client sockets (`max_client_sockets`, both kinds together: 1013), a bug in a
  socket closing it with 1011 and being logged, the pool's memory trimmed when the last one
  leaves.
- `ClientSocket`: the pump. One writer task sends every message in order (messages never
  interleave) from an outbox bounded by `max_client_backlog_bytes` (a client that does not
  read is closed with 4010); the reader hands each message to the socket's `SocketApi`; the
  auth deadline; closing stops every request the socket carried. It is the `Transport` of its
  requests' relays: the outbox takes everything, so a write never waits.
- `relay_on_socket`: one request of a socket: submit, then `relay_from_first`
  (gateway.streaming.endpoint) with the socket as its transport, until its last message.

What a socket's messages mean is its API's session (protocol.browser.session,
protocol.openai.responses.socket); here only the pumping.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from litestar import WebSocket
from litestar.datastructures import State

from gateway.auth import bearer, origin_allowed, secret_in
from gateway.config import GatewayConfig
from gateway.http_errors import api_error_for
from gateway.pool.pool import Pool
from gateway.streaming.endpoint import Cancel, relay_from_first, submit
from gateway.streaming.keeper import Keeper
from gateway.streaming.relay import Relay, Transport
from gateway.streaming.request_stream import RequestStream
from protocol.closecodes import CloseCode
from protocol.core.stream import CompletionStream
from protocol.frames import Generate

log = logging.getLogger("gateway.client_ws")


class SocketApi(Protocol):
    """What a socket's API does with it (the pump calls these)."""

    def receive(self, data: bytes | str) -> None:
        """One message from the client."""

    def auth_timed_out(self) -> tuple[int, str] | None:
        """The auth deadline passed: the close code and reason if it must close."""

    def stop(self) -> Sequence[asyncio.Task[Any]]:
        """The socket closes: stop every request (at once); the tasks to wait for."""


class _Closed(Exception):
    pass


class ClientSocket:
    """The I/O of one client WebSocket (see the module docstring)."""

    def __init__(self, socket: WebSocket[Any, Any, Any], config: GatewayConfig) -> None:
        self.socket = socket
        self.config = config
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_bytes = 0
        self._wake = asyncio.Event()
        self._close_now = asyncio.Event()
        self._close_reason: tuple[int, str] = (CloseCode.NORMAL, "")
        self._api: SocketApi | None = None
        self._ending: list[asyncio.Task[Any]] = []
        """Request tasks stopped because the socket closes, to be awaited."""
        self.closed = False

    def authenticated(self) -> bool:
        """The upgrade request brought a valid key (or the gateway has none): no `auth`
        message is needed."""
        keys = self.config.api_keys
        return not keys or secret_in(bearer(self.socket.headers), keys)

    def key_ok(self, key: str) -> bool:
        """An `auth` message's key is one of the gateway's."""
        return secret_in(key, self.config.api_keys)

    # --- output: one writer task, so messages never interleave ------------------------

    def send(self, data: bytes) -> None:
        """Queue one whole message."""
        if self.closed:
            return
        self._outbox.append(data)
        self._outbox_bytes += len(data)
        self._wake.set()
        if self._outbox_bytes > self.config.max_client_backlog_bytes:
            # The client is not reading: drop it rather than hold unbounded output.
            log.warning("client socket too slow (%d bytes unsent); closing", self._outbox_bytes)
            self._outbox.clear()
            self.close_with(CloseCode.CLIENT_TOO_SLOW, "client too slow")

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                data = self._outbox.popleft()
                self._outbox_bytes -= len(data)
                await self.socket.send(
                    {"type": "websocket.send", "text": data.decode(), "bytes": None}
                )

    # `Transport` of the relays: the outbox takes everything (a client that falls too far
    # behind is closed), so a write never waits.
    keepalive = None

    def write(self, messages: list[bytes], last: bool) -> Awaitable[None] | None:
        for message in messages:
            self.send(message)
        return None

    # --- the socket's life ------------------------------------------------------------

    def close_with(self, code: int, reason: str) -> None:
        """End the socket from synchronous code (the run loop does the closing)."""
        if self.closed:
            return  # the first reason stands
        self.closed = True
        self._stop_all()  # at once, not after the close handshake
        self._close_reason = (code, reason)
        self._close_now.set()

    def _stop_all(self) -> None:
        if self._api is not None:
            self._ending += self._api.stop()

    async def _auth_deadline(self, api: SocketApi) -> None:
        await asyncio.sleep(self.config.auth_timeout)
        refusal = api.auth_timed_out()
        if refusal is not None:
            self.close_with(*refusal)

    async def run(self, api: SocketApi) -> None:
        """Pump until the client or `close_with` ends the socket."""
        self._api = api
        writer = asyncio.create_task(self._writer())
        reader = asyncio.create_task(self._reader(api))
        closer = asyncio.create_task(self._close_now.wait())
        deadline = asyncio.create_task(self._auth_deadline(api))
        try:
            await asyncio.wait({reader, closer}, return_when=asyncio.FIRST_COMPLETED)
            if self._close_now.is_set():
                with contextlib.suppress(Exception):  # a stalled peer may never take it
                    async with asyncio.timeout(1):
                        await self.socket.close(*self._close_reason)
            elif reader.done() and not reader.cancelled():
                reader.result()
        finally:
            for task in (reader, closer, deadline, writer):
                task.cancel()
            self.closed = True
            self._stop_all()  # the socket is gone: stop its generations
            await asyncio.gather(writer, reader, *self._ending, return_exceptions=True)

    async def _reader(self, api: SocketApi) -> None:
        with contextlib.suppress(_Closed):
            while True:
                api.receive(await self._receive())

    async def _receive(self) -> bytes | str:
        message: dict[str, Any] = await self.socket.receive()  # type: ignore[assignment]
        if message["type"] == "websocket.disconnect":
            raise _Closed
        data: bytes | str = message.get("text") or message.get("bytes") or b""
        return data


async def serve_socket(
    socket: WebSocket[Any, Any, Any],
    state: State,
    api: Callable[[ClientSocket], SocketApi],
) -> None:
    """Serve one client WebSocket with the API `api` makes for it (see the module
    docstring)."""
    await socket.accept()
    config: GatewayConfig = state.config
    if not origin_allowed(socket.headers.get("origin"), socket.headers.get("host"), config):
        await socket.close(CloseCode.ORIGIN_NOT_ALLOWED, "origin not allowed")
        return
    open_sockets: list[None] = state.client_sockets
    if len(open_sockets) >= config.max_client_sockets:
        await socket.close(CloseCode.TRY_AGAIN_LATER, "too many open sockets")
        return
    open_sockets.append(None)
    pool: Pool = state.pool
    pool.trimmer.busy(len(open_sockets))
    try:
        client = ClientSocket(socket, config)
        await client.run(api(client))
    except Exception:  # a bug here must not take the server down; it must be seen
        log.exception("client socket failed")
        with contextlib.suppress(Exception):
            await socket.close(CloseCode.INTERNAL_ERROR, "internal error")
    finally:
        open_sockets.pop()
        if not open_sockets and not pool.in_flight():
            pool.trimmer.idle()  # a crowd of sockets left: give their memory back


async def relay_on_socket(
    pool: Pool,
    id: str,
    generates: Sequence[Generate],
    completion: CompletionStream,
    transport: Transport,
    *,
    label: str,
    keeper: Keeper | None = None,
    placed: Callable[[RequestStream, Cancel], None] | None = None,
) -> None:
    """Run one request with no HTTP response of its own (a socket's, a background
    response's) to its last message: submit (a failure is the request's
    error), then relay it to `transport` (the socket, or a transport of the request's own
    over it). `placed` learns its stream (to cancel it) once a runner has it. A task
    cancelled while it waits for a runner leaves the completion open (the caller ends it)."""
    try:
        stream, cancel = await submit(pool, id, generates, label)
    except Exception as exc:
        out: list[bytes] = []
        completion.fail(api_error_for(exc), out)
        transport.write(out, True)
        return
    if placed is not None:
        placed(stream, cancel)
    relay: Relay | None = None
    try:
        relay, first = await relay_from_first(
            stream, completion, transport, pool.config, cancel, keeper=keeper
        )
        relay.start(first, commit=first is None)
        await relay.done
    finally:
        if relay is not None:
            relay.close()
        elif not stream.done:
            cancel(stream)
