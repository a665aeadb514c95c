"""Relay: chunks written from the pushing code's own stack, a client that stops reading,
keep-alive, stream timeout, disconnects, and faults kept to their own request. An ASGI
send/receive pair stands in for uvicorn (the SSE transport); a list stands in for a browser
socket's outbox. The tests run on a virtual clock (tests.gateway.virtual_time): keep-alives
and timeouts come at exactly their times, and no bound is hit because the machine is busy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import orjson
import pytest

from gateway.config import GatewayConfig
from gateway.errors import RunnerLost, StreamTimeout
from gateway.streaming.relay import Relay, first_item
from gateway.streaming.request_stream import MAX_PENDING, Failed, RequestStream, StreamItem
from gateway.streaming.sse import KEEPALIVE, RelayASGIResponse, SseTransport
from protocol.browser.framing import BrowserFraming
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, Generate, Message, Usage
from protocol.openai.chat.response import ChunkWriter
from protocol.openai.sse import SSE
from tests.gateway.virtual_time import virtual_time


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
            if body.get("choices"):
                out.append(body["choices"][0]["delta"].get("content", ""))
        return "".join(out)


class Setup:
    def __init__(self, **config: Any) -> None:
        self.stream = RequestStream(Generate("r", "m", (Message("user", "hi"),)))
        self.cancelled: list[RequestStream] = []
        self.client = Client()
        self.config = GatewayConfig(**config)
        self.completion = CompletionStream(ChunkWriter(id="chatcmpl-x", created=1, model="m"), SSE)
        self.transport = SseTransport()

    def cancel(self, stream: RequestStream) -> None:
        stream.cancelled = True  # as Pool.cancel does
        self.cancelled.append(stream)

    def relay(self) -> Relay:
        return Relay(self.stream, self.completion, self.transport, self.config, self.cancel)

    def start(self, relay: Relay, first: StreamItem | None) -> asyncio.Task[None]:
        """The SSE response's body, as uvicorn would run it."""
        response = RelayASGIResponse(relay, self.transport, first, media_type="text/event-stream")
        return asyncio.ensure_future(response.send_body(self.client.send, self.client.receive))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@virtual_time
async def test_each_chunk_is_written_before_push_returns() -> None:
    s = Setup()
    relay = s.relay()
    task = s.start(relay, chunk(0))
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


@virtual_time
async def test_chunks_queue_while_the_client_is_not_reading_and_nothing_is_lost() -> None:
    s = Setup()
    relay = s.relay()
    task = s.start(relay, chunk(0))
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


@virtual_time
async def test_a_stream_that_ends_before_the_relay_starts() -> None:
    s = Setup()
    s.stream.push(chunk(1))
    s.stream.push(chunk(2, final=True))
    await asyncio.wait_for(s.start(s.relay(), chunk(0)), 1)
    assert s.client.content() == "t0 t1 t2 "
    assert s.client.more == [False]


@virtual_time
async def test_committing_without_a_first_chunk_sends_the_role_chunk() -> None:
    s = Setup()
    task = s.start(s.relay(), None)
    await settle()
    assert [orjson.loads(e)["choices"][0]["delta"] for e in s.client.events()] == [
        {"role": "assistant", "content": "", "refusal": None}
    ]
    s.stream.push(chunk(0, final=True))
    await asyncio.wait_for(task, 1)
    assert s.client.content() == "t0 "


@virtual_time
async def test_failure_mid_stream_is_an_error_event_then_done() -> None:
    s = Setup()
    task = s.start(s.relay(), chunk(0))
    await settle()
    s.stream.push(Failed(RunnerLost("r1")))
    await asyncio.wait_for(task, 1)
    events = s.client.events()
    assert orjson.loads(events[-2])["error"]["code"] == "runner_lost"
    assert events[-1] == "[DONE]"


@virtual_time
async def test_keepalive_after_silence_then_timeout_cancels() -> None:
    s = Setup(keepalive_interval=0.05, stream_timeout=0.18)
    task = s.start(s.relay(), chunk(0))
    await asyncio.wait_for(task, 2)
    # At 0.05, 0.10 and 0.15 s of silence; the timeout at 0.18 s.
    assert s.client.bodies[1:-1] == [KEEPALIVE] * 3
    assert asyncio.get_running_loop().time() == pytest.approx(0.18, abs=0.002)
    events = s.client.events()
    error = orjson.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == ("timeout", "server_error")
    assert events[-1] == "[DONE]"
    assert s.cancelled == [s.stream]


@virtual_time
async def test_chunks_put_the_keepalive_off() -> None:
    s = Setup(keepalive_interval=0.08)
    task = s.start(s.relay(), chunk(0))
    for seq in range(1, 8):
        await asyncio.sleep(0.03)
        s.stream.push(chunk(seq))
    s.stream.push(chunk(8, final=True))
    await asyncio.wait_for(task, 1)
    assert KEEPALIVE not in s.client.bodies  # 0.21 s in all, never 0.08 s of silence
    assert s.client.content() == "".join(f"t{n} " for n in range(9))


@virtual_time
async def test_client_disconnect_cancels_and_detaches() -> None:
    s = Setup()
    task = s.start(s.relay(), chunk(0))
    await settle()
    s.client.gone.set()
    await asyncio.wait_for(task, 1)
    assert s.cancelled == [s.stream]
    assert s.stream.sink is None
    s.stream.push(chunk(1))  # a late chunk just queues
    assert s.stream.pending() == 1


@virtual_time
async def test_cancelling_the_response_task_cancels_the_request() -> None:
    s = Setup()
    task = s.start(s.relay(), chunk(0))
    await settle()
    s.client.block()
    s.stream.push(chunk(1))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s.cancelled == [s.stream]
    assert s.stream.sink is None


@virtual_time
async def test_closing_twice_cancels_once() -> None:
    s = Setup()
    relay = s.relay()
    task = s.start(relay, chunk(0))
    await settle()
    s.client.gone.set()
    await asyncio.wait_for(task, 1)
    relay.close()
    assert s.cancelled == [s.stream]


# --- faults ------------------------------------------------------------------------------


class Boom(Exception):
    pass


def faults(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gateway.relay" and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize(
    ("error", "logged"),
    [(ConnectionResetError("gone"), False), (Boom("a bug in the write path"), True)],
    ids=["client-gone", "write-bug"],
)
@virtual_time
async def test_a_failing_write_ends_only_this_response(
    blocked: bool, error: Exception, logged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that went away (OSError) ends its request quietly; any other failure to
    write is a fault: logged once, with the request id."""
    s = Setup()
    task = s.start(s.relay(), chunk(0))
    await settle()
    if blocked:
        s.client.block()
    s.client.fail = error
    s.stream.push(chunk(1))  # must not raise into the runner link
    if blocked:
        s.client.unblock()
    await asyncio.wait_for(task, 1)
    assert s.cancelled == [s.stream]
    assert s.stream.sink is None
    records = faults(caplog)
    assert len(records) == int(logged)
    if logged:
        assert "request r " in records[0].getMessage()
        assert records[0].exc_info is not None
        assert records[0].exc_info[1] is error
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []


@virtual_time
async def test_a_failing_render_sends_a_server_error_and_cancels(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Setup()
    task = s.start(s.relay(), chunk(0))
    await settle()
    real = CompletionStream.feed

    def feed(self: CompletionStream, item: Any, out: list[bytes]) -> bool:
        if isinstance(item, Chunk) and item.seq == 2:
            raise Boom("a bug in rendering")
        return real(self, item, out)

    monkeypatch.setattr(CompletionStream, "feed", feed)
    s.stream.push(chunk(1))
    s.stream.push(chunk(2))  # raises inside the relay: contained
    s.stream.push(chunk(3))  # the relay is detached: this one only queues
    await asyncio.wait_for(task, 1)
    events = s.client.events()
    assert s.client.content() == "t0 t1 "
    error = orjson.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", None)
    assert events[-1] == "[DONE]"
    assert s.client.more[-1] is False
    assert s.cancelled == [s.stream]
    assert len(faults(caplog)) == 1


@virtual_time
async def test_a_failing_timer_is_contained(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Setup(keepalive_interval=0.02)
    monkeypatch.setattr(SseTransport, "keepalive", property(lambda _: 1 / 0))
    task = s.start(s.relay(), chunk(0))
    await asyncio.wait_for(task, 1)
    assert s.cancelled == [s.stream]
    assert len(faults(caplog)) == 1


@virtual_time
async def test_a_raising_sink_never_reaches_the_pusher(caplog: pytest.LogCaptureFixture) -> None:
    """RequestStream's own guard: the last line between any sink and the runner link."""
    stream = RequestStream(Generate("r", "m", (Message("user", "hi"),)))

    def sink(item: StreamItem) -> bool:
        raise Boom("not a relay")

    stream.sink = sink
    stream.push(chunk(0))
    assert stream.sink is None
    assert stream.pending() == 1
    [record] = [r for r in caplog.records if r.name == "gateway.stream"]
    assert "request r " in record.getMessage()


# --- a transport that never waits: the browser socket's outbox ---------------------------


class Outbox:
    """The browser socket's side of a relay: every message is queued at once."""

    keepalive = None

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.last: list[bool] = []

    def write(self, messages: list[bytes], last: bool) -> Awaitable[None] | None:
        self.messages.extend(orjson.loads(m) for m in messages)
        self.last.append(last)
        return None


def browser_stream(rid: str) -> CompletionStream:
    framing = BrowserFraming(rid)
    writer = ChunkWriter(
        "chatcmpl-x", 1, "m", prefix=framing.chunk_prefix, suffix=framing.chunk_suffix
    )
    return CompletionStream(writer, framing)


@virtual_time
async def test_an_outbox_transport_gets_browser_messages_and_no_keepalives() -> None:
    stream = RequestStream(Generate("r", "m", (Message("user", "hi"),)))
    completion = browser_stream("q1")
    outbox = Outbox()
    config = GatewayConfig(keepalive_interval=0.01, stream_timeout=0.2)
    relay = Relay(stream, completion, outbox, config, lambda _: None)
    relay.start(None)  # a browser socket does not commit before the first chunk
    assert outbox.messages == []
    await asyncio.sleep(0.05)
    assert outbox.messages == []  # no keep-alive on this transport
    stream.push(chunk(0))
    stream.push(chunk(1, final=True))
    await asyncio.wait_for(relay.done, 1)
    assert [m["type"] for m in outbox.messages] == ["chunk", "chunk", "chunk", "chunk", "done"]
    assert {m["request_id"] for m in outbox.messages} == {"q1"}
    assert outbox.messages[-1]["finish_reason"] == "length"
    assert outbox.last == [False, True]


@virtual_time
async def test_an_outbox_transport_times_out_with_an_error_message() -> None:
    stream = RequestStream(Generate("r", "m", (Message("user", "hi"),)))
    completion = browser_stream("q1")
    outbox = Outbox()
    cancelled: list[RequestStream] = []
    relay = Relay(stream, completion, outbox, GatewayConfig(stream_timeout=0.05), cancelled.append)
    relay.start(chunk(0))
    await asyncio.wait_for(relay.done, 1)
    relay.close()
    assert outbox.messages[-1] == {
        "type": "error",
        "request_id": "q1",
        "error": {
            "message": str(StreamTimeout(0.05)),
            "type": "server_error",
            "param": None,
            "code": "timeout",
        },
    }
    assert cancelled == [stream]


# --- the first item ----------------------------------------------------------------------


@virtual_time
async def test_first_item_waits_for_the_first_chunk() -> None:
    s = Setup(first_token_wait=1)
    asyncio.get_running_loop().call_later(0.01, s.stream.push, chunk(0))
    assert await first_item(s.stream, s.config, s.cancel) == chunk(0)
    assert s.cancelled == []


@virtual_time
async def test_first_item_none_after_first_token_wait() -> None:
    s = Setup(first_token_wait=0.02, stream_timeout=5)
    assert await first_item(s.stream, s.config, s.cancel) is None
    assert s.cancelled == []


@virtual_time
async def test_first_item_is_the_timeout_when_the_wait_reaches_it() -> None:
    s = Setup(first_token_wait=0.05, stream_timeout=0.02)
    item = await first_item(s.stream, s.config, s.cancel)
    assert isinstance(item, Failed)
    assert isinstance(item.error, StreamTimeout)
    assert s.cancelled == [s.stream]


@virtual_time
async def test_first_item_cancelled_cancels_the_request() -> None:
    s = Setup(first_token_wait=5)
    waiter = asyncio.ensure_future(first_item(s.stream, s.config, s.cancel))
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert s.cancelled == [s.stream]
