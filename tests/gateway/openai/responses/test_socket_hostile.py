"""Hostile clients of the Responses WebSocket over real sockets: malformed events, unknown
types, hostile envelopes and bodies (hypothesis), huge frames, lanes beyond the limit, a
client that never reads. Beside each, a well-behaved response streams on a socket of its
own: it must come through whole, and the runner's link must be the one it was."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect as connect_async
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close
from websockets.sync.client import ClientConnection, connect

from protocol.frames import Chunk, Usage
from tests.e2e.faults.harness import next_cancel, next_generate, send_heartbeats
from tests.gateway.gateways import FAKE_RUNNERS
from tests.gateway.openai.responses.sockets import (
    MODEL,
    create,
    expected,
    scripted_runner,
    stopped,
    until_ends,
    ws_url,
)
from tests.protocol.strategies import hostile_bytes, json_values
from tests.support import UNIT, FakeRunner, Gateway, wait_until

SETTINGS = settings(
    max_examples=int(os.environ.get("ORCHARD_FUZZ_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
FLOOD = "flood-model"
"""The model of a fake runner that floods its response's client."""
HONEST_TOKENS = 400
"""The well-behaved response's length: 4 s at the paced runner's 100 tok/s."""


@pytest.fixture(scope="module")
def stack() -> Iterator[Gateway]:
    gateway = Gateway(*FAKE_RUNNERS)
    paced = scripted_runner(gateway)
    wait_until(lambda: len(gateway.runners()) == 1, 60, "the runner")
    with stopped(paced, gateway):
        yield gateway


@pytest.fixture(scope="module")
def gateway(stack: Gateway) -> Gateway:
    return stack


def runners(gateway: Gateway) -> dict[str, dict[str, Any]]:
    return {runner["name"]: runner for runner in gateway.runners()}


def sync_socket(gateway: Gateway, **options: Any) -> ClientConnection:
    ws: ClientConnection = connect(ws_url(gateway), max_size=None, ping_interval=None, **options)
    return ws


def events_of(ws: ClientConnection) -> Iterator[dict[str, Any]]:
    while True:
        yield orjson.loads(ws.recv(timeout=20 * UNIT))


@contextlib.contextmanager
def honest_lane_beside(gateway: Gateway, tokens: int = HONEST_TOKENS) -> Iterator[None]:
    """A well-behaved response streams on its own socket while the block runs (it is still
    streaming when the block ends); then it comes through whole, on the same runner link."""
    before = runners(gateway)
    got: dict[str, Any] = {}

    def run() -> None:
        with sync_socket(gateway) as ws:
            ws.send(orjson.dumps(create("honest", max_output_tokens=tokens)).decode())
            got["events"] = until_ends(events_of(ws), 1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: runners(gateway)["test-runner"]["active"] >= 1, 10, "the honest lane")
    yield
    assert thread.is_alive(), "the honest response ended before the hostile input did"
    thread.join(30 * UNIT)
    events = got["events"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == expected(tokens)
    assert events[-1]["type"] == "response.incomplete"
    assert {e["stream_id"] for e in events} == {"honest"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    after = runners(gateway)
    for name, runner in before.items():
        assert after[name]["id"] == runner["id"], f"runner {name}'s link was replaced"


MARKER = create("marker", model="no-such-model")
"""Answered by its 404 error event once everything sent before it was read."""


def until_marker(ws: ClientConnection) -> list[dict[str, Any]]:
    """The events up to the marker's (which is not included)."""
    ws.send(orjson.dumps(MARKER).decode())
    got: list[dict[str, Any]] = []
    for event in events_of(ws):
        if event.get("stream_id") == "marker":
            assert event["status"] == 404
            return got
        got.append(event)
    raise AssertionError("unreachable")


hostile_events = st.one_of(
    hostile_bytes(),
    json_values.map(orjson.dumps),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["response.create", "response.steer", "auth", "response.x"])},
        optional={
            "stream_id": json_values | st.text(max_size=300),
            "model": json_values | st.sampled_from(["no-such-model", ""]),
            "input": json_values,
            "previous_response_id": json_values,
            "background": json_values,
            "stream": json_values,
            "max_output_tokens": json_values,
        },
    ).map(orjson.dumps),
)


def test_malformed_and_hostile_events_are_answered_and_nothing_else_moves(
    gateway: Gateway,
) -> None:
    with honest_lane_beside(gateway), sync_socket(gateway) as ws:

        @SETTINGS
        @given(st.lists(hostile_events, min_size=1, max_size=6))
        def each(messages: list[bytes]) -> None:
            for message in messages:
                ws.send(message.decode(errors="replace"))
            for event in until_marker(ws):
                assert event["type"] in ("error", "response.steer.failed"), event
                if event["type"] == "error":
                    assert 400 <= event["status"] < 500, event
                    assert set(event["error"]) >= {"type", "code", "message", "param"}

        each()
        # The socket still serves a real response.
        ws.send(orjson.dumps(create("after", max_output_tokens=16)).decode())
        events = until_ends(events_of(ws), 1)
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == expected(16)


def test_unknown_types_and_bad_envelopes_get_exact_errors(gateway: Gateway) -> None:
    with honest_lane_beside(gateway), sync_socket(gateway) as ws:
        ws.send('{"type": "response.cancel", "response_id": "resp_1"}')
        ws.send("not json")
        ws.send(orjson.dumps(create("bad lane!")).decode())
        got = until_marker(ws)
    assert [(e["error"]["code"], e["status"], "stream_id" in e) for e in got] == [
        ("unknown_message_type", 400, False),
        ("invalid_json", 400, False),
        ("invalid_value", 400, False),
    ]


def test_huge_frames(gateway: Gateway) -> None:
    with honest_lane_beside(gateway):
        with sync_socket(gateway) as ws:
            big = orjson.dumps(create(input="x" * (1 << 20)))
            ws.send(big.decode())
            (event,) = until_marker(ws)
            assert event == {
                "type": "error",
                "status": 400,
                "error": {
                    "type": "invalid_request_error",
                    "code": "message_too_large",
                    "message": f"Message of {len(big)} bytes is over the 1048576-byte limit.",
                    "param": None,
                },
            }
        # Past the server's WebSocket limit (4 MiB, its runner frames'), it closes with 1009.
        with sync_socket(gateway) as ws:
            closed = read_until_closed(ws, "x" * (5 << 20))
        # Its close frame may cross the rest of the message on the wire: then the client
        # sees the connection reset, without the code.
        assert closed is None or closed.code == 1009


def test_lanes_beyond_the_limit(gateway: Gateway) -> None:
    with honest_lane_beside(gateway), sync_socket(gateway) as ws:
        for lane in range(70):  # 64 in flight, one per lane (most wait for a slot); 6 refused
            ws.send(orjson.dumps(create(f"l{lane}", max_output_tokens=16)).decode())
        events = until_ends(events_of(ws), 70)
    refused = [e for e in events if e["type"] == "error"]
    assert [e["stream_id"] for e in refused] == [f"l{lane}" for lane in range(64, 70)]
    assert {e["error"]["code"] for e in refused} == {"websocket_stream_limit_reached"}
    done = [e for e in events if e["type"] == "response.incomplete"]
    assert len(done) == 64
    assert all(e["response"]["output"][0]["content"][0]["text"] == expected(16) for e in done)


async def test_a_client_that_never_reads_is_closed(gateway: Gateway) -> None:
    """A client that stops reading while its response floods in: once its backlog passes
    4 MiB the gateway cancels the response on its runner and closes the socket 4010. The
    flood is a fake runner's 64 KiB chunks, so how soon does not hang on generation speed."""
    with honest_lane_beside(gateway, tokens=1000):
        fake = await FakeRunner.connect(gateway, models=(FLOOD,), name="flood")
        heartbeats = asyncio.create_task(send_heartbeats(fake))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gateway.port))
        # max_queue 1: the client library reads the socket only as fast as the test takes
        # messages, one every 20 ms.
        async with connect_async(ws_url(gateway), sock=sock, max_size=None, max_queue=1) as ws:
            await ws.send(orjson.dumps(create("flood", model=FLOOD)).decode())
            rid = (await next_generate(fake)).request_id

            async def slow_reader() -> Close | None:
                try:
                    while True:
                        await ws.recv()
                        await asyncio.sleep(0.02)
                except ConnectionClosed as closed:
                    return closed.rcvd

            reader = asyncio.create_task(slow_reader())
            started = time.monotonic()
            sent = 0
            text = "x" * 65536
            cancel = asyncio.create_task(next_cancel(fake, 5))
            while not cancel.done():
                await fake.send(Chunk(rid, sent, text, "", 1, Usage(3, sent + 1), None))
                sent += 1
                await asyncio.sleep(0.001)
            took = time.monotonic() - started
            assert await cancel == rid
            assert sent * 65536 > 4 << 20
            assert took < 3 * UNIT, f"cancelled after {took:.1f} s, {sent} chunks"
            await fake.send(Chunk(rid, sent, "", "", 0, Usage(3, sent), "cancelled"))
            closed = await asyncio.wait_for(reader, 10 * UNIT)
        heartbeats.cancel()
        await fake.close()
        assert closed is not None
        assert (closed.code, closed.reason) == (4010, "client too slow")
    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.get(f"{gateway.base}/health")).status_code == 200
    wait_until(lambda: "flood" not in runners(gateway), 10, "the fake runner to leave")


def read_until_closed(ws: ClientConnection, first: str | None = None) -> Close | None:
    """Send `first` if given, then read until the gateway closes: its close frame (None: the
    connection ended without one)."""
    try:
        if first is not None:
            ws.send(first)  # the gateway may close while it is being sent
        while True:
            ws.recv(timeout=10 * UNIT)
    except ConnectionClosed as exc:
        return exc.rcvd


def test_the_paced_runner_is_the_honest_ones(gateway: Gateway) -> None:
    """(The fixture's runner, by name: the honest lane runs on the paced one.)"""
    assert set(runners(gateway)) == {"test-runner"}
    assert MODEL in {m["id"] for m in runners(gateway)["test-runner"]["models"]}
