"""Peers that hold connections and say nothing: slowloris HTTP clients, runners that never
say hello. They are timed out, and nobody else waits on them meanwhile."""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from protocol.closecodes import CloseCode
from tests.support import UNIT, FakeRunner, Gateway, recv_until_closed, secs, wait_until

HEADER_TIMEOUT = 1.0
HANDSHAKE_TIMEOUT = 1.0
"""The gateway's --header-timeout and --handshake-timeout, in the tests' time unit."""


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway(
        "--header-timeout", secs(HEADER_TIMEOUT), "--handshake-timeout", secs(HANDSHAKE_TIMEOUT)
    )
    yield gw
    gw.stop()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the gateway has closed `sock` (without waiting for it to)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slowloris_clients_are_cut_off_and_starve_nobody(gateway: Gateway) -> None:
    silent = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(150)]
    dribbling = []
    for _ in range(30):
        sock = socket.create_connection(("127.0.0.1", gateway.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        dribbling.append(sock)
    slow = silent + dribbling
    try:
        assert httpx.get(f"{gateway.base}/health", timeout=5 * UNIT).status_code == 200
        # Served beside them: every one still holds its connection (none has reached the
        # header timeout yet), so this request did not wait for any to be cut off.
        assert not any(_closed_by_peer(s) for s in slow)
        wait_until(
            lambda: all(_closed_by_peer(s) for s in slow),
            3 * HEADER_TIMEOUT,
            "the slow clients to be cut off",
        )
        # A client that sends its headers in time is untouched by the deadline: its idle
        # keep-alive connection (uvicorn's 5 s) outlives the header timeout.
        client = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5 * UNIT)
        try:
            client.request("GET", "/health")
            first = client.getresponse()
            assert first.status == 200
            first.read()
            kept = client.sock
            assert kept is not None
            time.sleep(1.2 * HEADER_TIMEOUT * UNIT)
            client.request("GET", "/health")
            answer = client.getresponse()
            assert answer.status == 200
            answer.read()
            assert client.sock is kept  # the same connection, not a new one
        finally:
            client.close()
    finally:
        for sock in slow:
            sock.close()


async def test_runner_that_never_says_hello_is_closed(gateway: Gateway) -> None:
    started = time.monotonic()
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/runner/ws") as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(recv_until_closed(ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.HANDSHAKE_TIMEOUT
    waited = time.monotonic() - started
    assert HANDSHAKE_TIMEOUT * UNIT <= waited < 3 * HANDSHAKE_TIMEOUT * UNIT


async def test_many_silent_runners_do_not_block_a_real_one(gateway: Gateway) -> None:
    silent = [await connect(f"ws://127.0.0.1:{gateway.port}/v1/runner/ws") for _ in range(20)]
    try:
        fake = await asyncio.wait_for(
            FakeRunner.connect(gateway, name="prompt"), 2 * HANDSHAKE_TIMEOUT * UNIT
        )
        # Welcomed while every silent one still waits out its handshake timeout.
        assert all(ws.close_code is None for ws in silent)
        await fake.close()
    finally:
        for ws in silent:
            await ws.close()
