"""The runner link with protocol-level fake runners: a violation (a foreign request's chunk, a
bad first frame, an oversized frame) closes only that runner; a runner's error without a
request id or a draining runner's refusal moves its requests."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from websockets.exceptions import ConnectionClosed

from protocol.closecodes import CloseCode
from protocol.frames import Drain, Error, Generate
from tests.gateway.fake_runners import body
from tests.support import UNIT, FakeRunner, Gateway, recv_until_closed, sse_events


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    return patient_gateway  # shared with other modules (conftest.py)


async def test_chunk_for_foreign_request_closes_only_that_runner(
    runner: FakeRunner, gateway: Gateway, http: httpx.AsyncClient
) -> None:
    stream_req = asyncio.create_task(http.post("/v1/chat/completions", json=body(stream=True)))
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    rogue = await FakeRunner.connect(gateway, models=("other",), name="rogue")
    await rogue.send(FakeRunner.chunk(gen.request_id, 0, "injected"))
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(recv_until_closed(rogue.ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.ILLEGAL_STATE
    # The honest stream is untouched.
    await runner.send(FakeRunner.chunk(gen.request_id, 0, "honest", done=True))
    resp = await stream_req
    assert b"injected" not in resp.content
    assert sse_events(resp.content)[1]["choices"][0]["delta"]["content"] == "honest"


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"not json", CloseCode.MALFORMED_FRAME),
        (b'{"type": "chunk"}', CloseCode.MALFORMED_FRAME),
        (b'{"type": "heartbeat", "sent_at": 1}', CloseCode.ILLEGAL_STATE),
        (
            orjson.dumps(
                {
                    "type": "hello",
                    "protocol_version": 999,
                    "runner_name": "x",
                    "models": [{"id": "m", "context_length": 1}],
                    "max_concurrent": 1,
                    "hardware": {
                        "chip": "c",
                        "cpu_count": 1,
                        "memory_bytes": 1,
                        "backend": "cpu",
                        "platform": "p",
                    },
                }
            ),
            CloseCode.UNSUPPORTED_VERSION,
        ),
    ],
)
async def test_bad_first_frame_closes_with_code(
    gateway: Gateway, payload: bytes, code: CloseCode
) -> None:
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/runner/ws") as ws:
        await ws.send(payload, text=True)
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5 * UNIT)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == code
        assert closed.value.rcvd.reason
    assert all(r["name"] != "x" for r in gateway.runners())
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{gateway.base}/health")).status_code == 200


async def test_oversized_runner_frame_closes_only_that_runner(
    gateway: Gateway, runner: FakeRunner
) -> None:
    big = await FakeRunner.connect(gateway, models=("big",), name="big")
    huge = '{"type": "heartbeat", "sent_at": 1, "pad": "' + "x" * (5 << 20) + '"}'

    async def send_then_read() -> None:
        await big.send_raw(huge)
        await recv_until_closed(big.ws)

    with pytest.raises(ConnectionClosed) as closed:  # the send itself may see the close
        await asyncio.wait_for(send_then_read(), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.MESSAGE_TOO_BIG
    # The honest runner still serves.
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http:
        task = asyncio.create_task(http.post("/v1/chat/completions", json=body()))
        gen = await runner.next_request()
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "fine", done=True))
        assert (await task).json()["choices"][0]["message"]["content"] == "fine"


async def test_an_error_without_request_id_closes_that_runner_and_its_requests_move_or_fail(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """The runner gives up its connection: closed with 4012; a request with no token yet moves
    to another runner, a started one fails with runner_lost."""
    quitter = await FakeRunner.connect(gateway, models=("giving-up",), name="quitter")
    req = {**body(stream=True), "model": "giving-up"}
    started = asyncio.create_task(http.post("/v1/chat/completions", json=req))
    gen1 = await quitter.next_request()
    assert isinstance(gen1, Generate)
    await quitter.send(FakeRunner.chunk(gen1.request_id, 0, "half"))
    unstarted = asyncio.create_task(http.post("/v1/chat/completions", json=req))
    gen2 = await quitter.next_request()
    assert isinstance(gen2, Generate)
    backup = await FakeRunner.connect(gateway, models=("giving-up",), name="backup")
    await quitter.send(Error(None, "internal_error", "the engine is gone"))
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(recv_until_closed(quitter.ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (
        CloseCode.RUNNER_ERROR,
        "runner reported an error",
    )
    moved = await backup.next_request()
    assert isinstance(moved, Generate)
    assert moved.request_id == gen2.request_id
    await backup.send(FakeRunner.chunk(moved.request_id, 0, "moved", done=True))
    events = sse_events((await unstarted).content)
    assert events[1]["choices"][0]["delta"] == {"content": "moved"}
    events = sse_events((await started).content)
    assert events[1]["choices"][0]["delta"] == {"content": "half"}
    assert events[-2]["error"]["code"] == "runner_lost"
    await backup.close()


async def test_a_generate_refused_by_a_draining_runner_moves(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    first = await FakeRunner.connect(gateway, models=("draining",), name="first")
    req = {**body(stream=True), "model": "draining"}
    pending = asyncio.create_task(http.post("/v1/chat/completions", json=req))
    gen = await first.next_request()
    assert isinstance(gen, Generate)
    second = await FakeRunner.connect(gateway, models=("draining",), name="second")
    await first.send(Drain())
    # The Generate crossed the Drain on the wire: the runner refuses it.
    await first.send(Error(gen.request_id, "over_capacity", "runner is draining"))
    moved = await second.next_request()
    assert isinstance(moved, Generate)
    assert moved.request_id == gen.request_id
    await second.send(FakeRunner.chunk(moved.request_id, 0, "elsewhere", done=True))
    resp = await pending
    assert resp.status_code == 200
    assert sse_events(resp.content)[1]["choices"][0]["delta"] == {"content": "elsewhere"}
    runners = {r["name"]: r for r in gateway.runners()}
    assert runners["first"]["draining"] is True
    assert runners["first"]["active"] == 0
    await first.close()
    await second.close()
