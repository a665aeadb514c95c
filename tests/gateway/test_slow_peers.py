"""Peers that hold connections and say nothing: slowloris HTTP clients, runners that never
say hello. They are timed out, and nobody else waits on them meanwhile."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from protocol.closecodes import CloseCode
from tests.support import UNIT, Gateway, recv_until_closed


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway("--header-timeout", "1", "--handshake-timeout", "1")
    yield gw
    gw.stop()


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
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
    try:
        started = time.monotonic()
        assert httpx.get(f"{gateway.base}/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 1 * UNIT  # served at once beside them
        time.sleep(1.5 * UNIT)
        assert all(_closed_by_peer(s) for s in silent)
        assert all(_closed_by_peer(s) for s in dribbling)
        # A client that sends its headers in time is untouched by the deadline.
        with httpx.Client() as http:
            assert http.get(f"{gateway.base}/health").status_code == 200
            time.sleep(1.2 * UNIT)  # idle keep-alive is uvicorn's 5 s, not the header limit
            assert http.get(f"{gateway.base}/health").status_code == 200
    finally:
        for sock in silent + dribbling:
            sock.close()


async def test_runner_that_never_says_hello_is_closed(gateway: Gateway) -> None:
    started = time.monotonic()
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/runner/ws") as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(recv_until_closed(ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.HANDSHAKE_TIMEOUT
    assert time.monotonic() - started < 3 * UNIT


async def test_many_silent_runners_do_not_block_a_real_one(gateway: Gateway) -> None:
    from tests.support import FakeRunner

    silent = [await connect(f"ws://127.0.0.1:{gateway.port}/v1/runner/ws") for _ in range(20)]
    try:
        fake = await asyncio.wait_for(FakeRunner.connect(gateway, name="prompt"), 2 * UNIT)
        await fake.close()
    finally:
        for ws in silent:
            await ws.close()
