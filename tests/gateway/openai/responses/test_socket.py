"""The Responses API's WebSocket mode in the gateway, driven by the official `openai` SDK's
`client.responses.connect()` (sync and async) against a paced scripted runner: lanes
(concurrent, each FIFO), continuations by previous_response_id, error events with their
status, the stream limit, steering, API keys and origins as on /v1/ws, and reconnection as
the SDK performs it (a proxy dropping the socket with 1012, and a real gateway restart on a
persistent store)."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.websocket_reconnection import ReconnectingEvent
from websockets.exceptions import ConnectionClosed

from protocol.frames import Chunk, Error, Generate, Usage
from tests.e2e.faults.harness import GatewayAt
from tests.gateway.gateways import FAKE_RUNNERS
from tests.gateway.openai.responses.sockets import (
    MODEL,
    DroppingProxy,
    by_lane,
    create,
    expected,
    raw,
    recv,
    recv_until_ends,
    scripted_runner,
    send,
    stopped,
    text_of,
    until_ends,
)
from tests.support import (
    UNIT,
    FakeRunner,
    Gateway,
    Process,
    async_wait_until,
    secs,
    wait_until,
)

# The SDK (3.57) opens websockets' sync client without a `with`, which websockets 17.1
# deprecates: its warning, not ours.
pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)

KEY = "ws-key-81c2"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Gateway, Process]]:
    gateway = Gateway("--api-key", KEY, *FAKE_RUNNERS)
    runner = scripted_runner(gateway, key=KEY)
    with stopped(runner, gateway):
        yield gateway, runner


@pytest.fixture(scope="module")
def gateway(stack: tuple[Gateway, Process]) -> Gateway:
    return stack[0]


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=KEY, max_retries=0) as c:
        yield c


def active(gateway: Gateway) -> int:
    runners = httpx.get(f"{gateway.base}/v1/runners", headers=AUTH, timeout=5).json()["data"]
    return int(runners[0]["active"])


# --- lanes ---------------------------------------------------------------------------------------


def test_two_lanes_run_at_once_each_in_order(client: openai.OpenAI) -> None:
    with client.responses.connect() as conn:
        for lane, tokens in (("a", 20), ("b", 24), ("a", 16), ("b", 18)):
            conn.response.create(
                model=MODEL, input=f"{lane}{tokens}", max_output_tokens=tokens, stream_id=lane
            )
        events = until_ends(conn, 4)
    lanes = by_lane(events)
    assert set(lanes) == {"a", "b"}
    assert text_of(lanes["a"]) == [expected(20), expected(16)]
    assert text_of(lanes["b"]) == [expected(24), expected(18)]
    for lane_events in lanes.values():
        kinds = [event.type for event in lane_events]
        # FIFO: the lane's second response starts after its first one's end.
        first_end = kinds.index("response.incomplete")
        assert kinds[first_end + 1] == "response.created"
        assert kinds.count("response.created") == 2
        ids = [e.response.id for e in lane_events if e.type == "response.created"]
        assert len(set(ids)) == 2
    # Concurrent: the lanes' deltas are interleaved on the one socket.
    order = [event.stream_id for event in events if event.type == "response.output_text.delta"]
    switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
    assert switches > 10
    final = [event for event in events if event.type == "response.incomplete"]
    assert all(e.response.incomplete_details.reason == "max_output_tokens" for e in final)


async def test_async_sdk_continues_a_chain_by_previous_response_id(gateway: Gateway) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.base}/v1", api_key=KEY, max_retries=0
    ) as client:
        async with client.responses.connect() as conn:
            await conn.response.create(
                model=MODEL, input="Tell me.", max_output_tokens=16, stream_id="chat"
            )
            first = [event async for event in _until(conn, 1)][-1].response
            await conn.response.create(
                model=MODEL,
                input="And then?",
                max_output_tokens=16,
                previous_response_id=first.id,
                stream_id="chat",
            )
            second = [event async for event in _until(conn, 1)][-1].response
        assert second.previous_response_id == first.id
        # The scripted prompt: a token per message role plus one per word, so the history counts.
        assert first.usage is not None
        assert second.usage is not None
        assert second.usage.input_tokens == first.usage.input_tokens + 1 + 16 + 1 + 2
        kept = await client.responses.retrieve(second.id)
        assert kept.output_text == expected(16)
        items = await client.responses.input_items.list(second.id, order="asc")
        assert [item.type for item in items.data] == ["message", "message", "message"]


async def _until(conn: Any, count: int) -> Any:
    ended = 0
    async for event in conn:
        yield event
        if event.type in {"response.completed", "response.incomplete", "response.failed", "error"}:
            ended += 1
            if ended == count:
                return


# --- errors --------------------------------------------------------------------------------------


def test_error_events_carry_their_status_and_lane(client: openai.OpenAI) -> None:
    with client.responses.connect() as conn:
        conn.response.create(model="no-such-model", input="x", stream_id="e1")
        conn.response.create(model=MODEL, input="x", max_output_tokens=5, stream_id="e2")
        conn.response.create(model=MODEL, input="x", background=True, stream_id="e3")
        conn.send({"type": "response.cancel"})  # type: ignore[arg-type]  # not an event
        conn.response.create(model=MODEL, input="still here", max_output_tokens=16)
        events = until_ends(conn, 5)
    errors = {event.stream_id: event for event in events if event.type == "error"}
    assert errors["e1"].status == 404
    assert errors["e1"].error.code == "model_not_found"
    assert errors["e1"].error.type == "invalid_request_error"
    assert errors["e2"].status == 400
    assert errors["e2"].error.param == "max_output_tokens"
    assert errors["e3"].status == 400
    assert errors["e3"].error.param == "background"
    assert errors[None].error.code == "unknown_message_type"
    assert errors[None].sequence_number is None
    assert text_of([e for e in events if getattr(e, "stream_id", "x") is None])[-1] == expected(16)


async def test_the_stream_limit(gateway: Gateway) -> None:
    async with raw(gateway, additional_headers=AUTH) as ws:
        for _ in range(64):  # the first runs, 63 wait in the lane
            await send(ws, create("q", max_output_tokens=2000))
        await send(ws, create("over"))
        event = await recv(ws)
        while event.get("stream_id") != "over":
            event = await recv(ws)
        assert event == {
            "type": "error",
            "status": 400,
            "stream_id": "over",
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_stream_limit_reached",
                "message": "This WebSocket connection has reached its stream limit (64 "
                "responses running or waiting in their lanes).",
                "param": "stream_id",
            },
        }
    # Closing the socket cancels its response on the runner; the 63 waiting never ran.
    wait_until(lambda: active(gateway) == 0, 10, "the runner to be free")


async def test_runner_faults_end_only_their_own_lane(gateway: Gateway) -> None:
    """A scripted fake runner: an error before the first chunk is the create's `error` event
    (with the status the HTTP API gives and sequence number 0), one after it
    `response.failed`; the lane beside it on the same socket is untouched."""
    fake = await FakeRunner.connect(gateway)
    try:
        async with raw(gateway, additional_headers=AUTH) as ws:
            await send(ws, create("beside", max_output_tokens=40))
            await send(ws, create("early", model="fake-model"))
            gen = await fake.next_request()
            assert isinstance(gen, Generate)
            await fake.send(Error(gen.request_id, "context_length_exceeded", "too long", "input"))
            await send(ws, create("late", model="fake-model"))
            gen = await fake.next_request()
            assert isinstance(gen, Generate)
            await fake.send(Chunk(gen.request_id, 0, "Par", "", 1, Usage(3, 1)))
            await fake.send(Error(gen.request_id, "internal_error", "boom"))
            events = await recv_until_ends(ws, 3)
    finally:
        await fake.close()
    lanes: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        lanes.setdefault(event["stream_id"], []).append(event)
    (early,) = lanes["early"]
    assert early == {
        "type": "error",
        "status": 400,
        "sequence_number": 0,
        "stream_id": "early",
        "error": {
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
            "message": "too long",
            "param": "input",
        },
    }
    late = lanes["late"]
    assert late[-1]["type"] == "response.failed"
    assert late[-1]["response"]["error"]["code"] == "server_error"
    assert [e["sequence_number"] for e in late] == list(range(len(late)))
    beside = lanes["beside"]
    assert beside[-1]["type"] == "response.incomplete"
    assert beside[-1]["response"]["output"][0]["content"][0]["text"] == expected(40)


# --- steering ---------------------------------------------------------------------------------


def test_a_steer_stops_the_response_and_its_successor_continues(client: openai.OpenAI) -> None:
    with client.responses.connect() as conn:
        conn.response.create(
            model=MODEL, input="Write a lot.", max_output_tokens=500, stream_id="s"
        )
        seen: list[Any] = []
        for event in conn:
            seen.append(event)
            if sum(e.type == "response.output_text.delta" for e in seen) == 3:
                break
        target = seen[0].response.id
        conn.response.steer(input="Now stop and summarise.", previous_response_id=target)
        seen += until_ends(conn, 2)
    kinds = [event.type for event in seen]
    accepted = seen[kinds.index("response.steer.accepted")]
    assert accepted.steer.previous_response_id == target
    assert accepted.stream_id == "s"
    steered = seen[kinds.index("response.incomplete")].response
    assert steered.id == target
    assert steered.incomplete_details.reason == "steered"
    successor = seen[kinds.index("response.created", kinds.index("response.incomplete"))]
    assert successor.stream_id == "s"
    assert successor.response.previous_response_id == target
    assert kinds[-1] == "response.incomplete"  # its own max_output_tokens
    assert seen[-1].response.max_output_tokens == 500
    items = client.responses.input_items.list(seen[-1].response.id, order="asc").data
    assert [getattr(item, "role", None) for item in items] == ["user", "assistant", "user"]
    last: Any = items[-1]
    assert last.content[0].text == "Now stop and summarise."


def test_a_steer_for_no_running_response_fails(client: openai.OpenAI) -> None:
    with client.responses.connect() as conn:
        conn.response.steer(input="x", previous_response_id="resp_nope")
        event = conn.recv()
    assert event.type == "response.steer.failed"
    assert event.error.code == "response_not_found"
    assert event.steer.previous_response_id == "resp_nope"


# --- API keys and origins, as on /v1/ws ------------------------------------------------------


def test_a_wrong_key_closes_the_socket_with_4004(gateway: Gateway) -> None:
    with (
        openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="wrong", max_retries=0) as c,
        c.responses.connect() as conn,
    ):
        conn.response.create(model=MODEL, input="x")
        with pytest.raises(ConnectionClosed) as closed:
            conn.recv()
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4004, "authenticate first")


async def test_a_browser_authenticates_with_its_first_message(gateway: Gateway) -> None:
    async with raw(gateway) as ws:
        await send(ws, {"type": "auth", "api_key": KEY})
        assert await recv(ws) == {"type": "auth.ok"}
        await send(ws, create())
        events = await recv_until_ends(ws, 1)
        assert events[-1]["type"] == "response.incomplete"
    async with raw(gateway) as ws:
        await send(ws, {"type": "auth", "api_key": "wrong"})
        with pytest.raises(ConnectionClosed) as closed:
            await recv(ws)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4004, "invalid API key")


async def test_origins_as_on_the_browser_socket(gateway: Gateway) -> None:
    async with raw(gateway, origin="http://evil.example", additional_headers=AUTH) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await recv(ws)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4011, "origin not allowed")
    own = f"http://127.0.0.1:{gateway.port}"
    async with raw(gateway, origin=own, additional_headers=AUTH) as ws:
        await send(ws, create())
        assert (await recv_until_ends(ws, 1))[-1]["type"] == "response.incomplete"


# --- reconnection as the SDK does it ---------------------------------------------------------


async def test_the_sdk_reconnects_after_1012_and_the_chain_goes_on(gateway: Gateway) -> None:
    reconnects: list[int] = []

    def on_reconnecting(event: ReconnectingEvent) -> None:
        reconnects.append(event.close_code)

    async with (
        DroppingProxy(gateway) as proxy,
        openai.AsyncOpenAI(base_url=proxy.base, api_key=KEY, max_retries=0) as client,
        client.responses.connect(
            on_reconnecting=on_reconnecting, initial_delay=0.05 * UNIT
        ) as conn,
    ):
        await conn.response.create(model=MODEL, input="One.", max_output_tokens=16)
        first = [event async for event in _until(conn, 1)][-1].response
        await conn.response.create(model=MODEL, input="Long.", max_output_tokens=2000)
        async for event in conn:
            if event.type == "response.output_text.delta":
                break
        await proxy.drop(1012)
        # The SDK sees 1012 while reading, reconnects, and reads on: a create sent now
        # goes on the new socket (queued if it is still reconnecting).
        reader = asyncio.ensure_future(_collect_after_reconnect(conn))
        await _until_true(lambda: proxy.connections == 2 and len(proxy.clients) == 1)
        await conn.response.create(
            model=MODEL, input="Two.", max_output_tokens=16, previous_response_id=first.id
        )
        events = await asyncio.wait_for(reader, 20 * UNIT)
    assert reconnects == [1012]
    second = events[-1].response
    assert second.previous_response_id == first.id
    assert second.output_text == expected(16)
    # The response cut off with the old socket was cancelled on its runner.
    wait_until(lambda: active(gateway) == 0, 10, "the dropped response to be cancelled")


async def _collect_after_reconnect(conn: Any) -> list[Any]:
    events = []
    async for event in conn:
        events.append(event)
        if event.type in {"response.completed", "response.incomplete", "error"} and (
            getattr(event, "response", None) is None or event.response.output_text == expected(16)
        ):
            return events
    return events


async def _until_true(check: Any, seconds: float = 10) -> None:
    async def checked() -> bool:
        return bool(check())

    await async_wait_until(checked, seconds, "the SDK to reconnect")


def test_the_sdk_reconnects_to_a_restarted_gateway_and_the_chain_survives(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "store.sqlite3")
    options = ("--store", store, "--drain-timeout", secs(0.5), *FAKE_RUNNERS)
    gateway: Gateway = Gateway(*options)
    runner = scripted_runner(gateway)
    reconnects: list[int] = []
    with (
        stopped(runner),
        openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0) as client,
    ):
        try:
            with client.responses.connect(
                on_reconnecting=lambda event: reconnects.append(event.close_code),
                max_retries=40,
                initial_delay=0.25,
                max_delay=0.5,
            ) as conn:
                events: queue.Queue[Any] = queue.Queue()

                def read() -> None:
                    try:
                        for event in conn:
                            events.put(event)
                    except Exception as exc:
                        events.put(exc)

                threading.Thread(target=read, daemon=True).start()
                conn.response.create(model=MODEL, input="Before.", max_output_tokens=16)
                first = until_ends(iter(events.get, None), 1)[-1].response
                gateway.stop()  # SIGTERM: the drain, then uvicorn closes its sockets: 1012
                gateway = GatewayAt(gateway.port, *options)
                gateway.wait_for_runners(1)  # the scripted runner comes back by itself
                wait_until(lambda: reconnects != [], 10, "the SDK to see the close")
                conn.response.create(
                    model=MODEL, input="After.", max_output_tokens=16, previous_response_id=first.id
                )
                second = until_ends(iter(events.get, None), 1)[-1]
        finally:
            gateway.stop()
    assert reconnects[0] == 1012
    assert second.type == "response.incomplete", second
    assert second.response.previous_response_id == first.id
    assert second.response.usage.input_tokens > first.usage.input_tokens
