"""`/v1/ws`: the browser WebSocket API. One socket multiplexes many chat completions.

Client messages: `chat.completions.create`, `cancel`, `ping`, `pool.subscribe`. Gateway
messages: `chunk` (an exact `chat.completion.chunk`), `done` (finish reason and usage, once
per request), `error` (ends one request; `request_id: null` for a bad message), `pong`,
`pool.state`. A bad message never closes the socket; closing the socket cancels every
request it carried. See docs/websocket-api.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from typing import Any

import orjson
from litestar import WebSocket, websocket
from litestar.datastructures import State

from gateway.admin import runner_info
from gateway.auth import bearer, origin_allowed, secret_in
from gateway.chat import check_limits
from gateway.config import GatewayConfig
from gateway.errors import StreamTimeout
from gateway.http_errors import openai_error_for
from gateway.pool import Pool
from gateway.stream import Failed, RequestStream, StreamItem
from protocol.closecodes import CloseCode
from protocol.frames import Chunk, FinishReason, Usage
from protocol.openai.errors import OpenAIError, invalid_request
from protocol.openai.request import ChatRequest, parse_chat_object
from protocol.openai.response import ChunkWriter, usage_dict

log = logging.getLogger("gateway.client_ws")

CLIENT_WS_PATH = "/v1/ws"
MAX_REQUEST_ID_CHARS = 256
POOL_STATE_INTERVAL = 1.0


class _Closed(Exception):
    pass


class ClientSocket:
    """State and I/O of one browser socket."""

    def __init__(self, socket: WebSocket[Any, Any, Any], pool: Pool) -> None:
        self.socket = socket
        self.pool = pool
        self.config = pool.config
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.streams: dict[str, RequestStream] = {}
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_bytes = 0
        self._close_now = asyncio.Event()
        self._close_reason: tuple[int, str] = (CloseCode.NORMAL, "")
        self.authenticated = not self.config.api_keys or secret_in(
            bearer(socket.headers), self.config.api_keys
        )
        self._wake = asyncio.Event()
        self._subscription: asyncio.Task[None] | None = None
        self.closed = False

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

    def send_obj(self, obj: dict[str, Any]) -> None:
        self.send(orjson.dumps(obj))

    def send_error(self, request_id: str | None, err: OpenAIError) -> None:
        self.send_obj({"type": "error", "request_id": request_id, "error": err.body()["error"]})

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

    # --- input --------------------------------------------------------------------------

    def close_with(self, code: int, reason: str) -> None:
        """End the socket from synchronous code (the run loop does the closing)."""
        if self.closed:
            return  # the first reason stands
        self.closed = True
        for stream in self.streams.values():
            self.pool.cancel(stream)  # at once, not after the close handshake
        self._close_reason = (code, reason)
        self._close_now.set()

    async def _auth_deadline(self) -> None:
        await asyncio.sleep(self.config.auth_timeout)
        if not self.authenticated:
            self.close_with(CloseCode.UNAUTHORIZED, "no auth message in time")

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
            reader.cancel()
            closer.cancel()
            deadline.cancel()
            self.closed = True
            writer.cancel()
            if self._subscription is not None:
                self._subscription.cancel()
            for stream in self.streams.values():
                self.pool.cancel(stream)  # the socket is gone: stop its generations
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(writer, reader, *self.tasks.values(), return_exceptions=True)

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
        size = len(data) if isinstance(data, bytes) else len(data.encode())
        if size > self.config.max_client_message_bytes:
            self.send_error(
                None,
                invalid_request(
                    f"Message of {size} bytes is over the "
                    f"{self.config.max_client_message_bytes}-byte limit.",
                    None,
                    "message_too_large",
                ),
            )
            return
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            self.send_error(None, invalid_request(f"Invalid JSON: {exc}", None, "invalid_json"))
            return
        if type(msg) is not dict or type(msg.get("type")) is not str:
            self.send_error(
                None,
                invalid_request(
                    "A message must be a JSON object with a string 'type'.",
                    "type",
                    "invalid_message",
                ),
            )
            return
        if not self.authenticated:
            self._authenticate(msg)
            return
        match msg["type"]:
            case "chat.completions.create":
                self._create(msg)
            case "cancel":
                self._cancel(msg)
            case "ping":
                self.send(b'{"type":"pong"}')
            case "pool.subscribe":
                if self._subscription is None:
                    self._subscription = asyncio.create_task(self._pool_states())
            case other:
                self.send_error(
                    None,
                    invalid_request(
                        f"Unknown message type {other[:64]!r}.", "type", "unknown_message_type"
                    ),
                )

    def _authenticate(self, msg: dict[str, Any]) -> None:
        """API keys are set: the first message must be `{"type": "auth", "api_key": …}`."""
        if msg["type"] == "auth" and secret_in(msg.get("api_key"), self.config.api_keys):
            self.authenticated = True
            self.send(b'{"type":"auth.ok"}')
        elif msg["type"] == "auth":
            self.close_with(CloseCode.UNAUTHORIZED, "invalid API key")
        else:
            self.close_with(CloseCode.UNAUTHORIZED, "authenticate first")

    def _request_id(self, msg: dict[str, Any]) -> str | None:
        rid = msg.get("request_id")
        if type(rid) is not str or not 0 < len(rid) <= MAX_REQUEST_ID_CHARS:
            self.send_error(
                None,
                invalid_request(
                    f"'request_id' must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters.",
                    "request_id",
                    "invalid_request_id",
                ),
            )
            return None
        return rid

    def _create(self, msg: dict[str, Any]) -> None:
        rid = self._request_id(msg)
        if rid is None:
            return
        if rid in self.tasks:
            # Refused with request_id null: an error naming rid would end the original.
            self.send_error(
                None,
                invalid_request(
                    f"request_id {rid!r} is already in flight on this socket.",
                    "request_id",
                    "duplicate_request_id",
                ),
            )
            return
        if len(self.tasks) >= self.config.max_client_requests:
            self.send_error(
                rid,
                OpenAIError(
                    429,
                    f"At most {self.config.max_client_requests} requests may be in flight "
                    "on one socket.",
                    "rate_limit_error",
                    None,
                    "too_many_requests",
                ),
            )
            return
        unknown = set(msg) - {"type", "request_id", "body"}
        if unknown:
            self.send_error(
                rid,
                invalid_request(
                    f"Unknown field(s) in message: {', '.join(sorted(unknown))}.",
                    None,
                    "unknown_parameter",
                ),
            )
            return
        body = msg.get("body")
        if type(body) is dict and "stream" not in body:
            body = {**body, "stream": True}  # streaming is implied
        try:
            chat = check_limits(parse_chat_object(body), self.config)
            if not chat.stream:
                raise invalid_request(
                    "The WebSocket API always streams; 'stream' must be true or omitted.",
                    "stream",
                )
        except OpenAIError as err:
            self.send_error(rid, err)
            return
        task = asyncio.create_task(self._run(rid, chat))
        self.tasks[rid] = task
        task.add_done_callback(lambda t: self._ended(rid, t))

    def _ended(self, rid: str, task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)
        # Cancelled while waiting for a runner (possibly before its first step): the
        # request still owes the client its `done`.
        if task.cancelled() and not self.closed:
            self.send_done(rid, "cancelled", Usage(0, 0))

    def _cancel(self, msg: dict[str, Any]) -> None:
        rid = self._request_id(msg)
        if rid is None:
            return
        stream = self.streams.get(rid)
        if stream is not None:
            self.pool.cancel(stream)  # done "cancelled" follows when the runner stops
        elif (task := self.tasks.get(rid)) is not None:
            task.cancel()  # still waiting for a runner
        # Anything else already ended: cancel and done crossed on the wire.

    # --- one request ----------------------------------------------------------------------

    async def _run(self, rid: str, chat: ChatRequest) -> None:
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            stream = await self.pool.submit(chat.to_generate(completion_id))
        except Exception as exc:
            self.send_error(rid, openai_error_for(exc))
            return
        self.streams[rid] = stream
        writer = ChunkWriter(
            completion_id,
            int(time.time()),
            chat.model,
            chat.include_usage,
            chat.continuous_usage_stats,
            prefix=b'{"type":"chunk","request_id":' + orjson.dumps(rid) + b',"chunk":',
            suffix=b"}",
        )
        relay = _Relay(self, rid, writer, self.config.stream_timeout)
        try:
            while not relay.over and (item := stream.get_nowait()) is not None:
                relay.on_item(item)
            if not relay.over:
                stream.sink = relay.on_item  # from now on chunks arrive without a task switch
                relay.arm()
                await relay.ended
        finally:
            stream.sink = None
            relay.disarm()
            del self.streams[rid]
            if not stream.done:
                self.pool.cancel(stream)

    def send_done(self, rid: str, finish_reason: FinishReason, usage: Usage) -> None:
        self.send_obj(
            {
                "type": "done",
                "request_id": rid,
                "finish_reason": finish_reason,
                "usage": usage_dict(usage),
            }
        )

    # --- live pool view ---------------------------------------------------------------------

    async def _pool_states(self) -> None:
        previous: dict[str, tuple[float, int]] = {}
        while True:
            now = time.monotonic()
            runners = []
            for conn in self.pool.runners.values():
                info = runner_info(conn)
                then, tokens = previous.get(conn.id, (now, conn.tokens_generated))
                rate = (conn.tokens_generated - tokens) / (now - then) if now > then else 0.0
                info["tokens_per_second"] = round(rate, 1)
                previous[conn.id] = (now, conn.tokens_generated)
                runners.append(info)
            self.send_obj(
                {
                    "type": "pool.state",
                    "runners": runners,
                    "requests_in_flight": sum(len(c.streams) for c in self.pool.runners.values()),
                    "queue_depth": self.pool.queue_depth(),
                    "models": sorted(self.pool.models()),
                }
            )
            await asyncio.sleep(POOL_STATE_INTERVAL)


class _Relay:
    """Renders one request's chunks into its socket's outbox as they arrive.

    It is the request's `RequestStream.sink`, called from the runner link's receive loop:
    the socket's writer task is the only task a token wakes. One timer per request ends it
    after `stream_timeout` without a frame.
    """

    __slots__ = (
        "_heard",
        "_loop",
        "_started",
        "_timer",
        "client",
        "ended",
        "over",
        "rid",
        "timeout",
        "writer",
    )

    def __init__(self, client: ClientSocket, rid: str, writer: ChunkWriter, timeout: float) -> None:
        self.client = client
        self.rid = rid
        self.writer = writer
        self.timeout = timeout
        self.over = False
        """The request's last message (`done` or `error`) has been queued."""
        self._loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[None] = self._loop.create_future()
        self._heard = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._started = False

    def on_item(self, item: StreamItem) -> bool:
        self._heard = self._loop.time()
        if self._render(item):
            self.over = True
            self.disarm()
            if not self.ended.done():
                self.ended.set_result(None)
        return True  # the outbox takes everything (a socket that falls behind is closed)

    def _render(self, item: StreamItem) -> bool:
        """Queue the messages for one item; True when the request is over."""
        client, writer = self.client, self.writer
        if not isinstance(item, Chunk):
            client.send_error(self.rid, openai_error_for(item))
            return True
        if not self._started:
            self._started = True
            u = item.usage
            client.send(writer.role(Usage(u.prompt_tokens, 0, u.cached_tokens, 0)))
        if item.text or item.reasoning or (writer.continuous_usage_stats and item.tokens):
            client.send(writer.delta(item.text, item.reasoning, item.usage))
        if item.finish_reason is None:
            return False
        if item.finish_reason != "cancelled":
            client.send(writer.finish(item.finish_reason, item.usage))
        if writer.include_usage:
            client.send(writer.usage_chunk(item.usage))
        client.send_done(self.rid, item.finish_reason, item.usage)
        return True

    def arm(self) -> None:
        self._timer = self._loop.call_later(self.timeout, self._tick)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        silent = self._loop.time() - self._heard
        if silent < self.timeout:
            self._timer = self._loop.call_later(self.timeout - silent, self._tick)
            return
        self.on_item(Failed(StreamTimeout(self.timeout)))


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
        await ClientSocket(socket, pool).run()
    except Exception:  # a bug here must not take the server down; it must be seen
        log.exception("client socket failed")
    finally:
        open_sockets.pop()
        if not open_sockets and not pool.in_flight():
            pool.trimmer.idle()  # a crowd of sockets left: give their memory back
