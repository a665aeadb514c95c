"""Faults over real sockets, from the clients' side: one that disconnects or cancels stops
its generation and frees the slot, one too slow is closed (4010), a stalled one holds up no
one, and 256 concurrent streams come out exact."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from protocol.frames import Chunk, Generate, Usage
from tests.e2e.faults.harness import (
    PROMPT_TOKENS,
    Fleet,
    Reply,
    Tasks,
    body,
    ended,
    eventually,
    expected,
    first_tokens,
    next_cancel,
    next_generate,
    runner,
    runner_is,
    runners,
    send_heartbeats,
    stream_chat,
    ws_content,
    ws_create,
    ws_recv,
    ws_send,
)
from tests.support import UNIT, FakeRunner, Gateway, sse_events

BULK = "bulk-m"
"""The model of the module's bulk runners (4 of 64 slots, as fast as they go)."""
ONE_SLOT = "one-slot"
"""The model, and the name, of the module's runner of one slot at 20 tokens per second."""

pytestmark = pytest.mark.timeout(int(120 * UNIT))


# --- cancellation ---------------------------------------------------------------------------


@pytest.fixture
def one_slot(fleet: Fleet) -> str:
    """The module's runner of one slot at 20 tokens per second (its name and model)."""
    (name,) = fleet.runners(ONE_SLOT, 1, tps=20, max_concurrent=1)
    return name


async def test_sse_disconnect_stops_generation_and_frees_the_slot(
    gateway: Gateway, one_slot: str, http: httpx.AsyncClient
) -> None:
    gw = gateway
    before = await runner(gw, one_slot)

    req = body(1000, model=one_slot)
    async with http.stream("POST", f"{gw.base}/v1/chat/completions", json=req) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += '"content":"tok' in line
            if seen == 3:
                break
    # The connection is closed (the body was not read to its end); the slot must be free
    # for the next request at once.
    started = time.monotonic()
    nxt = await asyncio.wait_for(
        http.post(f"{gw.base}/v1/chat/completions", json=body(3, model=one_slot, stream=False)),
        5 * UNIT,
    )
    assert nxt.status_code == 200
    assert nxt.json()["choices"][0]["message"]["content"] == expected(3)
    assert time.monotonic() - started < 1 * UNIT

    await _assert_stopped(gw, before, cancelled=1)


async def _assert_stopped(gw: Gateway, before: dict[str, Any], *, cancelled: int) -> None:
    """The runner (as it was `before` the test) is idle, generated at most 2 tokens per
    cancelled request after the cancel, and generates nothing more."""
    name = before["name"]
    await eventually(lambda: runner_is(gw, name, lambda r: r["active"] == 0), 1, "idle")
    info = await runner(gw, name)
    late = info["tokens_after_cancel"] - before["tokens_after_cancel"]
    assert late <= 2 * cancelled, info
    await asyncio.sleep(0.3 * UNIT)  # 6 tokens' time: none may come
    assert (await runner(gw, name))["tokens_generated"] == info["tokens_generated"]


async def test_websocket_cancel_and_close_stop_generation(gateway: Gateway, one_slot: str) -> None:
    gw = gateway
    before = await runner(gw, one_slot)
    url = f"ws://127.0.0.1:{gw.port}/v1/ws"

    async with connect(url) as ws:
        await ws_send(ws, ws_create("long", 1000, model=one_slot))
        text = ""
        while text.count("tok") < 3:
            msg = await ws_recv(ws)
            assert msg["type"] == "chunk", msg
            text += ws_content(msg)
        await ws_send(ws, {"type": "cancel", "request_id": "long"})
        # The next request is sent at once; the one slot must free for it.
        started = time.monotonic()
        await ws_send(ws, ws_create("next", 3, model=one_slot))
        done: dict[str, dict[str, Any]] = {}
        texts = {"long": text, "next": ""}
        while len(done) < 2:
            msg = await ws_recv(ws)
            assert msg["type"] in ("chunk", "done"), msg
            if msg["type"] == "chunk":
                texts[msg["request_id"]] += ws_content(msg)
            else:
                done[msg["request_id"]] = msg
        assert time.monotonic() - started < 1 * UNIT
        assert done["long"]["finish_reason"] == "cancelled"
        assert expected(1000).startswith(texts["long"])
        # The usage of what was really generated: every token of it was relayed.
        assert done["long"]["usage"]["completion_tokens"] == texts["long"].count("tok")
        assert done["next"]["finish_reason"] == "length"
        assert texts["next"] == expected(3)
    await _assert_stopped(gw, before, cancelled=1)

    # Closing the socket cancels what it carried.
    async with connect(url) as ws:
        await ws_send(ws, ws_create("orphan", 1000, model=one_slot))
        text = ""
        while "tok2 " not in text:
            msg = await ws_recv(ws)
            text += ws_content(msg) if msg["type"] == "chunk" else ""
    await _assert_stopped(gw, before, cancelled=2)


# --- a stalled client -----------------------------------------------------------------------


async def test_websocket_client_too_slow_is_closed_4010(gateway: Gateway, tasks: Tasks) -> None:
    gw = gateway
    fake = await FakeRunner.connect(gw)
    tasks.closing(fake.close)
    tasks.start(send_heartbeats(fake))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
    # max_queue=1: the client library reads the socket only as fast as the test takes messages.
    ws = await connect(f"ws://127.0.0.1:{gw.port}/v1/ws", sock=sock, max_size=None, max_queue=1)
    tasks.closing(ws.close)
    await ws_send(ws, ws_create("flood", 10_000, model="fake-model"))
    rid = (await next_generate(fake)).request_id

    # The runner answers far faster than the client reads: 64 KiB of text per chunk, about
    # one per millisecond, against a client taking one message every 20 ms.
    stop = asyncio.Event()
    sent = [0]

    async def flood() -> None:
        text = "x" * 65536
        while not stop.is_set():
            seq = sent[0]
            await fake.send(Chunk(rid, seq, text, "", 1, Usage(PROMPT_TOKENS, seq + 1), None))
            sent[0] += 1
            await asyncio.sleep(0.001)

    async def slow_reader() -> int | None:
        try:
            while True:
                await ws.recv()
                await asyncio.sleep(0.02)
        except ConnectionClosed as closed:
            return closed.rcvd.code if closed.rcvd is not None else None

    reader = tasks.start(slow_reader())
    flooding = tasks.start(flood())
    started = time.monotonic()
    cancelled = await next_cancel(fake, 5)  # once the client's backlog passes 4 MiB
    took = time.monotonic() - started
    stop.set()
    await flooding
    assert cancelled == rid
    assert sent[0] * 65536 > 4 << 20
    assert took < 3 * UNIT, f"cancelled after {took:.1f} s, {sent[0]} chunks"
    await fake.send(Chunk(rid, sent[0], "", "", 0, Usage(PROMPT_TOKENS, sent[0]), "cancelled"))
    await eventually(lambda: runner_is(gw, "fake", lambda r: r["active"] == 0), 2, "idle")
    # The slow client, reading on, finds its socket closed as too slow.
    assert await asyncio.wait_for(reader, 5 * UNIT) == 4010


def _stalled_request(gw: Gateway, req: dict[str, Any]) -> socket.socket:
    """Send a streaming request on a raw socket with a tiny receive buffer, and read nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", gw.port))
    payload = orjson.dumps(req)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _send_buffer_max() -> int:
    """The most a TCP socket's send buffer grows to on this machine (Linux: tcp_wmem's
    maximum; macOS: net.inet.tcp.autosndbufmax)."""
    wmem = Path("/proc/sys/net/ipv4/tcp_wmem")
    if wmem.exists():
        return int(wmem.read_text().split()[2])
    found = subprocess.run(
        ["sysctl", "-n", "net.inet.tcp.autosndbufmax"], capture_output=True, check=True, text=True
    )
    return int(found.stdout)


def _read_to_end(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
    return bytes(data)


def _dechunk(body: bytes) -> bytes:
    """Decode an HTTP/1.1 chunked body."""
    out = bytearray()
    pos = 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        pos = end + 2
        if size == 0:
            return bytes(out)
        out += body[pos : pos + size]
        pos += size + 2


PACED_TOKENS = 100
"""Tokens of the firehose runner's other request, and of the stalled one's paced tail."""
FLOOD_TOKENS = 1000
"""max_tokens of the request the firehose runner floods: BIG_CHUNKS chunks of 64 KiB, then
PACED_TOKENS paced tokens."""
BIG_CHUNKS = 128
FLOOD_BYTES = BIG_CHUNKS * 65536
"""8 MiB: more than the kernel's socket buffers hold (checked) and the transport's."""


@dataclasses.dataclass
class Stalled:
    """The flooded request's progress on the firehose runner."""

    flooded: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Its 8 MiB are sent; its paced tail begins."""
    release: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Its last token may go: until then it stays in flight on the runner's socket."""
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Its last token is sent."""


async def _firehose(fake: FakeRunner, stalled: Stalled, sibling: Reply) -> None:
    """Serve the fake runner's requests: the flooded one (see FLOOD_TOKENS and `Stalled`);
    any other in lock step with `sibling`'s client: each token sent once the client has the
    one before."""
    handlers: set[asyncio.Task[None]] = set()

    async def token(rid: str, seq: int, i: int) -> None:
        last = i == PACED_TOKENS - 1
        usage = Usage(PROMPT_TOKENS, seq + 1)
        await fake.send(Chunk(rid, seq, f"tok{i} ", "", 1, usage, "length" if last else None))

    async def flood(rid: str) -> None:
        text = "x" * 65536
        for seq in range(BIG_CHUNKS):
            await fake.send(Chunk(rid, seq, text, "", 1, Usage(PROMPT_TOKENS, seq + 1), None))
        stalled.flooded.set()
        for i in range(PACED_TOKENS):
            if i == PACED_TOKENS - 1:
                await stalled.release.wait()
            await asyncio.sleep(0.01)
            await token(rid, BIG_CHUNKS + i, i)
        stalled.ended.set()

    async def lock_step(rid: str) -> None:
        for i in range(PACED_TOKENS):
            await sibling.seen(i)
            await token(rid, i, i)

    while True:
        try:
            frame = await fake.next_request()
        except TimeoutError:
            continue
        assert isinstance(frame, Generate), frame
        rid = frame.request_id
        work = flood(rid) if frame.max_tokens == FLOOD_TOKENS else lock_step(rid)
        task = asyncio.create_task(work)
        handlers.add(task)
        task.add_done_callback(handlers.discard)


async def test_stalled_client_holds_up_no_one(
    gateway: Gateway, fleet: Fleet, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = gateway
    fleet.runners(BULK, 4, max_concurrent=64)
    fake = await FakeRunner.connect(gw, models=("firehose",), name="firehose")
    tasks.closing(fake.close)
    tasks.start(send_heartbeats(fake))
    stalled, sibling = Stalled(), Reply()
    tasks.start(_firehose(fake, stalled, sibling))

    # A client that reads nothing: the firehose runner sends it 8 MiB at once, then a paced
    # tail, all but its last token. The kernel holds at most the gateway's send buffer and
    # the client's receive buffer of it: the gateway holds the rest.
    sock = _stalled_request(gw, body(FLOOD_TOKENS, model="firehose"))
    try:
        held = _send_buffer_max() + sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert held < FLOOD_BYTES, f"the kernel could hold the flood here ({held} bytes)"
        async with asyncio.timeout(10 * UNIT):
            await stalled.flooded.wait()
        # Meanwhile, another request on the same runner: its tokens come behind the flood
        # on the runner's socket, each sent only once its client has the one before. And
        # 20 requests on other runners. All complete while the stalled client reads nothing
        # and its request is still in flight.
        tasks.start(stream_chat(gw, http, body(PACED_TOKENS, model="firehose"), sibling))
        await first_tokens([sibling], 5)
        others = tasks.streams(gw, http, body(100, model=BULK), 20)
        # (100 round trips take a second or two, even on a busy machine: the bound fails a
        # link that holds each frame back a tenth of a second.)
        await ended([sibling, *others], 10)
        sibling.assert_complete(PACED_TOKENS)
        for reply in others:
            reply.assert_complete(100)
        stalled.release.set()
        async with asyncio.timeout(10 * UNIT):
            await stalled.ended.wait()
        raw = await asyncio.to_thread(_read_to_end, sock, 30 * UNIT)
    finally:
        sock.close()

    # The stalled client loses nothing: it gets the whole text, in fewer, bigger chunks.
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = sse_events(_dechunk(rest))
    assert events[-1] == "[DONE]"
    texts = [c["delta"].get("content") or "" for e in events[:-1] for c in e.get("choices", [])]
    assert "".join(texts) == "x" * FLOOD_BYTES + expected(PACED_TOKENS)
    assert events[-2]["usage"]["completion_tokens"] == BIG_CHUNKS + PACED_TOKENS
    assert sum(map(bool, texts)) < BIG_CHUNKS + PACED_TOKENS, "no chunks merged"
    sys.stderr.write(f"stalled client: {len(events)} events\n")


# --- load -----------------------------------------------------------------------------------


async def test_256_concurrent_streams_exact(
    gateway: Gateway, fleet: Fleet, http: httpx.AsyncClient
) -> None:
    gw = gateway
    bulk = fleet.runners(BULK, 4, max_concurrent=64)
    before = await runners(gw)
    tokens, streams = 50, 256

    started = time.monotonic()
    async with asyncio.timeout(60 * UNIT):
        replies = await asyncio.gather(
            *(stream_chat(gw, http, body(tokens, model=BULK), Reply()) for _ in range(streams))
        )
    sys.stderr.write(f"{streams} streams in {time.monotonic() - started:.2f} s\n")
    for reply in replies:
        reply.assert_complete(tokens)
    after = await runners(gw)
    made = sum(after[n]["tokens_generated"] - before[n]["tokens_generated"] for n in bulk)
    assert made == tokens * streams
    assert all(after[n]["active"] == 0 for n in bulk)
