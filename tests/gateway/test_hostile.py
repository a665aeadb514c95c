"""Hostile input over real sockets: nothing a runner or client sends crashes the gateway or
touches another stream. Hypothesis generates the input; a well-behaved stream is in flight
beside it (its runner holds the rest of the answer until the hostile input has been dealt
with)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from protocol.closecodes import CloseCode
from protocol.codec import decode_gateway_frame, encode
from protocol.frames import PROTOCOL_VERSION, Chunk, Generate, Heartbeat, Hello, ModelInfo, Usage
from tests.protocol.strategies import hostile_bytes, json_values, runner_frames
from tests.support import HARDWARE, UNIT, Gateway, secs

SETTINGS = settings(
    max_examples=int(os.environ.get("ORCHARD_FUZZ_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway("--handshake-timeout", secs(2))
    yield gw
    gw.stop()


class HonestRunner:
    """A protocol-correct runner on its own thread: answers every request with "a b c", each
    word a chunk. A request whose last message `hold` named stops after its first chunk
    until released."""

    def __init__(self, gateway: Gateway) -> None:
        # legacy=True: connected now, not in a `with`. No keepalive pings: websockets' sync
        # ping thread draws from the global `random`, which hypothesis reports as flaky when
        # it happens during a draw (it did, once, in CI).
        self.ws = connect(
            f"ws://127.0.0.1:{gateway.port}/v1/runner/ws", legacy=True, ping_interval=None
        )
        hello = Hello(PROTOCOL_VERSION, "honest", (ModelInfo("honest-model", 4096),), 8, HARDWARE)
        self.ws.send(encode(hello).decode())
        decode_gateway_frame(self.ws.recv())
        self._held: dict[str, tuple[threading.Event, threading.Event]] = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def hold(self, text: str) -> tuple[threading.Event, threading.Event]:
        """For the request whose last message is `text`: an event set once its first chunk is
        sent, and one that lets the rest go."""
        events = threading.Event(), threading.Event()
        self._held[text] = events
        return events

    def _serve(self) -> None:
        try:
            for data in self.ws:
                frame = decode_gateway_frame(data)
                if isinstance(frame, Heartbeat):  # answer the gateway's: stay alive
                    self.ws.send(encode(Heartbeat(frame.sent_at)).decode())
                if isinstance(frame, Generate):
                    threading.Thread(target=self._answer, args=(frame,), daemon=True).start()
        except ConnectionClosed:
            pass

    def _answer(self, frame: Generate) -> None:
        held = self._held.pop(frame.messages[-1].content, None) if frame.messages else None
        try:
            for seq, word in enumerate(["a ", "b ", "c"]):
                final = seq == 2
                chunk = Chunk(
                    frame.request_id, seq, word, "", 1, Usage(3, seq + 1), "stop" if final else None
                )
                self.ws.send(encode(chunk).decode())
                if seq == 0 and held is not None:
                    started, release = held
                    started.set()
                    release.wait(10 * UNIT)
        except ConnectionClosed:
            pass

    def close(self) -> None:
        self.ws.close()


@pytest.fixture(scope="module")
def honest(gateway: Gateway) -> Iterator[HonestRunner]:
    runner = HonestRunner(gateway)
    yield runner
    runner.close()


_honest_requests = itertools.count()


@contextlib.contextmanager
def honest_stream_beside(gateway: Gateway, honest: HonestRunner) -> Iterator[None]:
    """An honest request is in flight (its first chunk sent, the rest held back) while the
    block sends hostile input; then it must come through whole."""
    text = f"honest request {next(_honest_requests)}"
    started, release = honest.hold(text)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(honest_request_works, gateway, text)
        try:
            assert started.wait(10 * UNIT), "the honest request never reached its runner"
            yield
        finally:
            release.set()
        answer.result()


def honest_request_works(gateway: Gateway, text: str = "hi") -> None:
    resp = httpx.post(
        f"{gateway.base}/v1/chat/completions",
        json={"model": "honest-model", "messages": [{"role": "user", "content": text}]},
        timeout=10 * UNIT,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "a b c"


END = "the end of the rogue's input"
"""Not JSON: whatever the session's state, the gateway closes it on this one."""


def rogue_session(
    gateway: Gateway, payloads: Sequence[bytes | str], hello_first: bool
) -> ConnectionClosed:
    """Send payloads as a runner, then `END`; the gateway may only answer with frames, then a
    4xxx close (for a payload or for `END`), which is returned."""
    closed = _rogue_session(gateway, payloads, hello_first)
    assert closed.rcvd is not None
    assert 4000 <= closed.rcvd.code <= 4999, closed.rcvd
    assert closed.rcvd.reason
    return closed


def _rogue_session(
    gateway: Gateway, payloads: Sequence[bytes | str], hello_first: bool
) -> ConnectionClosed:
    with connect(
        f"ws://127.0.0.1:{gateway.port}/v1/runner/ws", open_timeout=5 * UNIT, ping_interval=None
    ) as ws:
        try:
            if hello_first:
                hello = Hello(
                    PROTOCOL_VERSION, "rogue", (ModelInfo("rogue-model", 64),), 1, HARDWARE
                )
                ws.send(encode(hello).decode())
            for payload in payloads:
                ws.send(payload if isinstance(payload, str) else payload.decode(errors="replace"))
            ws.send('{"type": "heartbeat", "sent_at": 1}')
            ws.send(END)
            while True:
                decode_gateway_frame(ws.recv(timeout=10 * UNIT))
        except ConnectionClosed as closed:
            return closed


@SETTINGS
@given(
    payloads=st.lists(
        st.one_of(hostile_bytes(), runner_frames.map(encode), json_values.map(orjson.dumps)),
        min_size=1,
        max_size=4,
    ),
    hello_first=st.booleans(),
)
def test_rogue_runner_frames(
    gateway: Gateway, honest: HonestRunner, payloads: list[bytes], hello_first: bool
) -> None:
    with honest_stream_beside(gateway, honest):
        rogue_session(gateway, payloads, hello_first)


def test_rogue_runner_writing_into_an_honest_request(
    gateway: Gateway, honest: HonestRunner
) -> None:
    # A rogue guessing request ids: every chunk for a request it was not given closes it.
    with honest_stream_beside(gateway, honest):
        for rid in ["chatcmpl-0", "", "x" * 1000]:
            closed = rogue_session(
                gateway, [encode(Chunk(rid, 0, "injected", "", 1, Usage(1, 1)))], hello_first=True
            )
            assert closed.rcvd is not None
            assert closed.rcvd.code == CloseCode.ILLEGAL_STATE
            assert closed.rcvd.reason.startswith(f"chunk for request {rid!r}"[:100])
    honest_request_works(gateway)


@SETTINGS
@given(body=json_values | st.binary(max_size=300))
def test_hostile_http_bodies_get_4xx(gateway: Gateway, honest: HonestRunner, body: Any) -> None:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    with honest_stream_beside(gateway, honest):
        resp = httpx.post(
            f"{gateway.base}/v1/chat/completions",
            content=content,
            headers={"content-type": "application/json"},
            timeout=10 * UNIT,
        )
    assert 400 <= resp.status_code < 500, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["honest-model", "no-such-model"]), "messages": json_values},
    optional={
        "temperature": json_values,
        "max_tokens": json_values,
        "stream": json_values,
        "stop": json_values,
        "stream_options": json_values,
    },
)


@SETTINGS
@given(body=chat_bodies)
def test_hostile_chat_fields_never_5xx(gateway: Gateway, honest: HonestRunner, body: Any) -> None:
    with honest_stream_beside(gateway, honest):
        resp = httpx.post(f"{gateway.base}/v1/chat/completions", json=body, timeout=10 * UNIT)
    assert resp.status_code < 500, resp.text


@pytest.fixture(scope="module")
def client_ws(gateway: Gateway) -> Iterator[ClientConnection]:
    # No keepalive pings, as for the honest runner.
    with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws", max_size=None, ping_interval=None) as ws:
        yield ws


@SETTINGS
@given(
    message=json_values
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["chat.completions.create", "cancel", "ping"])},
        optional={"request_id": json_values, "body": json_values | chat_bodies},
    )
)
def test_hostile_client_messages(
    gateway: Gateway, honest: HonestRunner, client_ws: ClientConnection, message: Any
) -> None:
    with honest_stream_beside(gateway, honest):
        client_ws.send(orjson.dumps(message).decode())
        # Whatever came back, the socket still works and answers a ping.
        client_ws.send('{"type": "ping"}')
        while True:
            reply = orjson.loads(client_ws.recv(timeout=10 * UNIT))
            assert reply["type"] in ("error", "chunk", "done", "pong"), reply
            if reply["type"] == "error":
                assert 400 <= _status_of(reply["error"]) < 500
            if reply["type"] == "pong":
                break


def _status_of(error: dict[str, Any]) -> int:
    return {"rate_limit_error": 429, "invalid_request_error": 400}.get(error["type"], 500)
