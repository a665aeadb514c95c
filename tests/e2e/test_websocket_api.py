"""The browser WebSocket API (`/v1/ws`) over real sockets, against a gateway and a real
mlx-lm runner on the built-in model."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.support import UNIT, Gateway, Process, async_wait_until

MODEL = "orchard-demo"
EOS_OFF = {"2": -100}  # the demo model's <|im_end|>: only max_tokens or a cancel ends it


@pytest.fixture(scope="module")
def gateway(stack: tuple[Gateway, Process]) -> Gateway:
    return stack[0]


@pytest.fixture
async def ws(gateway: Gateway) -> AsyncIterator[ClientConnection]:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws", max_size=None) as sock:
        yield sock


async def send(ws: ClientConnection, obj: Any) -> None:
    await ws.send(orjson.dumps(obj), text=True)


async def recv(ws: ClientConnection) -> dict[str, Any]:
    msg: dict[str, Any] = orjson.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT))
    return msg


def create(rid: str, content: str, **params: Any) -> dict[str, Any]:
    return {
        "type": "chat.completions.create",
        "request_id": rid,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], **params},
    }


async def runner_info(gateway: Gateway) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        data: list[dict[str, Any]] = (await http.get(f"{gateway.base}/v1/runners")).json()["data"]
    return data[0]


async def runner_active(gateway: Gateway) -> int:
    return int((await runner_info(gateway))["active"])


async def test_concurrent_requests_interleave_each_with_own_done(
    ws: ClientConnection, gateway: Gateway
) -> None:
    # Reference: each prompt alone over SSE at temperature 0.
    prompts = {f"r{i}": f"Interleaved story {i} about plums." for i in range(4)}
    expected: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=60 * UNIT) as http:
        for rid, content in prompts.items():
            resp = await http.post(
                f"{gateway.base}/v1/chat/completions",
                json={**create(rid, content, max_tokens=20, temperature=0)["body"]},
            )
            expected[rid] = resp.json()

    for rid, content in prompts.items():
        await send(ws, create(rid, content, max_tokens=20, temperature=0))
    chunks: dict[str, list[dict[str, Any]]] = defaultdict(list)
    done: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    while len(done) < len(prompts):
        msg = await recv(ws)
        assert msg["type"] in ("chunk", "done"), msg
        rid = msg["request_id"]
        assert rid not in done, "nothing may follow a request's done"
        if msg["type"] == "chunk":
            chunks[rid].append(msg["chunk"])
            order.append(rid)
        else:
            assert set(msg) == {"type", "request_id", "finish_reason", "usage"}
            done[rid] = msg
    # The requests really were interleaved on the one socket.
    assert len({tuple(order[i : i + 2]) for i in range(len(order) - 1)}) > len(prompts)
    for rid in prompts:
        stream = chunks[rid]
        first = stream[0]
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"] == {
            "role": "assistant",
            "content": "",
            "refusal": None,
        }
        assert all(c["id"] == first["id"] for c in stream)
        assert all("usage" not in c for c in stream)  # include_usage not asked
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in stream)
        (choice,) = expected[rid]["choices"]
        assert text == choice["message"]["content"]
        assert stream[-1]["choices"][0]["finish_reason"] == done[rid]["finish_reason"]
        assert done[rid]["finish_reason"] == choice["finish_reason"]
        # The usage of the same request over HTTP (but for what the prefix cache held: each
        # of those requests took the entry the one before it left).
        usage, alone = done[rid]["usage"], expected[rid]["usage"]
        assert set(usage) == set(alone)
        assert set(usage["prompt_tokens_details"]) == {"cached_tokens", "audio_tokens"}
        for key in set(alone) - {"prompt_tokens_details"}:
            assert usage[key] == alone[key], key


async def test_include_usage_chunk_and_done(ws: ClientConnection) -> None:
    await send(
        ws,
        create("u1", "usage please", max_tokens=5, stream_options={"include_usage": True}),
    )
    msgs = [await recv(ws)]
    while msgs[-1]["type"] != "done":
        msgs.append(await recv(ws))
    usage_chunk = msgs[-2]["chunk"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == msgs[-1]["usage"]
    assert all(m["chunk"]["usage"] is None for m in msgs[:-2])


async def test_cancel_mid_stream(ws: ClientConnection, gateway: Gateway) -> None:
    await send(ws, create("long", "go on and on", max_tokens=1500, logit_bias=EOS_OFF))
    seen = 0
    while seen < 5:
        msg = await recv(ws)
        assert msg["type"] == "chunk"
        seen += 1
    await send(ws, {"type": "cancel", "request_id": "long"})
    chunks = []
    while (msg := await recv(ws))["type"] == "chunk":
        chunks.append(msg["chunk"])
        seen += 1
    assert msg["type"] == "done"
    assert msg["finish_reason"] == "cancelled"
    # A cancelled stream still ends like an OpenAI stream: a finish chunk ("stop": OpenAI
    # has no "cancelled"), as over SSE; the done says what really happened.
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    generated = msg["usage"]["completion_tokens"]
    assert 4 <= generated < 1500
    # Every streamed token is counted (the role and finish chunks carry none).
    assert generated >= seen - 2
    await async_wait_until(lambda: _is(runner_active(gateway), 0), 2, "the slot to free")


async def _is(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def test_closing_socket_cancels_its_requests(gateway: Gateway) -> None:
    sock = await connect(f"ws://127.0.0.1:{gateway.port}/v1/ws")
    await send(sock, create("a", "first long one", max_tokens=1500, logit_bias=EOS_OFF))
    await send(sock, create("b", "second long one", max_tokens=1500, logit_bias=EOS_OFF))
    got: set[str] = set()
    while got != {"a", "b"}:
        got.add((await recv(sock))["request_id"])
    assert await runner_active(gateway) == 2
    before = await runner_info(gateway)
    # Drop the connection the way a closed tab or a lost network does: no close handshake
    # (a polite close would wait for every queued chunk, by which time both would be done).
    sock.transport.abort()
    await async_wait_until(lambda: _is(runner_active(gateway), 0), 2, "both to be cancelled")
    info = await runner_info(gateway)
    # Stopped far short of the 2 x 1500 asked, within a few decode steps of the cancel.
    assert info["tokens_generated"] - before["tokens_generated"] < 1500
    assert info["tokens_after_cancel"] - before["tokens_after_cancel"] <= 2 * 4


async def test_duplicate_request_id_is_refused(ws: ClientConnection) -> None:
    await send(ws, create("dup", "one", max_tokens=200, logit_bias=EOS_OFF))
    await send(ws, create("dup", "two", max_tokens=5))
    errors, done = [], None
    while done is None:
        msg = await recv(ws)
        if msg["type"] == "error":
            errors.append(msg)
        elif msg["type"] == "done":
            done = msg
    assert errors == [
        {
            "type": "error",
            "request_id": None,
            "error": {
                "message": "request_id 'dup' is already in flight on this socket.",
                "type": "invalid_request_error",
                "param": "request_id",
                "code": "duplicate_request_id",
            },
        }
    ]
    assert done["request_id"] == "dup"
    assert done["usage"]["completion_tokens"] == 200  # the first one ran to its end


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"{nope", "invalid_json", None),
        (b"[1, 2]", "invalid_message", "type"),
        (b'{"type": 7}', "invalid_message", "type"),
        (b'{"type": "teleport"}', "unknown_message_type", "type"),
        (b'{"type": "chat.completions.create", "body": {}}', "invalid_request_id", "request_id"),
        (b'{"type": "cancel", "request_id": ""}', "invalid_request_id", "request_id"),
    ],
)
async def test_malformed_messages_get_null_request_errors(
    ws: ClientConnection, raw: bytes, code: str, param: str | None
) -> None:
    await ws.send(raw, text=True)
    msg = await recv(ws)
    assert msg["type"] == "error"
    assert msg["request_id"] is None
    assert msg["error"]["code"] == code
    assert msg["error"]["param"] == param
    assert msg["error"]["type"] == "invalid_request_error"
    # The socket is still good.
    await send(ws, {"type": "ping"})
    assert await recv(ws) == {"type": "pong"}


async def test_oversized_message_is_an_error_not_a_close(ws: ClientConnection) -> None:
    await send(ws, create("big", "x" * (1024 * 1024 + 10)))
    msg = await recv(ws)
    assert msg["type"] == "error"
    assert msg["request_id"] is None
    assert msg["error"]["code"] == "message_too_large"
    await send(ws, {"type": "ping"})
    assert await recv(ws) == {"type": "pong"}


async def test_per_request_errors_leave_others_running(ws: ClientConnection) -> None:
    await send(ws, create("ok", "a fine request", max_tokens=30, logit_bias=EOS_OFF))
    bad_model = create("m", "hi")
    bad_model["body"]["model"] = "no-such-model"
    await send(ws, bad_model)
    await send(ws, create("t", "hi", temperature=9))
    await send(ws, create("s", "hi", stream=False))
    errors: dict[str, dict[str, Any]] = {}
    done = None
    while done is None:
        msg = await recv(ws)
        if msg["type"] == "error":
            errors[msg["request_id"]] = msg["error"]
        elif msg["type"] == "done":
            done = msg
    assert errors["m"]["code"] == "model_not_found"
    assert errors["t"]["param"] == "temperature"
    assert errors["s"]["param"] == "stream"
    assert done["request_id"] == "ok"
    assert done["usage"]["completion_tokens"] == 30


async def test_too_many_in_flight(gateway: Gateway) -> None:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as sock:
        for i in range(65):
            await send(sock, create(f"q{i}", "hi", max_tokens=1))
        errors: list[dict[str, Any]] = []
        done = 0
        while done + len(errors) < 65:
            msg = await recv(sock)
            if msg["type"] == "error":
                errors.append(msg)
            elif msg["type"] == "done":
                done += 1
        assert [e["request_id"] for e in errors] == ["q64"]
        assert errors[0]["error"]["code"] == "too_many_requests"


async def test_pool_subscription(ws: ClientConnection) -> None:
    await send(ws, {"type": "pool.subscribe"})
    state = await recv(ws)
    assert state["type"] == "pool.state"
    assert state["models"] == [MODEL]
    assert state["queue_depth"] == 0
    assert state["requests_in_flight"] == 0  # the tests before left nothing running
    (runner,) = state["runners"]
    assert runner["name"] == "test-runner"
    assert runner["max_concurrent"] == 8
    assert isinstance(runner["tokens_per_second"], float)
    second = await recv(ws)  # pushed again without asking
    assert second["type"] == "pool.state"
