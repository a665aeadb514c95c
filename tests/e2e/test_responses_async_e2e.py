"""Every Responses resource through the official SDK's async client, each answer equal to the
sync client's for the same call: create (whole and streamed), retrieve, input_tokens.count,
input_items.list (paged), compact, and cancel of a background response."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson

from tests.support import Gateway, Process

MODEL = "orchard-demo"
ASK: dict[str, Any] = {
    "model": MODEL,
    "input": "Tell me about pear trees.",
    "temperature": 0,
    "max_output_tokens": 24,
}
CONVERSATION: Any = [
    {"role": "user", "content": "Tell me about pear trees."},
    {"role": "assistant", "content": "They grow in orchards."},
    {"role": "user", "content": "How tall?"},
]


def strip_id(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != "id"}


def run_async(stack: tuple[Gateway, Process], calls: Any) -> Any:
    async def run() -> Any:
        async with openai.AsyncOpenAI(
            base_url=f"{stack[0].base}/v1", api_key="unused", max_retries=0
        ) as client:
            return await calls(client)

    return asyncio.run(run())


def test_create_whole_and_streamed(client: openai.OpenAI, stack: tuple[Gateway, Process]) -> None:
    want = client.responses.create(**ASK)

    async def calls(aclient: openai.AsyncOpenAI) -> tuple[Any, list[Any], Any]:
        whole = await aclient.responses.create(**ASK)
        events = [event async for event in await aclient.responses.create(**ASK, stream=True)]
        return whole, events, await aclient.responses.retrieve(whole.id)

    whole, events, retrieved = run_async(stack, calls)
    assert whole.output_text == want.output_text
    assert whole.usage is not None
    assert want.usage is not None
    assert whole.usage.output_tokens == want.usage.output_tokens
    assert whole.usage.input_tokens == want.usage.input_tokens
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        want.output_text
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert retrieved.model_dump() == whole.model_dump()


def test_counts_items_and_compaction(client: openai.OpenAI, stack: tuple[Gateway, Process]) -> None:
    first = client.responses.create(**ASK)
    second = client.responses.create(
        model=MODEL, input="And their fruit?", previous_response_id=first.id, max_output_tokens=16
    )
    want_count = client.responses.input_tokens.count(model=MODEL, input=CONVERSATION)
    want_items = [item.model_dump() for item in client.responses.input_items.list(second.id)]
    want_compact = orjson.loads(
        client.responses.with_raw_response.compact(model=MODEL, input=CONVERSATION).content
    )

    async def calls(aclient: openai.AsyncOpenAI) -> tuple[Any, list[Any], list[Any], Any]:
        count = await aclient.responses.input_tokens.count(model=MODEL, input=CONVERSATION)
        items = [item.model_dump() async for item in aclient.responses.input_items.list(second.id)]
        paged = [
            item.model_dump()
            async for item in aclient.responses.input_items.list(second.id, limit=1)
        ]
        raw = await aclient.responses.with_raw_response.compact(model=MODEL, input=CONVERSATION)
        return count, items, paged, orjson.loads(raw.content)

    count, items, paged, compacted = run_async(stack, calls)
    assert count.model_dump() == want_count.model_dump()
    assert count.input_tokens > 0
    assert items == want_items
    assert len(items) >= 2  # the earlier turn's input and output, and the new input
    assert paged == want_items  # one page at a time, the SDK following `after`
    assert compacted["object"] == want_compact["object"] == "response.compaction"
    assert [i["type"] for i in compacted["output"]] == ["message", "message", "compaction"]
    # Each call's items have ids of their own; the messages kept are the same.
    assert [strip_id(i) for i in compacted["output"][:2]] == [
        strip_id(i) for i in want_compact["output"][:2]
    ]


def test_cancel_a_background_response(stack: tuple[Gateway, Process]) -> None:
    async def calls(aclient: openai.AsyncOpenAI) -> tuple[Any, Any, Any]:
        created = await aclient.responses.create(
            **{**ASK, "max_output_tokens": 1500}, background=True
        )
        cancelled = await aclient.responses.cancel(created.id)
        return created, cancelled, await aclient.responses.retrieve(created.id)

    created, cancelled, retrieved = run_async(stack, calls)
    assert created.status == "queued"
    assert created.background is True
    # Cancelled while queued or running; a response that ended first keeps its status.
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert retrieved.status == cancelled.status
