"""SseRelay: chunks written from the pushing code's own stack, a client that stops reading,
keep-alive, stream timeout, disconnects (an ASGI send/receive pair stands in for uvicorn)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.config import GatewayConfig
from gateway.errors import RunnerLost
from gateway.sse import KEEPALIVE, SseRelay, _RelayASGIResponse
from gateway.stream import MAX_PENDING, Failed, RequestStream
from protocol.frames import Chunk, Generate, Message, Usage
from protocol.openai.response import ChunkWriter


def chunk(seq: int, final: bool = False) -> Chunk:
    return Chunk("r", seq, f"t{seq} ", "", 1, Usage(5, seq + 1), "length" if final else None)


class Client:
    """The ASGI side of one response: records what is sent; `block()` makes sends wait
    (a full socket buffer) until `unblock()`."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.more: list[bool] = []
        self.gate: asyncio.Event | None = None
        self.gone = asyncio.Event()
        self.fail: Exception | None = None

    async def send(self, message: Any) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.bodies.append(message["body"])
        self.more.append(message["more_body"])

    async def receive(self) -> Any:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def block(self) -> None:
        self.gate = asyncio.Event()

    def unblock(self) -> None:
        assert self.gate is not None
        self.gate.set()
        self.gate = None

    def events(self) -> list[Any]:
        text = b"".join(self.bodies).decode()
        return [
            event.removeprefix("data: ")
            for event in text.split("\n\n")
            if event and not event.startswith(":")
        ]

    def content(self) -> str:
        out = []
        for event in self.events():
            if event == "[DONE]":
                continue
            body = orjson.loads(event)
            out.append(body["choices"][0]["delta"].get("content", "") if body["choices"] else "")
        return "".join(out)


class Setup:
    def __init__(self, **config: Any) -> None:
        self.stream = RequestStream(Generate("r", "m", (Message("user", "hi"),)))
        self.cancelled: list[RequestStream] = []
        self.client = Client()
        self.writer = ChunkWriter(id="chatcmpl-x", created=1, model="m")
        self.config = GatewayConfig(**config)

    def cancel(self, stream: RequestStream) -> None:
        stream.cancelled = True  # as Pool.cancel does
        self.cancelled.append(stream)

    def relay(self, first: Chunk | None) -> SseRelay:
        return SseRelay(self.cancel, self.stream, self.writer, first, self.config)

    def start(self, relay: SseRelay) -> asyncio.Task[None]:
        return asyncio.ensure_future(relay.run(self.client.send, self.client.receive))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_each_chunk_is_written_before_push_returns() -> None:
    s = Setup()
    relay = s.relay(chunk(0))
    task = s.start(relay)
    await settle()
    assert len(s.client.bodies) == 1  # role + first chunk in one write
    for seq in range(1, 5):
        s.stream.push(chunk(seq))
        assert len(s.client.bodies) == seq + 1  # no task switch needed
    s.stream.push(chunk(5, final=True))
    await asyncio.wait_for(task, 1)
    assert s.client.content() == "".join(f"t{n} " for n in range(6))
    assert s.client.events()[-1] == "[DONE]"
    assert s.client.more == [True] * 5 + [False]
    assert relay.sends_suspended == 0
    assert s.cancelled == []  # finished normally: nothing to cancel
    assert s.stream.sink is None


async def test_chunks_queue_while_the_client_is_not_reading_and_nothing_is_lost() -> None:
    s = Setup()
    relay = s.relay(chunk(0))
    task = s.start(relay)
    await settle()
    s.client.block()
    s.stream.push(chunk(1))  # this send suspends
    total = MAX_PENDING + 500
    for seq in range(2, total):
        s.stream.push(chunk(seq, final=seq == total - 1))
    assert relay.sends_suspended == 1
    assert s.stream.merged > 0  # the queue stayed bounded
    await settle()
    assert len(s.client.bodies) == 1
    s.client.unblock()
    await asyncio.wait_for(task, 1)
    assert s.client.content() == "".join(f"t{n} " for n in range(total))
    assert s.client.events()[-1] == "[DONE]"
    assert len(s.client.bodies) == 3  # first, the blocked one, then everything queued at once
    assert s.cancelled == []


async def test_a_stream_that_ends_before_the_relay_starts() -> None:
    s = Setup()
    s.stream.push(chunk(1))
    s.stream.push(chunk(2, final=True))
    await asyncio.wait_for(s.start(s.relay(chunk(0))), 1)
    assert s.client.content() == "t0 t1 t2 "
    assert s.client.more == [False]


async def test_failure_mid_stream_is_an_error_event_then_done() -> None:
    s = Setup()
    task = s.start(s.relay(chunk(0)))
    await settle()
    s.stream.push(Failed(RunnerLost("r1")))
    await asyncio.wait_for(task, 1)
    events = s.client.events()
    assert orjson.loads(events[-2])["error"]["code"] == "runner_lost"
    assert events[-1] == "[DONE]"


async def test_keepalive_after_silence_then_timeout_cancels() -> None:
    s = Setup(keepalive_interval=0.05, stream_timeout=0.18)
    task = s.start(s.relay(chunk(0)))
    await asyncio.wait_for(task, 2)
    keepalives = [b for b in s.client.bodies if b == KEEPALIVE]
    assert 2 <= len(keepalives) <= 3
    events = s.client.events()
    error = orjson.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == ("timeout", "server_error")
    assert events[-1] == "[DONE]"
    assert s.cancelled == [s.stream]


async def test_chunks_put_the_keepalive_off() -> None:
    s = Setup(keepalive_interval=0.08)
    task = s.start(s.relay(chunk(0)))
    for seq in range(1, 8):
        await asyncio.sleep(0.03)
        s.stream.push(chunk(seq))
    s.stream.push(chunk(8, final=True))
    await asyncio.wait_for(task, 1)
    assert KEEPALIVE not in s.client.bodies


async def test_client_disconnect_cancels_and_detaches() -> None:
    s = Setup()
    task = s.start(s.relay(chunk(0)))
    await settle()
    s.client.gone.set()
    await asyncio.wait_for(task, 1)
    assert s.cancelled == [s.stream]
    assert s.stream.sink is None
    s.stream.push(chunk(1))  # a late chunk just queues
    assert s.stream.pending() == 1


@pytest.mark.parametrize("blocked", [False, True])
async def test_a_failing_send_ends_only_this_response(blocked: bool) -> None:
    s = Setup()
    task = s.start(s.relay(chunk(0)))
    await settle()
    if blocked:
        s.client.block()
    s.client.fail = ConnectionResetError("gone")
    s.stream.push(chunk(1))  # must not raise into the runner link
    if blocked:
        s.client.unblock()
    await asyncio.wait_for(task, 1)
    assert s.cancelled == [s.stream]
    assert s.stream.sink is None


async def test_cancelling_the_response_task_cancels_the_request() -> None:
    s = Setup()
    task = s.start(s.relay(chunk(0)))
    await settle()
    s.client.block()
    s.stream.push(chunk(1))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s.cancelled == [s.stream]
    assert s.stream.sink is None


async def test_a_response_that_fails_before_its_body_cancels_the_request() -> None:
    s = Setup()
    response = _RelayASGIResponse(s.relay(chunk(0)), media_type="text/event-stream")

    async def send(message: Any) -> None:
        assert message["type"] == "http.response.start"
        raise ConnectionResetError("the client left before the headers")

    with pytest.raises(ConnectionResetError):
        await response({"type": "http"}, s.client.receive, send)
    assert s.cancelled == [s.stream]
    assert s.client.bodies == []


async def test_closing_twice_cancels_once() -> None:
    s = Setup()
    relay = s.relay(chunk(0))
    task = s.start(relay)
    await settle()
    s.client.gone.set()
    await asyncio.wait_for(task, 1)
    relay.close()
    assert s.cancelled == [s.stream]
