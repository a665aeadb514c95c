"""A client slower than its runner gets the chunks queued for it merged
(gateway.streaming.request_stream: past `MAX_PENDING`, new ones join the last). Nothing of the last
chunk may be lost in the merge: here a stop string's, which Anthropic's Messages show as
`stop_sequence`, in every dialect, streamed and not.

The runner is a `FakeRunner` that answers with one `Batch` frame of more chunks than the
bound: the gateway pushes them all before the client's handler runs again, so the merge
happens however fast the client reads."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import orjson
import pytest
from websockets.asyncio.client import connect

from gateway.streaming.request_stream import MAX_PENDING
from protocol.frames import Batch, Chunk, Generate, GenerationStats, Usage
from tests.support import UNIT, FakeRunner, Gateway

MODEL = "fake-model"
CHUNKS = MAX_PENDING + 40
STOP = "END"
TEXT = "".join(f"t{i} " for i in range(CHUNKS - 1))
QUESTION: Any = [{"role": "user", "content": "hi"}]
NAMES = itertools.count()


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gateway = Gateway()
    try:
        yield gateway
    finally:
        gateway.stop()


def chunks(request_id: str) -> Batch:
    """The answer: `CHUNKS - 1` chunks of text, then one that ends on the stop string."""
    body = [Chunk(request_id, i, f"t{i} ", "", 1, Usage(3, i + 1)) for i in range(CHUNKS - 1)]
    stats = GenerationStats(1000.0, 500.0, 1 << 20, 0.01)
    last = Chunk(
        request_id, CHUNKS - 1, "", "", 1, Usage(3, CHUNKS), "stop", stats, matched_stop=STOP
    )
    return Batch((*body, last))


async def answered(fake: FakeRunner, call: Awaitable[Any], stop: tuple[str, ...]) -> Any:
    """`call`'s result, the fake runner answering its request (asking for `stop`) with the
    batch."""
    task = asyncio.ensure_future(call)
    frame = await asyncio.wait_for(fake.next_request(), 10 * UNIT)
    assert isinstance(frame, Generate)
    assert frame.stop == stop
    await fake.send(chunks(frame.request_id))
    return await asyncio.wait_for(task, 10 * UNIT)


Dialect = Callable[[Gateway, bool], Awaitable[tuple[str, Any]]]


async def chat(gateway: Gateway, stream: bool) -> tuple[str, Any]:
    async with openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key="-") as client:
        if not stream:
            answer = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, stop=[STOP]
            )
            choice = answer.choices[0]
            return choice.message.content or "", choice.finish_reason
        text, finish = [], None
        async for chunk in await client.chat.completions.create(
            model=MODEL, messages=QUESTION, stop=[STOP], stream=True
        ):
            for part in chunk.choices:
                text.append(part.delta.content or "")
                finish = part.finish_reason or finish
        return "".join(text), finish


async def messages(gateway: Gateway, stream: bool) -> tuple[str, Any]:
    async with anthropic.AsyncAnthropic(base_url=gateway.base, api_key="-") as claude:
        request: Any = {
            "model": MODEL,
            "max_tokens": 1000,
            "messages": QUESTION,
            "stop_sequences": [STOP],
        }
        if stream:
            async with claude.messages.stream(**request) as events:
                message = await events.get_final_message()
        else:
            message = await claude.messages.create(**request)
    text = "".join(block.text for block in message.content if block.type == "text")
    return text, (message.stop_reason, message.stop_sequence)


async def responses(gateway: Gateway, stream: bool) -> tuple[str, Any]:
    # Responses has no stop strings: the runner's chunks alone end the answer.
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http:
        body = {"model": MODEL, "input": "hi", "stream": stream}
        if not stream:
            done = (await http.post("/v1/responses", json=body)).json()
        else:
            async with http.stream("POST", "/v1/responses", json=body) as reply:
                events = [
                    orjson.loads(line[6:])
                    async for line in reply.aiter_lines()
                    if line.startswith("data: ")
                ]
            done = events[-1]["response"]
            assert events[-1]["type"] == "response.completed"
    (item,) = done["output"]
    return item["content"][0]["text"], (done["status"], done["usage"]["output_tokens"])


async def ollama_chat(gateway: Gateway, stream: bool) -> tuple[str, Any]:
    async with ollama.AsyncClient(host=gateway.base) as local:
        options = {"stop": [STOP]}
        if not stream:
            answer = await local.chat(model=MODEL, messages=QUESTION, options=options)
            return answer.message.content or "", (answer.done_reason, answer.eval_count)
        text, last = [], None
        async for part in await local.chat(
            model=MODEL, messages=QUESTION, options=options, stream=True
        ):
            text.append(part.message.content or "")
            last = part
        assert last is not None
        return "".join(text), (last.done_reason, last.eval_count)


async def browser(gateway: Gateway, stream: bool) -> tuple[str, Any]:
    body = {"model": MODEL, "messages": QUESTION, "stop": [STOP]}
    create = {"type": "chat.completions.create", "request_id": "r", "body": body}
    text = []
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        await ws.send(orjson.dumps(create), text=True)
        while (msg := orjson.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT)))[
            "type"
        ] == "chunk":
            for choice in msg["chunk"]["choices"]:
                text.append(choice["delta"].get("content") or "")
    assert msg["type"] == "done"
    return "".join(text), msg["finish_reason"]


DIALECTS: dict[str, tuple[Dialect, Any]] = {
    "chat": (chat, "stop"),
    "messages": (messages, ("stop_sequence", STOP)),
    "responses": (responses, ("completed", CHUNKS)),
    "ollama": (ollama_chat, ("stop", CHUNKS)),
    "browser": (browser, "stop"),
}


@pytest.mark.parametrize(
    ("dialect", "stream"),
    [
        (dialect, stream)
        for dialect in DIALECTS
        for stream in (True, False)
        if stream or dialect != "browser"  # the browser socket always streams
    ],
)
async def test_a_merged_answer_keeps_its_stop_string(
    gateway: Gateway, dialect: str, stream: bool
) -> None:
    ask, ending = DIALECTS[dialect]
    stop = () if dialect == "responses" else (STOP,)
    # A runner of its own name per test: the one before may still be leaving the pool.
    fake = await FakeRunner.connect(gateway, models=(MODEL,), name=f"fake-{next(NAMES)}")
    try:
        text, end = await answered(fake, ask(gateway, stream), stop)
    finally:
        await fake.close()
    assert text == TEXT
    assert end == ending
