"""A client that fails is its own problem: an exception while serving one request (rendering
its chunks, writing them, over SSE or the browser socket) ends that request with an error to
its client and is logged once with its request id, while every other stream on the same
runner, the same browser socket included, runs to completion on the same runner link.

The gateway runs in this process (so a fault can be injected into it) on real sockets; the
runner is a real `orchard runner` process on the scripted engine. Both are the module's, on
the module's event loop: each test injects its fault for itself and counts from what it saw
when it started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from websockets.asyncio.client import ClientConnection, connect

from gateway.config import GatewayConfig
from gateway.pool.pool import Pool
from gateway.server import make_server
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.socket import ClientSocket
from gateway.streaming.sse import SseTransport
from protocol.core.stream import CompletionStream
from protocol.frames import Generate
from tests.support import UNIT, Process, async_wait_until, free_port, sse_events

TOKENS = 30
VICTIM_TOKENS = 201
"""The victim's max_tokens: how the injected fault recognises its request. Far more than it
gets before its cancel lands (it fails at its 4th), so that the cancel shows in the count."""
RATE = 150.0
"""The scripted runner's tokens per second, in the tests' time unit."""

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Gateway:
    def __init__(self, base: str, pool: Pool) -> None:
        self.base = base
        self.port = int(base.rsplit(":", 1)[1])
        self.pool = pool


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway() -> AsyncIterator[Gateway]:
    config = GatewayConfig(port=free_port(), first_token_wait=5.0 * UNIT)
    server = make_server(config, "warning")
    task = asyncio.create_task(server.serve())
    await async_wait_until(lambda: _true(server.started), 10, "the gateway to start")
    gw = Gateway(f"http://127.0.0.1:{config.port}", server.config.app.state.pool)
    runner = Process(
        [
            "runner",
            "--gateway",
            gw.base,
            "--name",
            "the-runner",
            "--model",
            "scripted",
            "--engine",
            "scripted",
            "--tokens-per-second",
            f"{RATE / UNIT:g}",
            "--max-concurrent",
            "16",
            "--log-level",
            "warning",
        ]
    )
    try:
        await async_wait_until(lambda: _true(len(gw.pool.runners) == 1), 30, "the runner")
        yield gw
    finally:
        await asyncio.to_thread(runner.stop)
        server.should_exit = True
        await task


async def _true(value: bool) -> bool:
    return value


def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        **extra,
    }


FULL_TEXT = "".join(f"tok{i} " for i in range(TOKENS))


@pytest.fixture
def victims(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Request ids of the victims (max_tokens VICTIM_TOKENS), recorded as they are submitted."""
    ids: set[str] = set()
    real = Pool.submit

    async def submit(self: Pool, generate: Generate, dialect: str) -> RequestStream:
        if generate.max_tokens == VICTIM_TOKENS:
            ids.add(generate.request_id)
        return await real(self, generate, dialect)

    monkeypatch.setattr(Pool, "submit", submit)
    return ids


class Boom(Exception):
    pass


def inject(where: str, victims: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Make serving the victims fail at their 4th token, in one place of the relay path
    (whatever chunk it comes in: a runner that fell behind sends several tokens in one)."""

    def is_victim(data: bytes) -> bool:
        return any(rid.encode() in data for rid in victims) and b"tok3 " in data

    if where == "render":
        feed = CompletionStream.feed

        def failing_feed(self: CompletionStream, item: Any, out: list[bytes]) -> bool:
            if getattr(item, "request_id", None) in victims and "tok3" in getattr(
                item, "text", ""
            ).split(" "):
                raise Boom("rendering failed")
            return feed(self, item, out)

        monkeypatch.setattr(CompletionStream, "feed", failing_feed)
    elif where == "sse-write":
        sse_write = SseTransport.write

        def failing_sse_write(
            self: SseTransport, messages: list[bytes], last: bool
        ) -> Awaitable[None] | None:
            if any(is_victim(m) for m in messages):
                raise Boom("writing failed")
            return sse_write(self, messages, last)

        monkeypatch.setattr(SseTransport, "write", failing_sse_write)
    else:
        ws_write = ClientSocket.write

        def failing_ws_write(
            self: ClientSocket, messages: list[bytes], last: bool
        ) -> Awaitable[None] | None:
            if any(is_victim(m) for m in messages):
                raise Boom("writing failed")
            return ws_write(self, messages, last)

        monkeypatch.setattr(ClientSocket, "write", failing_ws_write)


async def sse_stream(http: httpx.AsyncClient, request: dict[str, Any]) -> list[Any]:
    resp = await http.post("/v1/chat/completions", json={**request, "stream": True})
    assert resp.status_code == 200
    return sse_events(resp.content)


async def ws_streams(ws: ClientConnection, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run several requests on one browser socket: per request id, its chunks' text and its
    last message (done or error)."""
    for rid, request in requests.items():
        await ws.send(
            orjson.dumps({"type": "chat.completions.create", "request_id": rid, "body": request}),
            text=True,
        )
    text: dict[str, str] = dict.fromkeys(requests, "")
    last: dict[str, Any] = {}
    while len(last) < len(requests):
        msg = orjson.loads(await asyncio.wait_for(ws.recv(), 20 * UNIT))
        rid = msg["request_id"]
        assert rid not in last, "nothing after a request's last message"
        if msg["type"] == "chunk":
            choices = msg["chunk"]["choices"]
            text[rid] += choices[0]["delta"].get("content", "") if choices else ""
        else:
            last[rid] = msg
    return {rid: (text[rid], last[rid]) for rid in requests}


def text_of(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content", "")
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


@pytest.mark.parametrize("where", ["render", "sse-write", "ws-write"])
async def test_a_failing_client_fails_alone(
    gateway: Gateway,
    victims: set[str],
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    inject(where, victims, monkeypatch)
    [conn] = gateway.pool.runners.values()
    generated = conn.session.tokens_generated
    ws_victim = where != "sse-write"
    sse_victim = where != "ws-write"
    async with (
        httpx.AsyncClient(base_url=gateway.base, timeout=20 * UNIT) as http,
        connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws,
    ):
        sse_requests = [body(TOKENS) for _ in range(3)]
        if sse_victim:
            sse_requests.append(body(VICTIM_TOKENS))
        ws_requests = {f"w{i}": body(TOKENS) for i in range(2)}
        if ws_victim:
            ws_requests["victim"] = body(VICTIM_TOKENS)
        sse_results, ws_results = await asyncio.gather(
            asyncio.gather(*(sse_stream(http, r) for r in sse_requests)),
            ws_streams(ws, ws_requests),
        )
        # The runner link survived: the same runner serves a request after all this.
        after = await sse_stream(http, body(TOKENS))
    assert text_of(after) == FULL_TEXT
    assert list(gateway.pool.runners.values()) == [conn]

    for events in sse_results[:3]:
        assert text_of(events) == FULL_TEXT
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1] == "[DONE]"
    for rid in ("w0", "w1"):
        text, done = ws_results[rid]
        assert text == FULL_TEXT
        assert (done["type"], done["finish_reason"]) == ("done", "length")
        assert done["usage"]["completion_tokens"] == TOKENS

    # A victim gets some of its tokens before the fault, never the 4th or any after it: how
    # many depends on how they were batched (a fault fails the whole write it is in, and
    # tokens that arrive while the relay is busy are rendered in one).
    before_the_fault = {"".join(f"tok{i} " for i in range(n)) for n in range(4)}
    server_error = {"type": "server_error", "param": None, "code": None}
    if sse_victim:
        events = sse_results[3]
        assert text_of(events) in before_the_fault
        assert {k: events[-2]["error"][k] for k in server_error} == server_error
        assert events[-1] == "[DONE]"
    if ws_victim:
        text, error = ws_results["victim"]
        assert text in before_the_fault
        assert error["type"] == "error"
        assert {k: error["error"][k] for k in server_error} == server_error

    # Logged once per failed request, with its id; the victims were cancelled on the runner.
    faults = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(faults) == len(victims) == int(sse_victim) + int(ws_victim)
    for rid in victims:
        assert sum(rid in r.getMessage() for r in faults) == 1
    await async_wait_until(lambda: _true(conn.session.in_flight == 0), 5, "the slots to free")
    # Every token of the three SSE streams, the socket's two and the one after; the victims'
    # up to their 4th at least, and far fewer than they asked for: they were cancelled.
    generated = conn.session.tokens_generated - generated
    full = (3 + 2 + 1) * TOKENS
    assert full + 4 * len(victims) <= generated < full + VICTIM_TOKENS * len(victims)
