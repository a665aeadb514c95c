"""`POST /v1/responses` in the gateway against a protocol-level fake runner: what the runner
is asked, the raw SSE (`event:` lines, no [DONE]), errors before the first byte (HTTP, in
OpenAI's shape) and after it (`response.failed`), a client that leaves cancelling the request
(streamed or not), failover before the first token, the queue's 429, API keys, and stored
responses (GET, DELETE, previous_response_id, a gateway that stores nothing)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from protocol.frames import Cancel, Chunk, Error, Generate, Message, ToolCallDelta, Usage
from tests.gateway.gateways import FAKE_RUNNERS
from tests.gateway.waits import until_gone, until_queued
from tests.support import UNIT, FakeRunner, Gateway, secs

KEY = "responses-key-3e1f"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway("--first-token-wait", secs(5), "--api-key", KEY, *FAKE_RUNNERS)
    yield gw
    gw.stop()


STREAM_TIMEOUT = 1.0
"""The `small` gateway's --stream-timeout, in the tests' time unit."""


@pytest.fixture(scope="module")
def small() -> Iterator[Gateway]:
    """Stores no response, queues one request per model for a second, commits a silent
    stream after 0.2 s, keeps it alive every 0.1 s and ends it after STREAM_TIMEOUT of
    silence (a request the queue test holds, unanswered, times out so; its slot stays taken
    until its runner confirms the cancel)."""
    gw = Gateway(
        "--store-max-completions",
        "0",
        "--queue-size",
        "1",
        "--queue-timeout",
        secs(1),
        "--first-token-wait",
        secs(0.2),
        "--keepalive-interval",
        secs(0.1),
        "--stream-timeout",
        secs(STREAM_TIMEOUT),
        *FAKE_RUNNERS,
    )
    yield gw
    gw.stop()


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT, headers=AUTH) as c:
        yield c


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "input": "Hi", **extra}


def events_of(content: bytes) -> list[dict[str, Any]]:
    """The events of a raw Responses SSE body: `event: <type>` then `data: <json>`."""
    assert content.endswith(b"\n\n")
    events = []
    for block in content.split(b"\n\n")[:-1]:
        if block.startswith(b":"):
            continue  # a keep-alive
        head, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def generate(runner: FakeRunner) -> Generate:
    frame = await runner.next_request()
    assert isinstance(frame, Generate)
    return frame


async def test_streamed_reasoning_and_text(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    async def serve() -> Generate:
        gen = await generate(runner)
        rid = gen.request_id
        await runner.send(Chunk(rid, 0, "", "think", 1, Usage(4, 1, 2, 1)))
        await runner.send(Chunk(rid, 1, "Hello", "", 1, Usage(4, 2, 2, 1), "stop"))
        return gen

    task = asyncio.create_task(serve())
    resp = await http.post(
        "/v1/responses", json=body(stream=True, instructions="Be kind.", max_output_tokens=16)
    )
    gen = await task
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-request-id"].startswith("req_")
    assert gen.request_id.startswith("resp_")
    assert gen.messages == (Message("system", "Be kind."), Message("user", "Hi"))
    assert gen.max_tokens == 16
    assert b"[DONE]" not in resp.content
    events = events_of(resp.content)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert final["id"] == gen.request_id
    assert final["status"] == "completed"
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 6,
    }


async def test_not_streamed_with_a_function_call(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await generate(runner)
        rid = gen.request_id
        call = ToolCallDelta(0, '{"a": 1}', "call_1", "f")
        await runner.send(Chunk(rid, 0, "", "", 3, Usage(4, 3), "tool_calls", tool_calls=(call,)))

    task = asyncio.create_task(serve())
    resp = await http.post(
        "/v1/responses", json=body(tools=[{"type": "function", "name": "f"}], store=False)
    )
    await task
    assert resp.status_code == 200
    data = resp.json()
    assert data["status"] == "completed"
    assert data["store"] is False
    (item,) = data["output"]
    assert item["id"].startswith("fc_")
    assert {k: v for k, v in item.items() if k != "id"} == {
        "type": "function_call",
        "status": "completed",
        "arguments": '{"a": 1}',
        "call_id": "call_1",
        "name": "f",
    }
    gone = await http.get(f"/v1/responses/{data['id']}")
    assert gone.status_code == 404  # store: false


async def test_a_runner_error_before_the_first_chunk_is_an_http_error(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(Error(gen.request_id, "context_length_exceeded", "too long", "input"))

    for stream in (True, False):
        task = asyncio.create_task(serve())
        resp = await http.post("/v1/responses", json=body(stream=stream))
        await task
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "input",
            "context_length_exceeded",
            "invalid_request_error",
        )


async def test_an_error_mid_stream_fails_the_response(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        await runner.send(Error(gen.request_id, "internal_error", "boom"))

    task = asyncio.create_task(serve())
    resp = await http.post("/v1/responses", json=body(stream=True))
    await task
    events = events_of(resp.content)
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert (failed["status"], failed["error"]) == (
        "failed",
        {"code": "server_error", "message": "boom"},
    )
    assert failed["output"] == []  # the message was cut short
    assert events[-2]["type"] == "response.output_text.delta"


async def test_client_disconnect_cancels_a_stream(runner: FakeRunner, gateway: Gateway) -> None:
    got_cancel = asyncio.Event()

    async def serve() -> None:
        gen = await generate(runner)
        await runner.send(FakeRunner.chunk(gen.request_id, 0, "a"))
        assert await runner.next_request() == Cancel(gen.request_id)
        got_cancel.set()
        await runner.send(Chunk(gen.request_id, 1, "", "", 0, Usage(3, 1), "cancelled"))

    task = asyncio.create_task(serve())
    async with (
        httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT, headers=AUTH) as http,
        http.stream("POST", "/v1/responses", json=body(stream=True)) as resp,
    ):
        async for line in resp.aiter_lines():
            if line.startswith("event: response.output_text.delta"):
                break
    await asyncio.wait_for(got_cancel.wait(), 5 * UNIT)
    await task


async def test_client_disconnect_cancels_a_plain_request(
    runner: FakeRunner, gateway: Gateway
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    payload = orjson.dumps(body())
    writer.write(
        b"POST /v1/responses HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
        % (KEY.encode(), len(payload), payload)
    )
    await writer.drain()
    gen = await generate(runner)
    writer.close()
    await writer.wait_closed()
    assert await runner.next_request() == Cancel(gen.request_id)
    await runner.send(Chunk(gen.request_id, 0, "", "", 0, Usage(3, 0), "cancelled"))
    assert not await reader.read()


async def test_failover_before_the_first_token(gateway: Gateway, http: httpx.AsyncClient) -> None:
    # The first runner has more free slots, so it is asked first; it leaves without a token.
    leaving = await FakeRunner.connect(gateway, models=("failover",), max_concurrent=8)
    staying = await FakeRunner.connect(gateway, models=("failover",), max_concurrent=1)
    try:
        post = asyncio.create_task(
            http.post("/v1/responses", json={**body(stream=True), "model": "failover"})
        )
        await generate(leaving)
        await leaving.close()
        gen = await generate(staying)
        await staying.send(FakeRunner.chunk(gen.request_id, 0, "saved", done=True))
        resp = await post
        assert resp.status_code == 200
        final = events_of(resp.content)[-1]
        assert final["type"] == "response.completed"
        assert final["response"]["output"][0]["content"][0]["text"] == "saved"
    finally:
        await staying.close()


async def test_queue_full_is_429_with_retry_after(small: Gateway) -> None:
    fake = await FakeRunner.connect(small, models=("busy",), max_concurrent=1)
    async with httpx.AsyncClient(base_url=small.base, timeout=10 * UNIT) as http:
        req = {**body(stream=True), "model": "busy"}
        holder = asyncio.create_task(http.post("/v1/responses", json=req))
        await fake.next_request()
        waiter = asyncio.create_task(http.post("/v1/responses", json=req))
        await until_queued(http, 1)
        full = await http.post("/v1/responses", json={**req, "stream": False})
        assert full.status_code == 429
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"] == {
            "message": "Every runner serving `busy` is busy and its queue is full.",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
        timed_out = await waiter  # waited the queue timeout
        assert (timed_out.status_code, timed_out.headers["retry-after"]) == (429, "1")
        assert timed_out.json()["error"]["message"] == (
            "Timed out waiting for a free runner serving `busy`."
        )
        holder.cancel()
    await fake.close()


async def test_a_model_whose_runners_left_is_503_with_retry_after(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    fake = await FakeRunner.connect(gateway, models=("ephemeral",), name="ephemeral")
    await fake.close()
    await until_gone(http, "ephemeral")
    for stream in (False, True):
        resp = await http.post("/v1/responses", json={**body(stream=stream), "model": "ephemeral"})
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "model_unavailable"
        assert resp.headers["retry-after"] == "1"


async def test_api_key_required(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http:
        resp = await http.post("/v1/responses", json=body())
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
        resp = await http.get("/v1/responses/resp_x", headers={"x-api-key": "wrong"})
        assert resp.status_code == 401


async def test_unknown_fields_and_models_are_400_and_404(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    resp = await http.post("/v1/responses", json=body(logit_bias={"1": 2}))
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {
            "message": "Unrecognized request argument supplied: logit_bias",
            "type": "invalid_request_error",
            "param": "logit_bias",
            "code": "unknown_parameter",
        }
    }
    resp = await http.post("/v1/responses", json={**body(), "model": "nothing-serves-this"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"
    resp = await http.post("/v1/responses", json=body(max_output_tokens=10**9))
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_output_tokens"


async def test_stored_responses_get_delete_and_continue(
    runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    async def answer(text: str, *, stream: bool, **extra: Any) -> tuple[Generate, Any]:
        async def serve() -> Generate:
            gen = await generate(runner)
            await runner.send(FakeRunner.chunk(gen.request_id, 0, text, done=True))
            return gen

        task = asyncio.create_task(serve())
        resp = await http.post("/v1/responses", json=body(stream=stream, **extra))
        assert resp.status_code == 200, resp.text
        gen = await task
        if stream:
            return gen, events_of(resp.content)[-1]["response"]
        return gen, resp.json()

    _, first = await answer("One.", stream=False, instructions="Count.")
    assert first["store"] is True
    got = await http.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200
    assert got.json() == first

    gen, second = await answer(
        "Two.", stream=True, previous_response_id=first["id"], instructions="Again."
    )
    assert second["previous_response_id"] == first["id"]
    # The earlier turn, not its instructions (OpenAI does not carry them over).
    assert gen.messages == (
        Message("system", "Again."),
        Message("user", "Hi"),
        Message("assistant", "One."),
        Message("user", "Hi"),
    )
    assert (await http.get(f"/v1/responses/{second['id']}")).json() == second

    gen, _ = await answer("Three.", stream=False, previous_response_id=second["id"])
    assert [m.content for m in gen.messages] == ["Hi", "One.", "Hi", "Two.", "Hi"]

    deleted = await http.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    missing = await http.get(f"/v1/responses/{first['id']}")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": f"Response with id '{first['id']}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": None,
    }
    resp = await http.post("/v1/responses", json=body(previous_response_id=first["id"]))
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "previous_response_id"
    resp = await http.get(f"/v1/responses/{second['id']}?stream=true")
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "stream"


async def test_a_gateway_that_stores_nothing_says_so(small: Gateway) -> None:
    fake = await FakeRunner.connect(small)
    async with httpx.AsyncClient(base_url=small.base, timeout=10 * UNIT) as http:
        for field in ({"store": True}, {"previous_response_id": "resp_1"}):
            resp = await http.post("/v1/responses", json=body(**field))
            assert resp.status_code == 400
            error = resp.json()["error"]
            assert error["param"] == next(iter(field))
            assert "keeps no responses" in error["message"]

        async def serve() -> None:
            gen = await generate(fake)
            await fake.send(FakeRunner.chunk(gen.request_id, 0, "x", done=True))

        task = asyncio.create_task(serve())
        resp = await http.post("/v1/responses", json=body())
        await task
        assert resp.json()["store"] is False  # not stored, and the response says so
        gone = await http.get(f"/v1/responses/{resp.json()['id']}")
        assert gone.status_code == 404
    await fake.close()


async def test_a_stream_committed_before_its_first_token_then_timed_out(small: Gateway) -> None:
    # Past --first-token-wait the stream commits to 200 (created and in_progress go out with
    # no token yet, keep-alives fill the silence); the token is sent once the client has seen
    # a keep-alive; past --stream-timeout of silence after it, the stream fails.
    fake = await FakeRunner.connect(small, models=("late",))
    try:
        kept_alive = asyncio.Event()

        async def serve() -> Generate | Cancel:
            gen = await generate(fake)
            await asyncio.wait_for(kept_alive.wait(), 10 * UNIT)
            await fake.send(Chunk(gen.request_id, 0, "late", "", 1, Usage(3, 1)))
            return await fake.next_request()  # nothing more: the gateway gives up

        task = asyncio.create_task(serve())
        async with (
            httpx.AsyncClient(base_url=small.base, timeout=10 * UNIT) as http,
            http.stream("POST", "/v1/responses", json=body(stream=True, model="late")) as resp,
        ):
            content = b""
            async for part in resp.aiter_raw():
                content += part
                if b": keep-alive\n\n" in content:
                    kept_alive.set()
        cancel = await task
        assert resp.status_code == 200
        assert content.startswith(b"event: response.created\n")
        assert b": keep-alive\n\n" in content
        events = events_of(content)
        assert [e["type"] for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.failed",
        ]
        assert "usage" not in events[0]["response"]
        failed = events[-1]["response"]
        silence = secs(STREAM_TIMEOUT)
        assert failed["error"] == {
            "code": "server_error",
            "message": f"The runner sent nothing for {silence} s; the request was ended.",
        }
        assert isinstance(cancel, Cancel)
    finally:
        await fake.close()
