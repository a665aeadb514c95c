"""The chaos soak's client side: one stream over SSE (a minimal HTTP/1.1 client on a raw
socket, so that a slow reader really stops reading) or over the browser socket, recorded in a
`Transcript` as it arrives.

A slow reader opens its socket with a tiny receive buffer and a small StreamReader limit,
asks the firehose runner for thousands of tokens and pauses `SLOW_PAUSE` seconds after a few
events, so that the kernel's buffers fill and the gateway's per-stream queue overflows into
merged chunks (seen as pieces of several tokens).
A client that hangs up reads a random number of tokens, then closes its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson
import websockets
from websockets.asyncio.client import connect

from bench.chaos_dialects import (
    BROWSER,
    DISCONNECT,
    FIREHOSE,
    MODEL,
    NO_CONNECTION,
    OURS,
    SLOW,
    SSE_PATHS,
    Transcript,
    body,
    parse_browser,
    parse_sse,
)

SLOW_RCVBUF = 2048
SLOW_PAUSE = 2.0
"""Seconds a slow reader stops reading, after its third event."""
READ_LIMIT = 8192
"""StreamReader's buffer bound (it stops reading the socket past twice this)."""
STREAM_WAIT = 60.0
"""Seconds without a byte after which a client gives up (a hung stream is a violation)."""

T = TypeVar("T")

CUT_ERRORS = (
    OSError,
    asyncio.IncompleteReadError,
    EOFError,
    websockets.ConnectionClosed,
    websockets.InvalidMessage,  # the socket closed during the upgrade
)


async def stream(
    port: int, dialect: str, behaviour: str, *, tokens: int, n: int, hang_up_after: int
) -> Transcript:
    """One request, read to its end (or until `hang_up_after` tokens, when hanging up)."""
    t = Transcript(dialect, behaviour, tokens, started=time.monotonic())
    try:
        if dialect == BROWSER:
            await _browser(t, port, n, hang_up_after)
        else:
            await _sse(t, port, n, hang_up_after)
    except ConnectionRefusedError:
        t.end = NO_CONNECTION
    except websockets.InvalidStatus as exc:  # the upgrade refused with an HTTP status
        t.status = exc.response.status_code
        t.retry_after = "Retry-After" in exc.response.headers
    except TimeoutError:
        t.fail(f"no byte for {STREAM_WAIT:g} s (a hung stream)")
    except CUT_ERRORS:
        pass  # t.end stays CUT
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        t.fail(f"unreadable answer: {exc!r}")  # a malformed status line, chunk or event
    t.ended = time.monotonic()
    return t


async def _sse(t: Transcript, port: int, n: int, hang_up_after: int) -> None:
    sock = socket.socket()
    try:
        sock.setblocking(False)
        if t.behaviour == SLOW:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    reader, writer = await asyncio.open_connection(sock=sock, limit=READ_LIMIT)
    try:
        model = FIREHOSE if t.behaviour == SLOW else MODEL
        payload = orjson.dumps(body(t.dialect, t.tokens, n, model))
        writer.write(
            f"POST {SSE_PATHS[t.dialect]} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await _read_sse(t, reader, hang_up_after)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _read_sse(t: Transcript, reader: asyncio.StreamReader, hang_up_after: int) -> None:
    head = (await _within(reader.readuntil(b"\r\n\r\n"))).lower()
    t.status = int(head[9:12])
    t.retry_after = b"\r\nretry-after:" in head
    if t.status != 200:
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        error = orjson.loads(await _within(reader.readexactly(length)))
        t.code = error["error"].get("code") or error["error"].get("type")
        return
    if b"transfer-encoding: chunked" not in head:
        t.fail("a 200 stream that is not chunked")
        return
    pending = b""
    while True:
        line = await _within(reader.readline())
        if not line.endswith(b"\r\n"):
            raise EOFError  # cut between two chunks
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return  # the body's end: whatever the transcript says then is judged
        pending += (await _within(reader.readexactly(size + 2)))[:-2]
        *blocks, pending = pending.split(b"\n\n")
        for block in blocks:
            if parse_sse(t, block) and t.problem is not None:
                return
            if t.behaviour == SLOW and t.seen == 3:
                await asyncio.sleep(SLOW_PAUSE)
            if t.behaviour == DISCONNECT and len(t.pieces) >= hang_up_after:
                t.end = OURS
                return


async def _browser(t: Transcript, port: int, n: int, hang_up_after: int) -> None:
    rid = f"chaos-{n}"
    async with connect(f"ws://127.0.0.1:{port}/v1/ws", open_timeout=10) as ws:
        t.status = 101
        create = {
            "type": "chat.completions.create",
            "request_id": rid,
            "body": body(BROWSER, t.tokens, n),
        }
        await ws.send(orjson.dumps(create).decode())
        while True:
            message: dict[str, Any] = orjson.loads(await _within(ws.recv()))
            if message.get("request_id") != rid:
                t.fail(f"a message for request {message.get('request_id')!r}")
                return
            if parse_browser(t, message):
                return
            if t.behaviour == DISCONNECT and len(t.pieces) >= hang_up_after:
                t.end = OURS
                return


async def _within(step: Awaitable[T]) -> T:
    async with asyncio.timeout(STREAM_WAIT):
        return await step
