"""`/v1/ws`: the browser WebSocket API. One socket multiplexes many chat completions.

This module only acts on the session's events. What each message means, which are legal when,
and every reply about a bad one is `protocol.browser.session.ClientSession`; what a request's
client sees is its `CompletionStream` with the browser framing (`protocol.browser.framing`),
written by the same `Relay` as SSE (gateway.streaming.relay). The pump (the reader, the single
writer, the auth deadline, origin and socket limits) is every client socket's
(gateway.streaming.socket); here: one task per request (`relay_on_socket`: submit, then
relay), cancels and the pool view. See docs/websocket-api.md.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from litestar import WebSocket, websocket
from litestar.datastructures import State

from gateway.observability.admin import runner_info
from gateway.observability.history import RunnerReading
from gateway.openai.chat.routes import keeper_of
from gateway.pool.pool import Pool
from gateway.stores.chat import CompletionStore
from gateway.streaming.endpoint import Cancel
from gateway.streaming.keeper import Keeper
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.socket import ClientSocket, relay_on_socket, serve_socket
from protocol.browser.framing import BrowserFraming
from protocol.browser.messages import CLIENT_WS_PATH, PoolState, encode
from protocol.browser.session import ClientSession, Start, Stop, Subscribe
from protocol.client_socket import CloseSocket, Reply
from protocol.core.stream import CompletionStream
from protocol.openai.chat.request import ChatRequest
from protocol.openai.chat.response import chat_writer

POOL_STATE_INTERVAL = 1.0


class _Request:
    """What the socket holds for one request in flight (the session's handle)."""

    __slots__ = ("cancel", "completion", "keeper", "stream", "task")

    def __init__(self, completion: CompletionStream, keeper: Keeper | None) -> None:
        self.completion = completion
        self.keeper = keeper
        """Stores the completion (`store: true` requests only)."""
        self.task: asyncio.Task[None] | None = None
        self.stream: RequestStream | None = None
        """Set once a runner has it: from then on a cancel goes to the runner."""
        self.cancel: Cancel | None = None

    def placed(self, stream: RequestStream, cancel: Cancel) -> None:
        self.stream, self.cancel = stream, cancel


class BrowserSocket:
    """The browser API on one client socket (gateway.streaming.socket's `SocketApi`)."""

    def __init__(self, socket: ClientSocket, pool: Pool, store: CompletionStore) -> None:
        self.socket = socket
        self.pool = pool
        self.store = store
        self.config = config = pool.config
        self.session: ClientSession[_Request] = ClientSession(
            verify_key=None if socket.authenticated() else socket.key_ok,
            max_requests=config.max_client_requests,
            max_message_bytes=config.max_client_message_bytes,
            max_tokens_limit=config.max_tokens_limit,
            store=store.enabled,
            max_choices=config.max_choices,
        )
        self._subscription: asyncio.Task[None] | None = None

    def stop(self) -> list[asyncio.Task[None]]:
        if self._subscription is not None:
            self._subscription.cancel()
        ending = []
        for request in self.session.close():
            if request.stream is not None and request.cancel is not None:
                request.cancel(request.stream)
            if request.task is not None:
                request.task.cancel()
                ending.append(request.task)
        return ending

    def auth_timed_out(self) -> tuple[int, str] | None:
        refusal = self.session.auth_timed_out()
        return None if refusal is None else (refusal.code, refusal.reason)

    def receive(self, data: bytes | str) -> None:
        for event in self.session.receive(data):
            match event:
                case Reply(data=reply):
                    self.socket.send(reply)
                case Start(request_id=rid, chat=chat):
                    self._start(rid, chat)
                case Stop(handle=request):
                    self._stop(request)
                case Subscribe():
                    self._subscription = asyncio.create_task(self._pool_states())
                case CloseSocket(code=code, reason=reason):
                    self.socket.close_with(code, reason)

    def _stop(self, request: _Request | None) -> None:
        if request is None:
            return
        if request.stream is not None and request.cancel is not None:
            request.cancel(request.stream)  # the runner ends it: `done` "cancelled" follows
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
        run = relay_on_socket(
            self.pool,
            completion_id,
            (chat.to_generate(completion_id),),
            request.completion,
            self.socket,
            label="websocket",
            keeper=keeper,
            placed=request.placed,
        )
        task = asyncio.create_task(run)
        request.task = task
        task.add_done_callback(lambda _: self._ended(rid, request))
        self.session.bind(rid, request)

    def _ended(self, rid: str, request: _Request) -> None:
        """The request's task ended. Cancelled before a runner answered (even before the task
        ran), the request still owes the client its `done`."""
        if not request.completion.over:
            out: list[bytes] = []
            request.completion.cancel(out)
            self.socket.write(out, True)
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
            self.socket.send(
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
    await serve_socket(socket, state, lambda client: BrowserSocket(client, state.pool, state.store))
