"""Background responses end to end: the official `openai` SDK against a real gateway and a
real runner on the built-in model. A background response streamed, left by its client after
its first events, resumed by sequence number with `responses.retrieve(stream=True,
starting_after=N)`, says at temperature 0 what a response in the foreground says; one
cancelled mid-way ends cancelled with its items cut short; the async client does the same."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai

from tests.support import UNIT, Gateway, Process

MODEL = "orchard-demo"
ASK: dict[str, Any] = {
    "model": MODEL,
    "input": "Tell me about pear trees.",
    "temperature": 0,
    "max_output_tokens": 48,
}


def until_done(client: openai.OpenAI, rid: str) -> Any:
    deadline = time.monotonic() + 60 * UNIT
    while time.monotonic() < deadline:
        response = client.responses.retrieve(rid)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.05)
    raise AssertionError(f"{rid} still running")


def test_streamed_left_resumed_and_equal_to_the_foreground(client: openai.OpenAI) -> None:
    foreground = client.responses.create(**ASK)
    with client.responses.create(**ASK, background=True, stream=True) as stream:
        head = [next(stream) for _ in range(3)]  # then this client leaves
    assert [(e.type, e.sequence_number) for e in head] == [
        ("response.created", 0),
        ("response.queued", 1),
        ("response.in_progress", 2),
    ]
    rid = head[0].response.id
    assert (head[0].response.status, head[0].response.background) == ("queued", True)
    with client.responses.retrieve(rid, stream=True, starting_after=2) as resumed:
        rest = list(resumed)
    assert [e.sequence_number for e in rest] == list(range(3, 3 + len(rest)))
    last = rest[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text == foreground.output_text
    usage, alone = last.response.usage, foreground.usage
    assert usage is not None
    assert alone is not None
    # The prompt's tokens may now come from the prefix cache: the counts are the same.
    assert (usage.input_tokens, usage.output_tokens) == (alone.input_tokens, alone.output_tokens)
    text = "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == foreground.output_text
    stored = client.responses.retrieve(rid)
    assert (stored.status, stored.output_text) == (foreground.status, foreground.output_text)
    # Continued as any stored response.
    follow = client.responses.create(**{**ASK, "input": "More."}, previous_response_id=rid)
    assert follow.usage is not None
    assert foreground.usage is not None
    assert follow.usage.input_tokens > foreground.usage.input_tokens


def test_cancelled_mid_way(client: openai.OpenAI) -> None:
    created = client.responses.create(
        **{**ASK, "max_output_tokens": 1900, "temperature": 1.0}, background=True
    )
    assert created.status == "queued"
    with client.responses.retrieve(created.id, stream=True) as events:
        for event in events:
            if event.type == "response.output_text.delta":
                break  # it is writing: cancel it now
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status in ("cancelled", "completed")  # the model may have ended first
    if cancelled.status == "cancelled":
        statuses = [item.model_dump()["status"] for item in cancelled.output]
        assert statuses[-1] == "incomplete"
        assert all(status in ("completed", "incomplete") for status in statuses)
    assert client.responses.retrieve(created.id).status == cancelled.status
    assert client.responses.cancel(created.id).model_dump() == cancelled.model_dump()


def test_the_async_client(stack: tuple[Gateway, Process]) -> None:
    async def run() -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{stack[0].base}/v1", api_key="unused", max_retries=0
        ) as client:
            created = await client.responses.create(**ASK, background=True)
            assert created.status == "queued"
            events = []
            async with await client.responses.retrieve(
                created.id, stream=True, starting_after=0
            ) as stream:
                async for event in stream:
                    events.append(event)
            assert events[0].sequence_number == 1
            assert events[-1].type in ("response.completed", "response.incomplete")
            done = await client.responses.retrieve(created.id)
            assert done.output_text == events[-1].response.output_text

    asyncio.run(run())
