"""The gateway relaying a protocol-level fake runner: exact SSE bytes, a non-streamed body,
keep-alives in a silence, errors before and after the first token, a lost runner, a timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.pool.pool import ORCHARD_VERSION
from protocol.frames import Cancel, Chunk, Error, Generate, Usage
from protocol.openai.objects import system_fingerprint
from tests.gateway.fake_runners import body, committing_gateway
from tests.support import UNIT, FakeRunner, Gateway, sse_events


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    return patient_gateway  # shared with other modules (conftest.py)


@pytest.fixture(scope="module")
def committing() -> Iterator[Gateway]:
    """Commits a silent stream soon and keeps it alive, queues one request per model for a
    second, and takes two browser sockets."""
    yield from committing_gateway()


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
