"""The gateway's capacity with protocol-level fake runners: a client that goes away cancels,
one slot and a FIFO queue, a full queue's 429, the max_tokens ceiling, the browser socket limit."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest
from websockets.exceptions import ConnectionClosed

from protocol.closecodes import CloseCode
from protocol.frames import Cancel, Chunk, Generate, Usage
from tests.gateway.fake_runners import body, committing_gateway
from tests.gateway.waits import until_idle, until_queued
from tests.support import UNIT, FakeRunner, Gateway, async_wait_until, recv_until_closed, sse_events


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    return patient_gateway  # shared with other modules (conftest.py)


@pytest.fixture(scope="module")
def committing() -> Iterator[Gateway]:
    """Commits a silent stream soon and keeps it alive, queues one request per model for a
    second, and takes two browser sockets."""
    yield from committing_gateway()


async def test_client_disconnect_sends_cancel(runner: FakeRunner, gateway: Gateway) -> None:
    got_cancel = asyncio.Event()

    async def serve() -> None:
        gen = await runner.next_request()
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        frame = await runner.next_request()
        assert frame == Cancel(gen.request_id)
        got_cancel.set()
        # Confirm, freeing the slot.
        await runner.send(Chunk(gen.request_id, 1, "", "", 0, Usage(3, 1), "cancelled"))

    task = asyncio.create_task(serve())
    async with (
        httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http,
        http.stream("POST", "/v1/chat/completions", json=body(stream=True)) as resp,
    ):
        async for line in resp.aiter_lines():
            if "content" in line and '"a"' in line:
                break
        await asyncio.wait_for(got_cancel.wait(), 5 * UNIT)
        await task
        await until_idle(http)  # the confirmation freed the slot


async def test_capacity_and_fifo_queue(gateway: Gateway, http: httpx.AsyncClient) -> None:
    fake = await FakeRunner.connect(gateway, models=("one-slot",), max_concurrent=1)
    req = {**body(stream=True), "model": "one-slot"}
    first = asyncio.create_task(http.post("/v1/chat/completions", json=req))
    gen1 = await fake.next_request()
    second = asyncio.create_task(http.post("/v1/chat/completions", json=req))
    # The second request waits in the gateway's queue while the first holds the slot.
    await until_queued(http, 1)
    assert isinstance(gen1, Generate)
    await fake.send(FakeRunner.chunk(gen1.request_id, 0, "one", done=True))
    gen2 = await fake.next_request()
    assert isinstance(gen2, Generate)
    assert gen2.request_id != gen1.request_id
    await fake.send(FakeRunner.chunk(gen2.request_id, 0, "two", done=True))
    r1, r2 = await first, await second
    assert sse_events(r1.content)[1]["choices"][0]["delta"]["content"] == "one"
    assert sse_events(r2.content)[1]["choices"][0]["delta"]["content"] == "two"
    await fake.close()


async def test_queue_full_is_429_with_retry_after(committing: Gateway) -> None:
    fake = await FakeRunner.connect(committing, models=("busy",), max_concurrent=1)
    async with httpx.AsyncClient(base_url=committing.base, timeout=10 * UNIT) as http:
        req = {**body(stream=True), "model": "busy"}
        holder = asyncio.create_task(http.post("/v1/chat/completions", json=req))
        await fake.next_request()
        waiter = asyncio.create_task(http.post("/v1/chat/completions", json=req))
        await until_queued(http, 1)
        full = await http.post("/v1/chat/completions", json=req)
        assert full.status_code == 429
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"] == {
            "message": "Every runner serving `busy` is busy and its queue is full.",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
        timed_out = await waiter  # waited QUEUE_TIMEOUT in the queue
        assert timed_out.status_code == 429
        assert timed_out.headers["retry-after"] == "1"
        assert timed_out.json()["error"]["message"] == (
            "Timed out waiting for a free runner serving `busy`."
        )
        holder.cancel()
    await fake.close()


async def test_max_tokens_ceiling(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    # The model is checked first: the ceiling is only reached for a model a runner serves.
    resp = await http.post("/v1/chat/completions", json={**body(), "max_tokens": 40000})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_tokens"
    assert "at most 32768" in resp.json()["error"]["message"]


async def test_client_socket_limit(committing: Gateway) -> None:
    from websockets.asyncio.client import connect

    url = f"ws://127.0.0.1:{committing.port}/v1/ws"
    async with connect(url) as first, connect(url) as second:
        await first.send('{"type": "ping"}')
        assert await first.recv() == '{"type":"pong"}'
        async with connect(url) as third:
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(recv_until_closed(third), 5 * UNIT)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == CloseCode.TRY_AGAIN_LATER
        await second.send('{"type": "ping"}')
        assert await second.recv() == '{"type":"pong"}'

    # Slots come back when sockets close (once the gateway has seen them go: the close
    # handshake may end before it has).
    async def served_again() -> bool:
        async with connect(url) as again:
            try:
                await again.send('{"type": "ping"}')
                return await again.recv() == '{"type":"pong"}'
            except ConnectionClosed as refused:
                if refused.rcvd is None or refused.rcvd.code != CloseCode.TRY_AGAIN_LATER:
                    raise
                return False  # the gateway has not seen the others go yet

    await async_wait_until(served_again, 5, "a socket to be taken again")


async def test_non_streaming_client_disconnect_sends_cancel(
    runner: FakeRunner, gateway: Gateway
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    payload = orjson.dumps(body())
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    await writer.drain()
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    writer.close()  # the client gives up before any answer
    await writer.wait_closed()
    assert await runner.next_request() == Cancel(gen.request_id)
    await runner.send(Chunk(gen.request_id, 0, "", "", 0, Usage(3, 0), "cancelled"))
    assert not await reader.read()  # nothing was ever sent back
