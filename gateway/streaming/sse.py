"""The SSE transport of `POST /v1/chat/completions`: a response body written by a `Relay`.

The relay (gateway.streaming.relay) decides what is sent and when; this module only writes: each
write is one `http.response.body` message, run eagerly (`gateway.streaming.eager.run_eagerly`) so
that a send that does not suspend, which is every send while the client keeps up, costs no task
switch. uvicorn's `send` suspends only when the client's socket buffer is full; then the relay
finishes it in a task. `: keep-alive` comments fill silences.

Status, headers, CORS and auth go through Litestar as for any response; only the body
bypasses its streaming machinery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping
from types import CoroutineType
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.datastructures import Cookie
from litestar.enums import MediaType
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Send, TypeEncodersMap

from gateway.streaming.eager import run_eagerly
from gateway.streaming.relay import Relay
from gateway.streaming.request_stream import StreamItem

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"


class SseTransport:
    """Writes a relay's messages as the body of one streamed HTTP response."""

    __slots__ = ("keepalive", "send")

    def __init__(self, keepalive: bytes | None = KEEPALIVE) -> None:
        self.keepalive = keepalive
        """Written on silences (an SSE comment; Anthropic's `ping` event); None: nothing."""
        self.send: Send | None = None
        """The response's ASGI send, once its body begins."""

    def write(self, messages: list[bytes], last: bool) -> Awaitable[None] | None:
        assert self.send is not None, "written before the response body began"
        body = messages[0] if len(messages) == 1 else b"".join(messages)
        pending = self.send({"type": "http.response.body", "body": body, "more_body": not last})
        if isinstance(pending, CoroutineType):  # not the Coroutine ABC: that check is slow
            return run_eagerly(pending)
        return pending


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayASGIResponse(ASGIResponse):
    _should_set_content_length = False

    def __init__(
        self, relay: Relay, transport: SseTransport, first: StreamItem | None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.relay = relay
        self.transport = transport
        self.first = first

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.close()  # e.g. the client left before the headers went out

    async def send_body(self, send: Send, receive: Receive) -> None:
        """Stream the body until the end of the request or of the client."""
        self.transport.send = send
        # The status is 200 from here on: the role chunk goes out even with no token yet.
        self.relay.start(self.first, commit=True)
        disconnect = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((self.relay.done, disconnect), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            self.relay.close()


class SseResponse(Response[None]):
    """A Litestar response whose body is written by a `Relay` over an `SseTransport`."""

    def __init__(
        self,
        relay: Relay,
        transport: SseTransport,
        first: StreamItem | None,
        *,
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(content=None, media_type=media_type, headers=SSE_HEADERS)
        self.relay = relay
        self.transport = transport
        self.first = first

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
        return RelayASGIResponse(
            self.relay,
            self.transport,
            self.first,
            background=self.background or background,
            headers=dict(merged),
            media_type=self.media_type,
            status_code=self.status_code or status_code,
        )


async def disconnected(request: Request[Any, Any, Any]) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
