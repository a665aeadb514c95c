"""The Ollama API relaying a protocol-level fake runner: the exact NDJSON bytes, what reaches
the runner, errors before and after the first line, cancellation when the client leaves, the
queue's 429 and an unserved model's 503, API keys, and the model endpoints, with the official
`ollama` client where it can speak."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import ollama
import orjson
import pytest

from protocol.frames import (
    Cancel,
    Chunk,
    Error,
    FinishReason,
    Generate,
    ResponseFormat,
    SamplingParams,
    Usage,
)
from tests.gateway.gateways import FAKE_RUNNERS
from tests.gateway.waits import until_gone, until_queued
from tests.support import UNIT, FakeRunner, Gateway, secs

KEY = "ollama-key-3b7e"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway(
        "--api-key",
        KEY,
        "--first-token-wait",
        secs(5),
        "--queue-size",
        "1",
        "--queue-timeout",
        secs(1),
        *FAKE_RUNNERS,
    )
    yield gw
    gw.stop()


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT, headers=AUTH) as c:
        yield c


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=gateway.base, headers=AUTH, timeout=10 * UNIT) as c:
        yield c


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": HI, **extra}


async def serve(runner: FakeRunner, *texts: str, reason: FinishReason = "stop") -> Generate:
    """Answer the next request with `texts`, one chunk each, the last with `reason`."""
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    for seq, text in enumerate(texts):
        last = seq == len(texts) - 1
        chunk = Chunk(gen.request_id, seq, text, "", 1, Usage(3, seq + 1), reason if last else None)
        await runner.send(chunk)
    return gen


def ndjson(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\n")
    return [orjson.loads(line) for line in raw.split(b"\n")[:-1]]


async def test_a_stream_is_relayed_as_ndjson(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    task = asyncio.create_task(serve(runner, "Hel", "lo", "", reason="length"))
    response = await http.post("/api/chat", json=body(options={"num_predict": 3}))
    gen = await task
    assert gen.max_tokens == 3
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    first, second, last = ndjson(response.content)
    assert list(first) == ["model", "created_at", "message", "done"]
    assert first["message"] == {"role": "assistant", "content": "Hel"}
    assert (first["model"], first["done"]) == ("fake-model", False)
    assert second["message"]["content"] == "lo"
    assert list(last) == [
        "model",
        "created_at",
        "message",
        "done_reason",
        "done",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    ]
    assert (last["done_reason"], last["prompt_eval_count"], last["eval_count"]) == ("length", 3, 3)
    assert last["message"] == {"role": "assistant", "content": ""}
    parts = (
        last["load_duration"],
        last["prompt_eval_duration"],
        last["eval_duration"],
    )
    assert all(type(p) is int and p >= 0 for p in parts)
    assert sum(parts) == last["total_duration"] > 0


async def test_the_ollama_client_streams_and_collects(
    runner: FakeRunner, client: ollama.AsyncClient
) -> None:
    task = asyncio.create_task(serve(runner, "a", "b"))
    parts = [p async for p in await client.chat("fake-model", HI, stream=True)]
    await task
    assert [p.message.content for p in parts] == ["a", "b", ""]
    assert [p.done for p in parts] == [False, False, True]
    assert (parts[-1].done_reason, parts[-1].eval_count) == ("stop", 2)

    task = asyncio.create_task(serve(runner, "x", "y"))
    whole = await client.generate("fake-model", "hi")
    await task
    assert (whole.response, whole.done, whole.done_reason) == ("xy", True, "stop")
    assert (whole.prompt_eval_count, whole.eval_count) == (3, 2)
    assert whole.total_duration is not None
    assert whole.total_duration > 0


async def test_what_reaches_the_runner(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    task = asyncio.create_task(serve(runner, "{}"))
    fields = {
        "stream": False,
        "format": "json",
        "think": False,
        "keep_alive": 0,
        "options": {"temperature": 0, "top_k": 1, "seed": 7, "stop": ["END"]},
    }
    response = await http.post(
        "/api/generate", json={"model": "fake-model", "prompt": "p", **fields}
    )
    gen = await task
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["response"] == "{}"
    assert gen.sampling == SamplingParams(
        temperature=0.0, top_p=0.9, top_k=1, seed=7, unset=("top_p", "min_p")
    )
    assert (gen.stop, gen.response_format, gen.reasoning_effort) == (
        ("END",),
        ResponseFormat("json_object"),
        None,
    )
    assert gen.chat_template_kwargs == '{"enable_thinking":false}'


async def test_api_keys_are_required(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base) as http:
        response = await http.post("/api/chat", json=body())
    assert response.status_code == 401
    assert list(response.json()) == ["error"]
    async with ollama.AsyncClient(host=gateway.base) as anonymous:
        with pytest.raises(ollama.ResponseError) as info:
            await anonymous.chat("fake-model", HI)
    assert info.value.status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    async with ollama.AsyncClient(host=gateway.base, headers=wrong) as stranger:
        with pytest.raises(ollama.ResponseError) as info:
            await stranger.list()
    assert info.value.status_code == 401


async def test_errors_are_in_ollamas_shape(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    unknown = await http.post("/api/chat", json=body(nonsense=1))
    assert unknown.status_code == 400
    assert unknown.json() == {"error": "Unrecognized request argument supplied: nonsense"}
    missing = await http.post("/api/chat", json={**body(), "model": "no-such-model"})
    assert missing.status_code == 404
    assert missing.json() == {"error": 'model "no-such-model" not found'}
    for path in ("/api/pull", "/api/create", "/api/copy", "/api/blobs/sha256:00"):
        answer = await http.post(path, json={"model": "x"})
        assert answer.status_code == 501
        assert "served by its runners" in answer.json()["error"]
    deleted = await http.request("DELETE", "/api/delete", json={"model": "x"})
    assert deleted.status_code == 501


async def test_a_runner_error_before_the_first_line_is_an_http_error(
    runner: FakeRunner, client: ollama.AsyncClient
) -> None:
    async def refuse() -> None:
        gen = await runner.next_request()
        await runner.send(Error(gen.request_id, "context_length_exceeded", "too long", "messages"))

    task = asyncio.create_task(refuse())
    stream = await client.chat("fake-model", HI, stream=True)  # sent when first read
    with pytest.raises(ollama.ResponseError) as info:
        await anext(stream)
    await task
    assert (info.value.status_code, info.value.error) == (400, "too long")


async def test_a_runner_error_mid_stream_is_an_error_line(
    runner: FakeRunner, http: httpx.AsyncClient, client: ollama.AsyncClient
) -> None:
    async def fail() -> None:
        gen = await runner.next_request()
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        await runner.send(Error(gen.request_id, "internal_error", "the engine failed"))

    task = asyncio.create_task(fail())
    response = await http.post("/api/chat", json=body())
    await task
    assert response.status_code == 200
    assert [line.get("error") for line in ndjson(response.content)] == [None, "the engine failed"]

    seen: list[str | None] = []

    async def read() -> None:
        async for part in await client.chat("fake-model", HI, stream=True):
            seen.append(part.message.content)

    task = asyncio.create_task(fail())
    with pytest.raises(ollama.ResponseError) as info:
        await read()
    await task
    assert (seen, info.value.error) == (["a"], "the engine failed")


async def test_a_client_leaving_a_stream_cancels(runner: FakeRunner, gateway: Gateway) -> None:
    got_cancel = asyncio.Event()

    async def serve_until_cancelled() -> None:
        gen = await runner.next_request()
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        assert await runner.next_request() == Cancel(gen.request_id)
        got_cancel.set()
        await runner.send(Chunk(gen.request_id, 1, "", "", 0, Usage(3, 1), "cancelled"))

    task = asyncio.create_task(serve_until_cancelled())
    async with (
        httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT, headers=AUTH) as http,
        http.stream("POST", "/api/chat", json=body()) as response,
    ):
        async for line in response.aiter_lines():
            assert orjson.loads(line)["message"]["content"] == "a"
            break
    await asyncio.wait_for(got_cancel.wait(), 5 * UNIT)
    await task


async def test_a_client_leaving_before_the_answer_cancels(
    runner: FakeRunner, gateway: Gateway
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    payload = orjson.dumps(body(stream=False))
    writer.write(
        b"POST /api/chat HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
        % (KEY.encode(), len(payload), payload)
    )
    await writer.drain()
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    writer.close()
    await writer.wait_closed()
    assert await runner.next_request() == Cancel(gen.request_id)
    await runner.send(Chunk(gen.request_id, 0, "", "", 0, Usage(3, 0), "cancelled"))
    assert not await reader.read()


async def test_a_full_queue_is_429(gateway: Gateway, http: httpx.AsyncClient) -> None:
    fake = await FakeRunner.connect(gateway, models=("busy",), max_concurrent=1)
    request = {**body(), "model": "busy"}
    holder = asyncio.create_task(http.post("/api/chat", json=request))
    gen = await fake.next_request()
    assert isinstance(gen, Generate)
    waiter = asyncio.create_task(http.post("/api/chat", json=request))
    await until_queued(http, 1)
    full_message = "Every runner serving `busy` is busy and its queue is full."
    async with ollama.AsyncClient(host=gateway.base, headers=AUTH) as client:
        with pytest.raises(ollama.ResponseError) as info:
            await client.chat("busy", HI)
    assert (info.value.status_code, info.value.error) == (429, full_message)
    full = await http.post("/api/generate", json={"model": "busy", "prompt": "p"})
    assert (full.status_code, full.headers["retry-after"]) == (429, "1")
    assert full.json() == {"error": full_message}
    timed_out = await waiter  # waited the queue timeout
    assert (timed_out.status_code, timed_out.headers["retry-after"]) == (429, "1")
    assert timed_out.json() == {"error": "Timed out waiting for a free runner serving `busy`."}
    await fake.send(FakeRunner.chunk(gen.request_id, 0, "done", done=True))
    assert ndjson((await holder).content)[0]["message"]["content"] == "done"
    await fake.close()


async def test_a_model_whose_runner_just_left_is_503(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    fake = await FakeRunner.connect(gateway, models=("leaving",), name="leaving")
    await fake.close()
    await until_gone(http, "leaving")
    response = await http.post("/api/chat", json={**body(), "model": "leaving"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert list(response.json()) == ["error"]


async def test_model_endpoints(runner: FakeRunner, client: ollama.AsyncClient) -> None:
    listed = await client.list()
    assert [m.model for m in listed.models] == ["fake-model"]
    (model,) = listed.models
    assert model.modified_at is not None
    assert model.size is None  # unknown to the gateway, not made up
    running = await client.ps()
    assert [(m.name, m.context_length) for m in running.models] == [("fake-model", 4096)]
    shown = await client.show("fake-model")
    assert shown.modelinfo is not None
    assert shown.modelinfo["orchard.context_length"] == 4096
    assert shown.capabilities == ["completion", "tools"]
    with pytest.raises(ollama.ResponseError) as info:
        await client.show("no-such-model")
    assert (info.value.status_code, info.value.error) == (404, 'model "no-such-model" not found')
    with pytest.raises(ollama.ResponseError) as info:
        await client.pull("fake-model")
    assert info.value.status_code == 501


async def test_an_empty_chat_only_loads(runner: FakeRunner, client: ollama.AsyncClient) -> None:
    loaded = await client.chat("fake-model", [])
    assert (loaded.done, loaded.done_reason, loaded.eval_count) == (True, "load", None)
    streamed = [p async for p in await client.generate("fake-model", "", stream=True)]
    assert [(p.done, p.done_reason) for p in streamed] == [(True, "load")]
    # Nothing reached the runner: the next request it is given is the one sent now.
    task = asyncio.create_task(serve(runner, "x"))
    after = await client.chat("fake-model", [{"role": "user", "content": "after"}])
    gen = await task
    assert [m.content for m in gen.messages] == ["after"]
    assert after.message.content == "x"
