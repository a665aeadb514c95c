"""The streaming response of `POST /v1/chat/completions`: SSE events written as chunks arrive.

This is the gateway's hot path. A response does not wake a task of its own per token (a
future, a timer, an async generator, a streaming response's task group); instead the runner
link's receive loop hands each chunk to the response's `SseRelay` (`RequestStream.sink`),
which renders the events and calls the ASGI `send` right there. A send that completes without
suspending, which is every send while the client keeps up, costs no task switch at all.

uvicorn's `send` suspends only when the client's socket buffer is full. Then the relay
finishes that send in a task and, until it completes, new chunks queue in the
`RequestStream` (bounded: later chunks are merged, see gateway.stream); they go out together
as one write when the client catches up.

Keep-alive comments and the stream timeout (a runner silent for `stream_timeout`) are one
timer per response, re-armed when it fires, not per token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import CoroutineType
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.datastructures import Cookie
from litestar.enums import MediaType
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Send, TypeEncodersMap

from gateway.config import GatewayConfig
from gateway.eager import run_eagerly
from gateway.errors import StreamTimeout
from gateway.http_errors import openai_error_for
from gateway.stream import Failed, RequestStream, StreamItem
from protocol.frames import Chunk, Usage
from protocol.openai.response import ChunkWriter

log = logging.getLogger("gateway.sse")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"


def render(writer: ChunkWriter, item: StreamItem, out: list[bytes]) -> bool:
    """Append the SSE events for one item; True when the stream is over."""
    if isinstance(item, Chunk):
        if item.text or item.reasoning or (writer.continuous_usage_stats and item.tokens):
            out.append(writer.delta(item.text, item.reasoning, item.usage))
        if item.finish_reason is None:
            return False
        out.append(writer.finish(item.finish_reason, item.usage))
        if writer.include_usage:
            out.append(writer.usage_chunk(item.usage))
    else:
        out.append(writer.error(openai_error_for(item)))
    out.append(writer.done())
    return True


class SseRelay:
    """Writes one streamed chat completion to its client as the runner's chunks arrive."""

    __slots__ = (
        "_busy",
        "_first",
        "_heard",
        "_loop",
        "_send",
        "_task",
        "_timer",
        "_written",
        "cancel",
        "config",
        "done",
        "sends_suspended",
        "stream",
        "writer",
    )

    def __init__(
        self,
        cancel: Callable[[RequestStream], None],
        stream: RequestStream,
        writer: ChunkWriter,
        first: Chunk | None,
        config: GatewayConfig,
    ) -> None:
        self.cancel = cancel
        """Stops the request on its runner (`Pool.cancel`)."""
        self.stream = stream
        self.writer = writer
        self.config = config
        self._first = first
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()
        """Resolved when the last event has been written, or the client is gone."""
        self._send: Send | None = None
        self._busy = False
        """A send is suspended (the client is not reading); chunks queue meanwhile."""
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._heard = self._written = self._loop.time()
        self.sends_suspended = 0
        """How often a send had to wait for the client (for tests and debugging)."""

    async def run(self, send: Send, receive: Receive) -> None:
        """Stream the response body until the end of the request or of the client."""
        self._send = send
        first = self._first
        role_usage = None
        if first is not None:
            u = first.usage
            role_usage = Usage(u.prompt_tokens, 0, u.cached_tokens, 0)
        out = [self.writer.role(role_usage)]
        finished = first is not None and render(self.writer, first, out)
        while not finished and (item := self.stream.get_nowait()) is not None:
            finished = render(self.writer, item, out)
        if not finished:
            self.stream.sink = self._on_item
            self._arm(min(self.config.keepalive_interval, self.config.stream_timeout))
        self._write(b"".join(out), finished)
        disconnect = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((self.done, disconnect), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            self.close()

    def close(self) -> None:
        """Stop relaying; the request is cancelled on its runner unless it ended. Idempotent,
        and also called when the response fails before its body starts."""
        self._detach()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if not self.stream.done and not self.stream.cancelled:
            self.cancel(self.stream)  # the client went away, or the runner timed out

    def _on_item(self, item: StreamItem) -> bool:
        """`RequestStream.sink`: write the item now; False (queue it) while a send waits."""
        if self._busy:
            return False
        self._heard = self._loop.time()
        out: list[bytes] = []
        finished = render(self.writer, item, out)
        if finished:
            self._detach()
        if out:
            self._write(b"".join(out), finished)
        return True

    def _write(self, body: bytes, last: bool) -> None:
        """Send `body`; completes here unless the client's buffer is full."""
        assert self._send is not None
        self._written = self._loop.time()
        pending: Awaitable[None] | None
        pending = self._send({"type": "http.response.body", "body": body, "more_body": not last})
        if isinstance(pending, CoroutineType):  # not the Coroutine ABC: that check is slow
            try:
                pending = run_eagerly(pending)
            except Exception as exc:  # the client's connection failed
                self._gone(exc)
                return
            if pending is None:
                if last:
                    self._end()
                return
        self._busy = True
        self.sends_suspended += 1
        self._task = self._loop.create_task(self._finish_send(pending, last))

    async def _finish_send(self, pending: Awaitable[None], last: bool) -> None:
        try:
            await pending
        except Exception as exc:
            self._gone(exc)
            return
        self._busy = False
        if last:
            self._end()
            return
        out: list[bytes] = []
        finished = False
        while not finished and (item := self.stream.get_nowait()) is not None:
            finished = render(self.writer, item, out)
        if finished:
            self._detach()
        if out:
            self._write(b"".join(out), finished)

    def _tick(self) -> None:
        """Keep-alive comment after `keepalive_interval` without a write; end a silent stream."""
        self._timer = None
        now = self._loop.time()
        timeout = self.config.stream_timeout
        if now - self._heard >= timeout:
            self._detach()
            if not self._busy:
                out: list[bytes] = []
                render(self.writer, Failed(StreamTimeout(timeout)), out)
                self._write(b"".join(out), True)
            else:
                self._end()  # the client is not reading either: give up on it
            return
        keepalive = self.config.keepalive_interval
        if not self._busy and now - self._written >= keepalive:
            self._write(KEEPALIVE, False)
        self._arm(min(self._heard + timeout, self._written + keepalive) - now)

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(delay, 0.001), self._tick)

    def _detach(self) -> None:
        """No more items through the sink (the stream is over, or nobody reads it)."""
        self.stream.sink = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def _gone(self, exc: BaseException) -> None:
        log.debug("client of %s gone: %r", self.stream.request_id, exc)
        self._detach()
        self._end()


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _RelayASGIResponse(ASGIResponse):
    _should_set_content_length = False

    def __init__(self, relay: SseRelay, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.relay = relay

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.close()  # e.g. the client left before the headers went out

    async def send_body(self, send: Send, receive: Receive) -> None:
        await self.relay.run(send, receive)


class SseResponse(Response[None]):
    """A Litestar response whose body is written by an `SseRelay`.

    Status, headers and CORS go through Litestar as for any response; only the body
    bypasses its streaming machinery.
    """

    def __init__(self, relay: SseRelay) -> None:
        super().__init__(content=None, media_type="text/event-stream", headers=SSE_HEADERS)
        self.relay = relay

    def to_asgi_response(
        self,
        app: Any,
        request: Request[Any, Any, Any],
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: MediaType | str | None = None,
        status_code: int | None = None,
        type_encoders: TypeEncodersMap | None = None,
    ) -> ASGIResponse:
        merged: Mapping[str, str] = {**(headers or {}), **self.headers}
        return _RelayASGIResponse(
            self.relay,
            background=self.background or background,
            headers=dict(merged),
            media_type=self.media_type,
            status_code=self.status_code or status_code,
        )
