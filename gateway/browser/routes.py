"""`/v1/ws`: the browser WebSocket API. One socket multiplexes many chat completions.

This module only pumps. What each message means, which are legal when, and every reply about
a bad one is `protocol.browser.session.ClientSession`; what a request's client sees is its
`CompletionStream` with the browser framing (`protocol.browser.framing`), written by the same
`Relay` as SSE (gateway.streaming.relay). Here: the socket's reader and its single writer (messages
never interleave), one task per request (submit, then relay), the auth deadline and the pool
view. See docs/websocket-api.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from litestar import WebSocket, websocket
from litestar.datastructures import State

from gateway.auth import bearer, origin_allowed, secret_in
from gateway.config import GatewayConfig
from gateway.http_errors import api_error_for
from gateway.observability.admin import runner_info
from gateway.observability.history import RunnerReading
from gateway.openai.chat.routes import keeper_of
from gateway.pool.pool import Pool
from gateway.stores.chat import CompletionStore
from gateway.streaming.endpoint import relay_from_first
from gateway.streaming.keeper import Keeper
from gateway.streaming.relay import Relay
from gateway.streaming.request_stream import RequestStream
from protocol.browser.framing import BrowserFraming
from protocol.browser.messages import CLIENT_WS_PATH, PoolState, encode
from protocol.browser.session import ClientSession, CloseSocket, Reply, Start, Stop, Subscribe
from protocol.closecodes import CloseCode
from protocol.core.stream import CompletionStream
from protocol.frames import Generate
from protocol.openai.chat.request import ChatRequest
from protocol.openai.chat.response import chat_writer

log = logging.getLogger("gateway.client_ws")

POOL_STATE_INTERVAL = 1.0


class _Closed(Exception):
    pass


class _Request:
    """What the socket holds for one request in flight (the session's handle)."""

    __slots__ = ("completion", "keeper", "stream", "task")

    def __init__(self, completion: CompletionStream, keeper: Keeper | None) -> None:
        self.completion = completion
        self.keeper = keeper
        """Stores the completion (`store: true` requests only)."""
        self.task: asyncio.Task[None] | None = None
        self.stream: RequestStream | None = None
        """Set once a runner has it: from then on a cancel goes to the runner."""


class ClientSocket:
    """The I/O of one browser socket."""

    def __init__(
        self, socket: WebSocket[Any, Any, Any], pool: Pool, store: CompletionStore
    ) -> None:
        self.socket = socket
        self.pool = pool
        self.store = store
        self.config = config = pool.config
        authenticated = not config.api_keys or secret_in(bearer(socket.headers), config.api_keys)
        self.session: ClientSession[_Request] = ClientSession(
            verify_key=None if authenticated else self._key_ok,
            max_requests=config.max_client_requests,
            max_message_bytes=config.max_client_message_bytes,
            max_tokens_limit=config.max_tokens_limit,
            store=store.enabled,
            max_choices=config.max_choices,
        )
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_bytes = 0
        self._wake = asyncio.Event()
        self._close_now = asyncio.Event()
        self._close_reason: tuple[int, str] = (CloseCode.NORMAL, "")
        self._subscription: asyncio.Task[None] | None = None
        self._ending: list[asyncio.Task[None]] = []
        """Request tasks cancelled because the socket closes, to be awaited."""
        self.closed = False

    def _key_ok(self, key: str) -> bool:
        return secret_in(key, self.config.api_keys)

    # --- output: one writer task, so messages never interleave ------------------------

    def send(self, data: bytes) -> None:
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

    # `Transport` for the relays of this socket's requests: the outbox takes everything (a
    # client that falls too far behind is closed), so a write never waits.
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
        self._cancel_all()  # at once, not after the close handshake
        self._close_reason = (code, reason)
        self._close_now.set()

    def _cancel_all(self) -> None:
        for request in self.session.close():
            if request.stream is not None:
                self.pool.cancel(request.stream)
            if request.task is not None:
                request.task.cancel()
                self._ending.append(request.task)

    async def _auth_deadline(self) -> None:
        await asyncio.sleep(self.config.auth_timeout)
        refusal = self.session.auth_timed_out()
        if refusal is not None:
            self.close_with(refusal.code, refusal.reason)

    async def run(self) -> None:
        writer = asyncio.create_task(self._writer())
        reader = asyncio.create_task(self._reader())
        closer = asyncio.create_task(self._close_now.wait())
        deadline = asyncio.create_task(self._auth_deadline())
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
            if self._subscription is not None:
                self._subscription.cancel()
            self._cancel_all()  # the socket is gone: stop its generations
            await asyncio.gather(writer, reader, *self._ending, return_exceptions=True)

    async def _reader(self) -> None:
        with contextlib.suppress(_Closed):
            while True:
                self._handle(await self._receive())

    async def _receive(self) -> bytes | str:
        message: dict[str, Any] = await self.socket.receive()  # type: ignore[assignment]
        if message["type"] == "websocket.disconnect":
            raise _Closed
        data: bytes | str = message.get("text") or message.get("bytes") or b""
        return data

    def _handle(self, data: bytes | str) -> None:
        for event in self.session.receive(data):
            match event:
                case Reply(data=reply):
                    self.send(reply)
                case Start(request_id=rid, chat=chat):
                    self._start(rid, chat)
                case Stop(handle=request):
                    self._stop(request)
                case Subscribe():
                    self._subscription = asyncio.create_task(self._pool_states())
                case CloseSocket(code=code, reason=reason):
                    self.close_with(code, reason)

    def _stop(self, request: _Request | None) -> None:
        if request is None:
            return
        if request.stream is not None:
            self.pool.cancel(request.stream)  # the runner ends it: `done` "cancelled" follows
        elif request.task is not None:
            request.task.cancel()  # still waiting for a runner

    # --- one request ----------------------------------------------------------------------

    def _start(self, rid: str, chat: ChatRequest) -> None:
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        fingerprint = self.pool.fingerprint(chat.model)
        framing = BrowserFraming(rid)
        writer = chat_writer(
            chat, id=completion_id, created=created, fingerprint=fingerprint, framing=framing
        )
        keeper = keeper_of(
            self.store,
            chat,
            id=completion_id,
            created=created,
            fingerprint=fingerprint,
            request_id=f"req_{uuid.uuid4().hex}",
        )
        request = _Request(CompletionStream(writer, framing, n=chat.n), keeper)
        task = asyncio.create_task(self._run(chat.to_generate(completion_id), request))
        request.task = task
        task.add_done_callback(lambda _: self._ended(rid, request))
        self.session.bind(rid, request)

    async def _run(self, generate: Generate, request: _Request) -> None:
        """Submit, then relay. A task cancelled before it ran never gets here (`_ended`)."""
        try:
            stream = await self.pool.submit(generate, "websocket")
        except Exception as exc:
            out: list[bytes] = []
            request.completion.fail(api_error_for(exc), out)
            self.write(out, True)
            return
        request.stream = stream
        relay: Relay | None = None
        try:
            relay, first = await relay_from_first(
                stream,
                request.completion,
                self,
                self.config,
                self.pool.cancel,
                keeper=request.keeper,
            )
            relay.start(first, commit=first is None)
            await relay.done
        finally:
            if relay is not None:
                relay.close()
            elif not stream.done:
                self.pool.cancel(stream)

    def _ended(self, rid: str, request: _Request) -> None:
        """The request's task ended. Cancelled before a runner answered (even before the task
        ran), the request still owes the client its `done`."""
        if not request.completion.over:
            out: list[bytes] = []
            request.completion.cancel(out)
            self.write(out, True)
        self.session.ended(rid)

    # --- live pool view ---------------------------------------------------------------------

    async def _pool_states(self) -> None:
        previous: dict[str, tuple[float, int]] = {}
        history = self.pool.metrics.history
        while True:
            now = time.monotonic()
            history.observe_runners(
                time.perf_counter(),
                [
                    RunnerReading(
                        conn.id,
                        conn.name,
                        tuple(m.id for m in conn.hello.models),
                        conn.session.tokens_generated,
                    )
                    for conn in self.pool.runners.values()
                ],
            )
            runners = []
            for conn in self.pool.runners.values():
                info = runner_info(conn)
                generated = conn.session.tokens_generated
                then, tokens = previous.get(conn.id, (now, generated))
                rate = (generated - tokens) / (now - then) if now > then else 0.0
                info["tokens_per_second"] = round(rate, 1)
                previous[conn.id] = (now, generated)
                runners.append(info)
            self.send(
                encode(
                    PoolState(
                        runners=runners,
                        requests_in_flight=self.pool.in_flight(),
                        queue_depth=self.pool.queue_depth(),
                        models=sorted(self.pool.models()),
                        history=history.view(time.perf_counter()),
                    )
                )
            )
            await asyncio.sleep(POOL_STATE_INTERVAL)


@websocket(CLIENT_WS_PATH)
async def client_socket(socket: WebSocket[Any, Any, Any], state: State) -> None:
    """A browser app's socket: many concurrent chat completions."""
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
        await ClientSocket(socket, pool, state.store).run()
    except Exception:  # a bug here must not take the server down; it must be seen
        log.exception("client socket failed")
        with contextlib.suppress(Exception):
            await socket.close(CloseCode.INTERNAL_ERROR, "internal error")
    finally:
        open_sockets.pop()
        if not open_sockets and not pool.in_flight():
            pool.trimmer.idle()  # a crowd of sockets left: give their memory back
