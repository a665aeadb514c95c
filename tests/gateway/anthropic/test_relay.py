"""`POST /v1/messages` and `/v1/messages/count_tokens` in the gateway, against a
protocol-level fake runner: what the runner is asked, exact events, errors in Anthropic's shape
before the first byte (HTTP) and after it (an `error` event), a client that leaves cancelling
its request, the queue's 429, the model's 503, `x-api-key`, and the `ping` keep-alive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from protocol.frames import Cancel, Chunk, Error, Generate, ToolCallDelta, Usage
from tests.gateway.gateways import FAKE_RUNNERS
from tests.gateway.waits import until_gone, until_idle, until_queued
from tests.support import UNIT, FakeRunner, Gateway, secs

KEY = "anthropic-key-7e3b"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    return patient_gateway  # shared with other modules (conftest.py)


@pytest.fixture(scope="module")
def keyed() -> Iterator[Gateway]:
    """Commits to a stream at once, pings often, queues one request for a second, wants an
    API key."""
    gw = Gateway(
        "--first-token-wait",
        secs(0.05),
        "--keepalive-interval",
        secs(0.2),
        "--queue-size",
        "1",
        "--queue-timeout",
        secs(1),
        "--api-key",
        KEY,
        *FAKE_RUNNERS,
    )
    yield gw
    gw.stop()


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=gateway.base, api_key="unused", max_retries=0
    ) as c:
        yield c


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
    }


def sse(content: bytes) -> list[tuple[str, Any]]:
    out = []
    for block in content.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        out.append((name.removeprefix(b"event: ").decode(), orjson.loads(data[6:])))
    return out


async def generate(runner: FakeRunner) -> Generate:
    frame = await runner.next_request()
    assert isinstance(frame, Generate)
    return frame


async def answer(runner: FakeRunner) -> Generate:
    """Thinking, text, then a tool call: the whole range of blocks."""
    gen = await generate(runner)
    rid = gen.request_id
    usage = Usage(9, 1, cached_tokens=5)
    await runner.send(Chunk(rid, 0, "", "Hmm", 1, usage))
    await runner.send(Chunk(rid, 1, "Sure", "", 1, Usage(9, 2, cached_tokens=5)))
    call = ToolCallDelta(0, '{"city": "Paris"}', id="call_7", name="get_weather")
    await runner.send(Chunk(rid, 2, "", "", 3, Usage(9, 5, 5), tool_calls=(call,)))
    await runner.send(Chunk(rid, 3, "", "", 0, Usage(9, 5, 5), "tool_calls"))
    return gen


EXPECTED_CONTENT = [
    {"type": "thinking", "thinking": "Hmm", "signature": ""},
    {"type": "text", "text": "Sure"},
    {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Paris"}},
]
EXPECTED_USAGE = {
    "input_tokens": 4,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 5,
    "output_tokens": 5,
}


async def test_not_streamed(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    task = asyncio.create_task(answer(runner))
    resp = await http.post(
        "/v1/messages",
        json=body(system="Be brief.", temperature=0, top_k=2, metadata={"user_id": "u"}),
    )
    gen = await task
    assert resp.status_code == 200
    assert resp.headers["request-id"].startswith("req_")
    assert (gen.max_tokens, gen.sampling.temperature, gen.sampling.top_k) == (8, 0.0, 2)
    assert [(m.role, m.content) for m in gen.messages] == [("system", "Be brief."), ("user", "Hi")]
    message = resp.json()
    assert message["id"] == gen.request_id
    assert message["id"].startswith("msg_")
    assert message == {
        "id": gen.request_id,
        "type": "message",
        "role": "assistant",
        "model": "fake-model",
        "content": EXPECTED_CONTENT,
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": EXPECTED_USAGE,
    }


async def test_streamed_with_the_sdk(runner: FakeRunner, client: anthropic.AsyncAnthropic) -> None:
    task = asyncio.create_task(answer(runner))
    async with client.messages.stream(
        model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    gen = await task
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "thinking",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "text",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "input_json",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.id == gen.request_id
    assert [block.to_dict() for block in final.content] == EXPECTED_CONTENT
    assert (final.stop_reason, final.stop_sequence) == ("tool_use", None)
    assert final.usage.to_dict() == EXPECTED_USAGE


async def test_a_runner_error_before_the_first_chunk_is_an_http_error(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(Error(gen.request_id, "context_length_exceeded", "too long", "messages"))

    for stream in (True, False):
        task = asyncio.create_task(serve())
        resp = await http.post("/v1/messages", json=body(stream=stream))
        await task
        assert resp.status_code == 400
        assert resp.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "too long"},
        }


async def test_a_runner_refusing_thinking_names_thinking(
    runner: FakeRunner, client: anthropic.AsyncAnthropic
) -> None:
    async def serve() -> Generate:
        gen = await generate(runner)
        await runner.send(
            Error(gen.request_id, "invalid_request", "no think markers", "reasoning_effort")
        )
        return gen

    task = asyncio.create_task(serve())
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        await client.messages.create(
            model="fake-model",
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
            thinking={"type": "disabled"},
        )
    assert (await task).reasoning_effort == "none"


async def test_an_error_mid_stream_is_an_error_event(
    runner: FakeRunner, http: httpx.AsyncClient, client: anthropic.AsyncAnthropic
) -> None:
    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        await runner.send(Error(gen.request_id, "internal_error", "boom"))

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/messages", json=body(stream=True))
    await task
    assert resp.status_code == 200
    events = sse(resp.content)
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "boom"}}

    task = asyncio.create_task(serve())
    with pytest.raises(anthropic.APIStatusError, match="boom"):
        async with client.messages.stream(
            model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            await stream.get_final_message()
    await task


async def test_refusals_are_in_anthropics_shape(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    resp = await http.post("/v1/messages", json=body(foo=1))
    assert resp.status_code == 400
    assert resp.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Unrecognized request argument supplied: foo",
        },
    }
    resp = await http.post("/v1/messages", json=body(model="nobody"))
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "not_found_error"
    no_max = {k: v for k, v in body().items() if k != "max_tokens"}
    resp = await http.post("/v1/messages", json=no_max)
    assert resp.json()["error"]["message"] == "max_tokens: Field required"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_cancels_its_request(
    runner: FakeRunner, gateway: Gateway, stream: bool
) -> None:
    started = asyncio.Event()

    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        started.set()
        frame = await runner.next_request()
        assert frame == Cancel(gen.request_id)
        await runner.send(Chunk(gen.request_id, 1, "", "", 0, Usage(3, 1), "cancelled"))

    task = asyncio.create_task(serve())
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http:
        if stream:
            async with http.stream("POST", "/v1/messages", json=body(stream=True)) as resp:
                async for line in resp.aiter_lines():
                    if "text_delta" in line:
                        break
        else:
            post = asyncio.create_task(http.post("/v1/messages", json=body()))
            await asyncio.wait_for(started.wait(), 10 * UNIT)  # the runner has it
            post.cancel()
        await asyncio.wait_for(task, 5 * UNIT)
        await until_idle(http)  # the confirmation freed the slot


async def test_count_tokens_runs_the_prompt_for_no_token(
    runner: FakeRunner, client: anthropic.AsyncAnthropic
) -> None:
    async def serve() -> Generate:
        gen = await generate(runner)
        await runner.send(Chunk(gen.request_id, 0, "", "", 0, Usage(17, 0, 3), "length"))
        return gen

    task = asyncio.create_task(serve())
    count = await client.messages.count_tokens(
        model="fake-model", system="S", messages=[{"role": "user", "content": "Hi"}]
    )
    gen = await task
    assert count.input_tokens == 17
    assert (gen.max_tokens, [m.role for m in gen.messages]) == (0, ["system", "user"])


# --- the second gateway: API key, queue, unavailable model, early commit and pings ---------


async def test_x_api_key(keyed: Gateway) -> None:
    async with httpx.AsyncClient(base_url=keyed.base, timeout=10 * UNIT) as http:
        resp = await http.post("/v1/messages", json=body())
        assert resp.status_code == 401
        assert resp.json()["type"] == "error"
        assert resp.json()["error"]["type"] == "authentication_error"
    async with anthropic.AsyncAnthropic(base_url=keyed.base, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.count_tokens(
                model="fake-model", messages=[{"role": "user", "content": "Hi"}]
            )


async def test_the_queues_429_and_an_absent_models_503(keyed: Gateway) -> None:
    fake = await FakeRunner.connect(keyed, models=("busy",), max_concurrent=1, name="busy")
    async with httpx.AsyncClient(base_url=keyed.base, timeout=10 * UNIT, headers=HEADERS) as http:
        req = body(model="busy", stream=True)
        holder = asyncio.create_task(http.post("/v1/messages", json=req))
        await fake.next_request()
        waiter = asyncio.create_task(http.post("/v1/messages", json=req))
        await until_queued(http, 1)
        full = await http.post("/v1/messages", json=req)
        assert full.status_code == 429
        assert full.headers["retry-after"] == "1"
        assert full.json() == {
            "type": "error",
            "error": {
                "type": "rate_limit_error",
                "message": "Every runner serving `busy` is busy and its queue is full.",
            },
        }
        timed_out = await waiter  # waited the queue timeout
        assert timed_out.status_code == 429
        assert timed_out.json()["error"] == {
            "type": "rate_limit_error",
            "message": "Timed out waiting for a free runner serving `busy`.",
        }
        holder.cancel()
        await fake.close()
        await until_gone(http, "busy")
        gone = await http.post("/v1/messages", json=req)
        assert gone.status_code == 503
        assert gone.json()["error"]["type"] == "overloaded_error"
        assert gone.headers["retry-after"] == "1"


async def test_a_stream_committed_early_pings_then_carries_the_usage(keyed: Gateway) -> None:
    # Silent past first_token_wait: the stream commits (message_start, its ping), then a
    # keep-alive ping; the token is sent once the client has seen both.
    fake = await FakeRunner.connect(keyed, models=("slow",))
    pinged = asyncio.Event()

    async def serve() -> None:
        gen = await generate(fake)
        await asyncio.wait_for(pinged.wait(), 10 * UNIT)
        await fake.send(Chunk(gen.request_id, 0, "a", "", 1, Usage(6, 1, 2), "stop"))

    task = asyncio.create_task(serve())
    async with (
        httpx.AsyncClient(base_url=keyed.base, timeout=10 * UNIT, headers=HEADERS) as http,
        http.stream("POST", "/v1/messages", json=body(model="slow", stream=True)) as resp,
    ):
        content = b""
        async for part in resp.aiter_raw():
            content += part
            if content.count(b"event: ping\n") >= 2:
                pinged.set()
    await task
    await fake.close()
    names = [name for name, _ in sse(content)]
    pings = names.index("content_block_start") - 1
    assert pings >= 2
    assert names == [
        "message_start",
        *["ping"] * pings,  # only while the runner is silent
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    events = dict(sse(content))
    assert events["message_start"]["message"]["usage"]["input_tokens"] == 0
    assert events["message_delta"]["usage"] == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2,
        "output_tokens": 1,
    }
