"""The SSE transport: eager writes, writes that must wait, and a response that fails before
its body (the relay itself: test_relay.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.streaming.relay import Relay
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.sse import KEEPALIVE, RelayASGIResponse, SseTransport
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, Generate, Message, Usage
from protocol.openai.chat.response import ChunkWriter
from protocol.openai.sse import SSE


async def test_a_write_that_does_not_suspend_completes_on_the_spot() -> None:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    transport = SseTransport()
    transport.send = send
    assert transport.write([b"a", b"b"], False) is None  # no task, no await
    assert transport.write([b"c"], True) is None
    assert sent == [
        {"type": "http.response.body", "body": b"ab", "more_body": True},
        {"type": "http.response.body", "body": b"c", "more_body": False},
    ]
    assert transport.keepalive == KEEPALIVE == b": keep-alive\n\n"


async def test_a_write_that_suspends_returns_what_finishes_it() -> None:
    gate = asyncio.Event()
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        await gate.wait()
        sent.append(message["body"])

    transport = SseTransport()
    transport.send = send
    pending = transport.write([b"x"], False)
    assert pending is not None
    assert sent == []
    gate.set()
    await pending
    assert sent == [b"x"]


async def test_a_write_error_before_any_suspension_is_raised_to_the_relay() -> None:
    async def send(message: Any) -> None:
        raise ConnectionResetError("gone")

    transport = SseTransport()
    transport.send = send
    with pytest.raises(ConnectionResetError):
        transport.write([b"x"], False)


async def test_a_response_that_fails_before_its_body_cancels_the_request() -> None:
    stream = RequestStream(Generate("r", "m", (Message("user", "hi"),)))
    cancelled: list[RequestStream] = []
    transport = SseTransport()
    relay = Relay(
        stream,
        CompletionStream(ChunkWriter(id="chatcmpl-x", created=1, model="m"), SSE),
        transport,
        GatewayConfig(),
        cancelled.append,
    )
    first = Chunk("r", 0, "t", "", 1, Usage(5, 1))
    response = RelayASGIResponse(relay, transport, first, media_type="text/event-stream")

    async def send(message: Any) -> None:
        assert message["type"] == "http.response.start"
        raise ConnectionResetError("the client left before the headers")

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    with pytest.raises(ConnectionResetError):
        await response({"type": "http"}, receive, send)
    assert cancelled == [stream]
    assert relay.done.done()
