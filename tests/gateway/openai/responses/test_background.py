"""Background responses (`background: true`) against a protocol-level fake runner, with the
official `openai` SDK (sync and async) as the client: queued at once, run with no client,
retrieved as they stand, their events streamed again from any sequence number while they run
and after they end, cancelled (running, or still waiting for a runner), bounded, and every
refusal in OpenAI's shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from protocol.frames import Cancel, Chunk, Error, Generate, Usage
from tests.gateway.gateways import FAKE_RUNNERS
from tests.support import UNIT, FakeRunner, Gateway, async_wait_until, secs


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway("--first-token-wait", secs(5), "--max-background", "2", *FAKE_RUNNERS)
    yield gw
    gw.stop()


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as client:
        yield client


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0, timeout=10 * UNIT
    ) as sdk:
        yield sdk


def sse(content: bytes) -> list[dict[str, Any]]:
    """The events of a Responses SSE body (keep-alive comments skipped)."""
    events = []
    for block in content.split(b"\n\n")[:-1]:
        if block.startswith(b":"):
            continue
        head, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        events.append(event)
    return events


async def generate(runner: FakeRunner) -> Generate:
    frame = await runner.next_request()
    assert isinstance(frame, Generate), frame
    return frame


def text(rid: str, seq: int, words: str, finish: str | None = None) -> Chunk:
    return Chunk(rid, seq, words, "", 1, Usage(4, seq + 1), finish)  # type: ignore[arg-type]


async def until_status(http: httpx.AsyncClient, rid: str, status: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def reached() -> bool:
        seen.update((await http.get(f"/v1/responses/{rid}")).json())
        return seen.get("status") == status

    await async_wait_until(reached, 10, f"{rid} {status}")
    return seen


async def test_queued_at_once_then_completed_with_no_client(
    runner: FakeRunner, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    created = await client.responses.create(model="fake-model", input="Hi", background=True)
    assert (created.status, created.background) == ("queued", True)
    assert created.model_dump()["store"] is True
    assert created.output == []
    assert created.usage is None
    gen = await generate(runner)
    assert gen.request_id == created.id
    running = await until_status(http, created.id, "in_progress")
    assert (running["background"], running["output"]) == (True, [])
    await runner.send(text(gen.request_id, 0, "Hello"))
    await runner.send(text(gen.request_id, 1, " there", "stop"))
    done = await until_status(http, created.id, "completed")
    assert done["output"][0]["content"][0]["text"] == "Hello there"
    assert done["usage"]["output_tokens"] == 2
    retrieved = await client.responses.retrieve(created.id)
    assert (retrieved.status, retrieved.output_text) == ("completed", "Hello there")
    items = await client.responses.input_items.list(created.id)
    assert [item.type for item in items.data] == ["message"]
    # It continues as any stored response does.
    follow = asyncio.ensure_future(
        client.responses.create(model="fake-model", input="More", previous_response_id=created.id)
    )
    turn = await generate(runner)
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "Hi"),
        ("assistant", "Hello there"),
        ("user", "More"),
    ]
    await runner.send(text(turn.request_id, 0, "Ok", "stop"))
    assert (await follow).output_text == "Ok"


async def test_streamed_then_resumed_from_any_sequence_number(
    runner: FakeRunner, gateway: Gateway, http: httpx.AsyncClient
) -> None:
    # The creating client reads the first events, then leaves: the response runs on.
    async with http.stream(
        "POST",
        "/v1/responses",
        json={"model": "fake-model", "input": "Hi", "background": True, "stream": True},
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        head = b""
        async for part in resp.aiter_bytes():
            head += part
            if head.count(b"\n\n") >= 2:
                break
    first = sse(head[: head.index(b"\n\n", head.index(b"\n\n") + 2) + 2])
    assert [(e["type"], e["sequence_number"], e["response"]["status"]) for e in first] == [
        ("response.created", 0, "queued"),
        ("response.queued", 1, "queued"),
    ]
    rid = first[0]["response"]["id"]
    gen = await generate(runner)
    assert gen.request_id == rid
    await runner.send(text(rid, 0, "One"))
    # Resumed while it runs: the events after 1, then the live ones as they come.
    sync = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0)

    def resume(after: int) -> list[Any]:
        with sync.responses.retrieve(rid, stream=True, starting_after=after) as events:
            return list(events)

    live = asyncio.ensure_future(asyncio.to_thread(resume, 1))
    await runner.send(text(rid, 1, " two", "stop"))
    resumed = await live
    assert resumed[0].sequence_number == 2
    assert [e.sequence_number for e in resumed] == list(range(2, 2 + len(resumed)))
    assert [e.type for e in resumed] == [
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert resumed[-1].response.output_text == "One two"
    # After it ended: the same events, from wherever asked; none after the last.
    everything = sse((await http.get(f"/v1/responses/{rid}?stream=true")).content)
    assert [e["sequence_number"] for e in everything] == list(range(11))
    assert everything[2:] == [e.model_dump(exclude_unset=True) for e in resumed]
    tail = sse((await http.get(f"/v1/responses/{rid}?stream=true&starting_after=8")).content)
    assert [e["type"] for e in tail] == ["response.output_item.done", "response.completed"]
    assert resume(10) == []


async def test_cancelled_while_running_and_idempotent(
    runner: FakeRunner, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    created = await client.responses.create(model="fake-model", input="Hi", background=True)
    gen = await generate(runner)
    await runner.send(text(gen.request_id, 0, "Partial"))
    cancelling = asyncio.ensure_future(client.responses.cancel(created.id))
    frame = await runner.next_request()
    assert frame == Cancel(gen.request_id)
    await runner.send(
        Chunk(gen.request_id, 1, "", "", 0, Usage(4, 1), "cancelled")  # the runner confirms
    )
    cancelled = await cancelling
    assert cancelled.status == "cancelled"
    output = cancelled.model_dump()["output"]
    assert [(i["type"], i["status"]) for i in output] == [("message", "incomplete")]
    assert cancelled.output_text == "Partial"
    again = await client.responses.cancel(created.id)
    assert again.model_dump() == cancelled.model_dump()
    assert (await client.responses.retrieve(created.id)).status == "cancelled"
    events = sse((await http.get(f"/v1/responses/{created.id}?stream=true")).content)
    assert events[-1]["type"] == "response.output_item.done"  # no event says cancelled
    assert events[-1]["item"]["status"] == "incomplete"
    refused = await http.post(
        "/v1/responses",
        json={"model": "fake-model", "input": "x", "previous_response_id": created.id},
    )
    assert refused.status_code == 400  # a cancelled response is not continued
    assert refused.json()["error"]["param"] == "previous_response_id"


async def test_cancelled_while_waiting_for_a_runner(
    gateway: Gateway, client: openai.AsyncOpenAI
) -> None:
    busy = await FakeRunner.connect(gateway, max_concurrent=1, name="busy")
    try:
        holder = await client.responses.create(model="fake-model", input="A", background=True)
        gen = await generate(busy)
        queued = await client.responses.create(model="fake-model", input="B", background=True)
        cancelled = await client.responses.cancel(queued.id)
        assert (cancelled.status, cancelled.output) == ("cancelled", [])
        await busy.send(text(gen.request_id, 0, "done", "stop"))
        assert (await client.responses.retrieve(holder.id)).status in ("in_progress", "completed")
        with pytest.raises(TimeoutError):  # the cancelled one never reaches the runner
            async with asyncio.timeout(0.5 * UNIT):
                await busy.next_request()
    finally:
        await busy.close()


async def test_a_runner_error_fails_it(
    runner: FakeRunner, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    created = await client.responses.create(model="fake-model", input="Hi", background=True)
    gen = await generate(runner)
    await runner.send(text(gen.request_id, 0, "so"))
    await runner.send(Error(gen.request_id, "internal_error", "the runner broke"))
    failed = await until_status(http, created.id, "failed")
    assert failed["error"] == {"code": "server_error", "message": "the runner broke"}
    events = sse((await http.get(f"/v1/responses/{created.id}?stream=true")).content)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == failed["error"]


async def test_at_most_max_background_at_once(runner: FakeRunner, http: httpx.AsyncClient) -> None:
    body = {"model": "fake-model", "input": "Hi", "background": True}
    first = (await http.post("/v1/responses", json=body)).json()
    second = (await http.post("/v1/responses", json=body)).json()
    third = await http.post("/v1/responses", json=body)
    assert third.status_code == 429
    assert third.json()["error"]["code"] == "rate_limit_exceeded"
    assert third.json()["error"]["param"] == "background"
    for _ in range(2):
        gen = await generate(runner)
        await runner.send(text(gen.request_id, 0, "x", "stop"))
    for created in (first, second):
        await until_status(http, created["id"], "completed")
    assert (await http.post("/v1/responses", json={**body, "stream": False})).status_code == 200
    gen = await generate(runner)
    await runner.send(text(gen.request_id, 0, "x", "stop"))


@pytest.mark.parametrize(
    ("query", "param", "code"),
    [
        ("starting_after=1", "starting_after", "invalid_parameter_combination"),
        ("stream=true&starting_after=-1", "starting_after", "invalid_type"),
        ("stream=yes", "stream", "invalid_type"),
        ("stream=true&stream=true", "stream", "invalid_value"),
        ("include=file_search_call.results", "include", "unsupported_value"),
        ("after=x", "after", "unknown_parameter"),
    ],
)
async def test_bad_retrieve_queries(
    runner: FakeRunner, http: httpx.AsyncClient, query: str, param: str, code: str
) -> None:
    created = (
        await http.post(
            "/v1/responses", json={"model": "fake-model", "input": "Hi", "background": True}
        )
    ).json()
    gen = await generate(runner)
    resp = await http.get(f"/v1/responses/{created['id']}?{query}")
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    await runner.send(text(gen.request_id, 0, "x", "stop"))
    await until_status(http, created["id"], "completed")


async def test_what_did_not_run_in_the_background(
    runner: FakeRunner, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    plain = asyncio.ensure_future(client.responses.create(model="fake-model", input="Hi"))
    gen = await generate(runner)
    await runner.send(text(gen.request_id, 0, "x", "stop"))
    rid = (await plain).id
    for method, path in (
        ("POST", f"/v1/responses/{rid}/cancel"),
        ("GET", f"/v1/responses/{rid}?stream=true"),
    ):
        resp = await http.request(method, path)
        assert resp.status_code == 400, resp.text
        assert "background" in resp.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_nowhere")
    stateless = await http.post(
        "/v1/responses",
        json={"model": "fake-model", "input": "Hi", "background": True, "store": False},
    )
    assert stateless.status_code == 400
    assert stateless.json()["error"]["param"] == "background"
