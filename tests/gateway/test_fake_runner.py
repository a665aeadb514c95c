"""The gateway relaying a protocol-level fake runner: exact SSE bytes, errors before and
after the first token, capacity, queueing, cancellation and runner-link violations."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from websockets.exceptions import ConnectionClosed

from gateway.pool.pool import ORCHARD_VERSION
from protocol.closecodes import CloseCode
from protocol.frames import Cancel, Chunk, Drain, Error, Generate, Usage
from protocol.openai.objects import system_fingerprint
from tests.gateway.gateways import FAKE_RUNNERS
from tests.gateway.waits import until_idle, until_queued
from tests.support import (
    UNIT,
    FakeRunner,
    Gateway,
    async_wait_until,
    recv_until_closed,
    secs,
    sse_events,
)

FIRST_TOKEN_WAIT = 0.3
KEEPALIVE = 0.5
QUEUE_TIMEOUT = 1.0
"""The `committing` gateway's --first-token-wait, --keepalive-interval and --queue-timeout,
in the tests' time unit."""


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    return patient_gateway  # shared with other modules (conftest.py)


@pytest.fixture(scope="module")
def committing() -> Iterator[Gateway]:
    """Commits a silent stream soon and keeps it alive, queues one request per model for a
    second, and takes two browser sockets."""
    gw = Gateway(
        "--first-token-wait",
        secs(FIRST_TOKEN_WAIT),
        "--keepalive-interval",
        secs(KEEPALIVE),
        "--queue-size",
        "1",
        "--queue-timeout",
        secs(QUEUE_TIMEOUT),
        "--max-client-sockets",
        "2",
        *FAKE_RUNNERS,
    )
    yield gw
    gw.stop()


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}


# The fake runner names no engine: the fingerprint is Orchard's version and the model's.
FINGERPRINT = system_fingerprint(ORCHARD_VERSION, "fake-model", None)


async def test_stream_is_relayed_byte_exact(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    async def serve() -> Generate:
        gen = await runner.next_request()
        assert isinstance(gen, Generate)
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "Hel"))
        await runner.send(FakeRunner.chunk(gen.request_id, 1, "lo"))
        await runner.send(FakeRunner.chunk(gen.request_id, 2, "", done=True))
        return gen

    task = asyncio.create_task(serve())
    resp = await http.post(
        "/v1/chat/completions",
        json=body(stream=True, stream_options={"include_usage": True}, max_tokens=7, seed=3),
    )
    gen = await task
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["cache-control"] == "no-cache"
    # The runner got exactly the parameters the client sent.
    assert gen.model == "fake-model"
    assert gen.max_tokens == 7
    assert gen.sampling.seed == 3
    assert [(m.role, m.content) for m in gen.messages] == [("user", "hi")]

    events = sse_events(resp.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 5  # role, "Hel", "lo", finish, usage
    first = chunks[0]
    assert first["id"] == gen.request_id
    assert first["id"].startswith("chatcmpl-")
    for chunk in chunks:
        assert chunk["id"] == first["id"]
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["created"] == first["created"]
        assert chunk["model"] == "fake-model"
        assert chunk["system_fingerprint"] == FINGERPRINT
        assert list(chunk) == [
            "id",
            "object",
            "created",
            "model",
            "system_fingerprint",
            "choices",
            "usage",
        ]
    for chunk in chunks[:-1]:
        assert chunk["usage"] is None
        assert len(chunk["choices"]) == 1
        assert chunk["choices"][0]["index"] == 0
        assert chunk["choices"][0]["logprobs"] is None
    assert chunks[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
        "refusal": None,
    }
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert chunks[2]["choices"][0]["delta"] == {"content": "lo"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "stop"]
    assert chunks[3]["choices"][0]["delta"] == {}
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


async def test_without_include_usage_no_usage_key(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await runner.next_request()
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "x", done=True))

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/chat/completions", json=body(stream=True))
    await task
    chunks = sse_events(resp.content)[:-1]
    assert len(chunks) == 3  # role, "x", finish
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_runner_error_before_first_token_is_http_error(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await runner.next_request()
        await runner.send(Error(gen.request_id, "context_length_exceeded", "prompt too long"))

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/chat/completions", json=body(stream=True))
    await task
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {
            "message": "prompt too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }


async def test_runner_error_mid_stream_is_error_event_then_done(
    runner: FakeRunner, gateway: Gateway
) -> None:
    relayed = asyncio.Event()

    async def serve() -> None:
        gen = await runner.next_request()
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "partial"))
        await asyncio.wait_for(relayed.wait(), 10 * UNIT)  # the client has the first token
        relayed.clear()
        await runner.send(Error(gen.request_id, "internal_error", "engine exploded"))

    task = asyncio.create_task(serve())
    async with (
        httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http,
        http.stream("POST", "/v1/chat/completions", json=body(stream=True)) as resp,
    ):
        assert resp.status_code == 200
        content = b""
        async for part in resp.aiter_raw():
            content += part
            if b'"partial"' in content:
                relayed.set()
    await task
    events = sse_events(content)
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "message": "engine exploded",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert events[1]["choices"][0]["delta"] == {"content": "partial"}

    # The official SDK turns that event into an APIError.
    task = asyncio.create_task(serve())
    client = openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    seen: list[str | None] = []

    async def read() -> None:
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
            if seen[-1] == "partial":
                relayed.set()

    with pytest.raises(openai.APIError, match="engine exploded"):
        await read()
    assert seen == ["", "partial"]
    await task
    await client.close()


async def test_runner_lost_mid_stream(gateway: Gateway, http: httpx.AsyncClient) -> None:
    fake = await FakeRunner.connect(gateway, models=("doomed-model",))
    relayed = asyncio.Event()

    async def serve() -> None:
        gen = await fake.next_request()
        await fake.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        await asyncio.wait_for(relayed.wait(), 10 * UNIT)  # the client has the first token
        await fake.close()

    task = asyncio.create_task(serve())
    request = {**body(stream=True), "model": "doomed-model"}
    async with http.stream("POST", "/v1/chat/completions", json=request) as resp:
        content = b""
        async for part in resp.aiter_raw():
            content += part
            if b'"content":"a"' in content:
                relayed.set()
    await task
    events = sse_events(content)
    assert events[1]["choices"][0]["delta"] == {"content": "a"}
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "runner_lost"


async def test_non_streaming(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    async def serve() -> None:
        gen = await runner.next_request()
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "Hi "))
        await runner.send(Chunk(gen.request_id, 1, "there", "", 1, Usage(5, 2, 4, 0), "length"))

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/chat/completions", json=body())
    await task
    assert resp.status_code == 200
    data = resp.json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "fake-model"
    assert data["system_fingerprint"] == FINGERPRINT
    assert data["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Hi there",
                "refusal": None,
                "annotations": [],
            },
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert data["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


async def test_keepalive_comment_only_after_silence(committing: Gateway) -> None:
    # A runner silent past the first-token wait: the stream commits with the role chunk,
    # then keep-alives fill the silence; the token is sent once the client has seen one.
    fake = await FakeRunner.connect(committing, models=("quiet",))
    kept_alive = asyncio.Event()

    async def serve() -> None:
        gen = await fake.next_request()
        await asyncio.wait_for(kept_alive.wait(), 10 * UNIT)
        await fake.send(FakeRunner.chunk(gen.request_id, 0, "late", done=True))

    task = asyncio.create_task(serve())
    request = {**body(stream=True), "model": "quiet"}
    async with (
        httpx.AsyncClient(base_url=committing.base, timeout=10 * UNIT) as http,
        http.stream("POST", "/v1/chat/completions", json=request) as resp,
    ):
        text = b""
        async for part in resp.aiter_raw():
            text += part
            if b": keep-alive\n\n" in text:
                kept_alive.set()
    await task
    await fake.close()
    # The role chunk, keep-alives, then the token and the end: keep-alives come after the
    # role chunk, never before any data, and only while the runner is silent.
    blocks = text.split(b"\n\n")
    assert blocks[-1] == b""
    keepalives = [n for n, block in enumerate(blocks) if block == b": keep-alive"]
    assert keepalives == list(range(1, len(keepalives) + 1))
    assert len(keepalives) >= 1
    events = sse_events(text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert events[1]["choices"][0]["delta"] == {"content": "late"}
    assert len(events) == 4  # role, "late", finish, [DONE]


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


async def test_timeout_before_the_first_token_is_504_and_cancels(
    short_timeout_gateway: Gateway,
) -> None:
    # --stream-timeout below --first-token-wait: nothing was sent, so the client gets a 504,
    # and the runner, still holding the request, is told to stop.
    gw = short_timeout_gateway
    fake = await FakeRunner.connect(gw)
    try:
        async with httpx.AsyncClient(base_url=gw.base, timeout=10 * UNIT) as http:
            post = asyncio.ensure_future(http.post("/v1/chat/completions", json=body(stream=True)))
            gen = await asyncio.wait_for(fake.next_request(), 5 * UNIT)
            assert isinstance(gen, Generate)
            resp = await post
            assert resp.status_code == 504
            assert resp.json()["error"]["code"] == "timeout"
            frame = await asyncio.wait_for(fake.next_request(), 5 * UNIT)
            assert frame == Cancel(gen.request_id)
    finally:
        await fake.close()


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
