"""SSE and the browser socket are one stream in two framings: the same request, answered by
the same runner frames, gives the same sequence of chat.completion.chunk objects (ids and
`created` aside), usage included, however it ends: stop, length, cancel, a runner error, a
timeout before or after the first token, the runner lost mid-stream. A protocol-level fake
runner plays the frames; a real runner at temperature 0 checks the same on the real path
(there with the deltas joined: where a model's tokens split into chunks depends on timing)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect

from protocol.frames import Cancel, Chunk, Error, FinishReason, Generate, Usage
from tests.support import (
    UNIT,
    FakeRunner,
    Gateway,
    Process,
    Stacks,
    secs,
    sse_events,
)

STREAM_TIMEOUT = 1.0
FIRST_TOKEN_WAIT = 0.3
"""The gateway's stream timeout and first-token wait, in the time unit (`secs`)."""

# What the fake runner does, step by step, once it has the request.
Step = (
    tuple[Literal["chunk"], str, str, FinishReason | None]
    | tuple[Literal["error"], str]
    | tuple[Literal["await_cancel"]]
    | tuple[Literal["close"]]
    | tuple[Literal["silence"]]
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway(
        "--stream-timeout",
        secs(STREAM_TIMEOUT),
        "--first-token-wait",
        secs(FIRST_TOKEN_WAIT),
        "--keepalive-interval",
        secs(0.2),
    )
    yield gw
    gw.stop()


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}


async def play(runner: FakeRunner, steps: list[Step]) -> None:
    """Answer the next request with `steps` (usage: prompt 9, cached 4; a token per chunk)."""
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    rid, seq = gen.request_id, 0
    for step in steps:
        match step:
            case ("chunk", text, reasoning, finish):
                usage = Usage(9, seq + 1, 4, seq + 1 if reasoning else 0)
                await runner.send(Chunk(rid, seq, text, reasoning, 1, usage, finish))
                seq += 1
            case ("error", code):
                await runner.send(Error(rid, code, f"runner says {code}"))  # type: ignore[arg-type]
            case ("await_cancel",):
                cancel = await runner.next_request()
                assert cancel == Cancel(rid)
            case ("close",):
                await runner.close()
            case ("silence",):
                # Nothing more until the gateway gives up on the stream and cancels it.
                cancel = await runner.next_request()
                assert cancel == Cancel(rid)


async def over_sse(gateway: Gateway, request: dict[str, Any], steps: list[Step]) -> list[Any]:
    """What an SSE client sees: the events' objects (an HTTP error's body as one object)."""
    runner = await FakeRunner.connect(gateway)
    try:
        player = asyncio.create_task(play(runner, steps))
        async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http:
            resp = await http.post("/v1/chat/completions", json={**request, "stream": True})
        await asyncio.wait_for(player, 10 * UNIT)
    finally:
        await runner.close()
    if resp.status_code != 200:
        return [resp.json()]
    events = sse_events(resp.content)
    assert events[-1] == "[DONE]"
    return list(events[:-1])


async def over_ws(
    gateway: Gateway, request: dict[str, Any], steps: list[Step], *, cancel_after: int = 0
) -> tuple[list[Any], dict[str, Any] | None]:
    """What a browser socket sees: its chunk objects and error objects, and its `done`.
    `cancel_after`: the client sends `cancel` after that many chunks."""
    runner = await FakeRunner.connect(gateway)
    seen: list[Any] = []
    done: dict[str, Any] | None = None
    try:
        player = asyncio.create_task(play(runner, steps))
        async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
            await send(ws, {"type": "chat.completions.create", "request_id": "q", "body": request})
            while True:
                msg = orjson.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
                assert msg["request_id"] == "q", msg
                if msg["type"] == "chunk":
                    seen.append(msg["chunk"])
                    if cancel_after and len(seen) == cancel_after:
                        await send(ws, {"type": "cancel", "request_id": "q"})
                elif msg["type"] == "error":
                    seen.append({"error": msg["error"]})
                    break
                else:
                    assert msg["type"] == "done", msg
                    done = msg
                    break
        await asyncio.wait_for(player, 10 * UNIT)
    finally:
        await runner.close()
    return seen, done


async def send(ws: ClientConnection, obj: Any) -> None:
    await ws.send(orjson.dumps(obj), text=True)


def same_stream(objects: list[Any]) -> list[Any]:
    """The objects with the per-response `id` and `created` taken out (checked constant)."""
    chunks = [o for o in objects if "object" in o]
    if chunks:
        assert {c["id"] for c in chunks} == {chunks[0]["id"]}
        assert chunks[0]["id"].startswith("chatcmpl-")
        assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    return [{k: v for k, v in o.items() if k not in ("id", "created")} for o in objects]


USAGE_OPTIONS = [
    {},
    {"stream_options": {"include_usage": True}},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
]


@pytest.mark.parametrize("options", USAGE_OPTIONS, ids=["no-usage", "usage", "continuous"])
@pytest.mark.parametrize("finish", ["stop", "length"])
async def test_a_finished_stream(gateway: Gateway, options: dict[str, Any], finish: str) -> None:
    steps: list[Step] = [
        ("chunk", "", "think", None),
        ("chunk", "Hel", "", None),
        ("chunk", "", "", None),  # a held-back token: no delta (a usage-only chunk at most)
        ("chunk", "lo", "", finish),  # type: ignore[list-item]
    ]
    request = body(**options)
    sse = await over_sse(gateway, request, steps)
    ws, done = await over_ws(gateway, request, steps)
    assert same_stream(ws) == same_stream(sse)
    assert sse[-1 if not options else -2]["choices"][0]["finish_reason"] == finish
    assert done is not None
    assert done["finish_reason"] == finish
    assert done["usage"]["completion_tokens"] == 4
    assert done["usage"]["prompt_tokens_details"] == {"cached_tokens": 4, "audio_tokens": 0}
    if options:
        assert sse[-1]["usage"] == done["usage"]


@pytest.mark.parametrize("options", USAGE_OPTIONS, ids=["no-usage", "usage", "continuous"])
async def test_a_cancelled_stream(gateway: Gateway, options: dict[str, Any]) -> None:
    """Over SSE a runner ends it as cancelled (its drain deadline); over the socket the client
    cancels and the runner confirms: the client sees the same, a finish chunk saying stop."""
    request = body(**options)
    sse = await over_sse(
        gateway, request, [("chunk", "a", "", None), ("chunk", "b", "", "cancelled")]
    )
    ws, done = await over_ws(
        gateway,
        request,
        [("chunk", "a", "", None), ("await_cancel",), ("chunk", "b", "", "cancelled")],
        cancel_after=2,  # the role chunk and "a"
    )
    assert same_stream(ws) == same_stream(sse)
    finish = [c for c in sse if c["choices"]][-1]["choices"][0]
    assert (finish["delta"], finish["finish_reason"]) == ({}, "stop")
    assert done is not None
    assert done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("steps", "code"),
    [
        ([("chunk", "a", "", None), ("error", "internal_error")], "internal_error"),
        ([("chunk", "a", "", None), ("close",)], "runner_lost"),
        ([("chunk", "a", "", None), ("silence",)], "timeout"),
        ([("silence",)], "timeout"),  # committed after first_token_wait: role chunk, then error
    ],
    ids=["runner-error", "runner-lost", "timeout", "timeout-before-first-token"],
)
async def test_a_stream_that_fails(gateway: Gateway, steps: list[Step], code: str) -> None:
    request = body(stream_options={"include_usage": True})
    sse = await over_sse(gateway, request, steps)
    ws, done = await over_ws(gateway, request, steps)
    assert same_stream(ws) == same_stream(sse)
    assert done is None  # an error ends it: no done
    assert ws[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert ws[-1]["error"]["code"] == code
    assert ws[-1]["error"]["type"] == "server_error"


async def test_an_error_before_the_first_token(gateway: Gateway) -> None:
    """SSE answers it as an HTTP error (nothing was sent yet); the socket as an error message
    with the same OpenAI error object, and no chunk."""
    steps: list[Step] = [("error", "context_length_exceeded")]
    sse = await over_sse(gateway, body(), steps)
    ws, done = await over_ws(gateway, body(), steps)
    assert (
        ws
        == sse
        == [
            {
                "error": {
                    "message": "runner says context_length_exceeded",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
        ]
    )
    assert done is None


# --- the real path: a runner on the built-in model, at temperature 0 ----------------------


@pytest.fixture(scope="module")
def real(stacks: Stacks) -> tuple[Gateway, Process]:
    return stacks.get()


@pytest.fixture
async def http(real: tuple[Gateway, Process]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=real[0].base, timeout=60 * UNIT) as client:
        yield client


async def real_ws(gateway: Gateway, request: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        await send(ws, {"type": "chat.completions.create", "request_id": "q", "body": request})
        chunks: list[Any] = []
        while (msg := orjson.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT)))["type"] == (
            "chunk"
        ):
            chunks.append(msg["chunk"])
        assert msg["type"] == "done", msg
        return chunks, msg


def joined(objects: list[Any]) -> list[Any]:
    """A real stream with its deltas joined: where a model's tokens split into chunks depends
    on timing (tokens that pile up go out together), not on the transport."""
    objects = same_stream(objects)
    role, *middle, finish, usage = objects
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in middle)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in middle)
    return [role, content, reasoning, finish, usage]


@pytest.mark.parametrize("options", USAGE_OPTIONS[1:], ids=["usage", "continuous"])
async def test_the_real_path_at_temperature_0(
    real: tuple[Gateway, Process], http: httpx.AsyncClient, options: dict[str, Any]
) -> None:
    gateway = real[0]
    request = {
        "model": "orchard-demo",
        "messages": [{"role": "user", "content": "Tell me about the parity of plums."}],
        "max_tokens": 12,
        "temperature": 0,
        **options,
    }
    # Once first, so that both transports find the same prefix cache (same cached_tokens).
    resp = await http.post("/v1/chat/completions", json={**request, "stream": True})
    # length
    resp = await http.post("/v1/chat/completions", json={**request, "stream": True})
    sse = sse_events(resp.content)[:-1]
    ws, done = await real_ws(gateway, request)
    assert joined(ws) == joined(sse)
    assert sse[-2]["choices"][0]["finish_reason"] == done["finish_reason"] == "length"
    assert done["usage"] == sse[-1]["usage"]
    assert done["usage"]["completion_tokens"] == 12
    # Both repeated a prompt sent just before: all of it but its last token was cached.
    prompt_tokens = done["usage"]["prompt_tokens"]
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    # stop: on a stop string taken from the text itself
    text = joined(sse)[1]
    stop = text.strip()[4:8]
    assert len(stop) == 4
    request = {**request, "stop": [stop]}
    resp = await http.post("/v1/chat/completions", json={**request, "stream": True})
    sse = sse_events(resp.content)[:-1]
    ws, done = await real_ws(gateway, request)
    assert joined(ws) == joined(sse)
    assert sse[-2]["choices"][0]["finish_reason"] == done["finish_reason"] == "stop"
    assert done["usage"] == sse[-1]["usage"]
    assert stop not in joined(ws)[1]
