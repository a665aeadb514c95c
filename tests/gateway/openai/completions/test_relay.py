"""`POST /v1/completions` in the gateway, against a protocol-level fake runner: what the runner
is asked, exact streamed objects, errors before the first byte (HTTP) and after it (an SSE
error event, then [DONE]), several prompts, and a client that leaves cancelling them all."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from protocol.frames import Cancel, Chunk, Echo, Error, Generate, Usage
from tests.gateway.waits import until_idle
from tests.support import UNIT, FakeRunner, Gateway, sse_events


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    return patient_gateway  # shared with other modules (conftest.py)


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "Once", **extra}


async def generate(runner: FakeRunner) -> Generate:
    frame = await runner.next_request()
    assert isinstance(frame, Generate)
    return frame


async def test_streamed_with_echo(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    async def serve() -> Generate:
        gen = await generate(runner)
        rid = gen.request_id
        await runner.send(Chunk(rid, 0, " up", "", 1, Usage(1, 1), echo=Echo("Once")))
        await runner.send(Chunk(rid, 1, "on", "", 1, Usage(1, 2), "length"))
        return gen

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/completions", json=body(stream=True, echo=True, max_tokens=2))
    gen = await task
    assert resp.status_code == 200
    assert resp.headers["x-request-id"].startswith("req_")
    assert (gen.prompt, gen.messages, gen.max_tokens, gen.echo) == ("Once", (), 2, True)
    events = sse_events(resp.content)
    assert events[-1] == "[DONE]"
    assert [(e["object"], e["id"]) for e in events[:-1]] == [
        ("text_completion", gen.request_id)
    ] * 3
    assert gen.request_id.startswith("cmpl-")
    assert [e["choices"] for e in events[:-1]] == [
        [{"text": "Once up", "index": 0, "logprobs": None, "finish_reason": None}],
        [{"text": "on", "index": 0, "logprobs": None, "finish_reason": None}],
        [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
    ]


async def test_a_runner_error_before_the_first_chunk_is_an_http_error(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(Error(gen.request_id, "context_length_exceeded", "too long", "prompt"))

    for stream in (True, False):
        task = asyncio.create_task(serve())
        resp = await http.post("/v1/completions", json=body(stream=stream))
        await task
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")


async def test_an_error_mid_stream_is_an_event_then_done(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        await runner.send(Error(gen.request_id, "internal_error", "boom"))

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/completions", json=body(stream=True))
    await task
    events = sse_events(resp.content)
    assert events[0]["choices"][0]["text"] == "a"
    assert events[1] == {
        "error": {
            "message": "boom",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert events[2:] == ["[DONE]"]


async def test_several_prompts_each_a_request(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    async def serve() -> list[Generate]:
        gens = [await generate(runner), await generate(runner)]
        by_prompt = {g.prompt_tokens: g for g in gens}
        first, second = by_prompt[(1, 2)], by_prompt[(3,)]
        await runner.send(Chunk(second.request_id, 0, "B", "", 1, Usage(1, 1), "stop"))
        await runner.send(Chunk(first.request_id, 0, "A", "", 1, Usage(2, 1), "length"))
        return [first, second]

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/completions", json=body(prompt=[[1, 2], [3]]))
    first, second = await task
    assert first.request_id.endswith("-0")
    assert second.request_id.endswith("-1")
    answer = resp.json()
    assert answer["id"] == first.request_id.removesuffix("-0")
    assert answer["choices"] == [
        {"text": "A", "index": 0, "logprobs": None, "finish_reason": "length"},
        {"text": "B", "index": 1, "logprobs": None, "finish_reason": "stop"},
    ]
    assert answer["usage"]["prompt_tokens"] == 3
    assert answer["usage"]["completion_tokens"] == 2


async def test_a_client_that_leaves_cancels_every_prompt(
    runner: FakeRunner, gateway: Gateway
) -> None:
    cancelled: set[str] = set()

    async def serve() -> None:
        gens = [await generate(runner), await generate(runner)]
        for gen in gens:
            await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        while len(cancelled) < 2:
            frame = await runner.next_request()
            assert isinstance(frame, Cancel)
            cancelled.add(frame.request_id)
            await runner.send(Chunk(frame.request_id, 1, "", "", 0, Usage(3, 1), "cancelled"))
        assert cancelled == {gen.request_id for gen in gens}

    task = asyncio.create_task(serve())
    request = body(prompt=["x", "y"], stream=True)
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http:
        async with http.stream("POST", "/v1/completions", json=request) as resp:
            async for line in resp.aiter_lines():
                if '"text":"a"' in line:
                    break
        await asyncio.wait_for(task, 5 * UNIT)
        await until_idle(http)  # the confirmations freed both slots
