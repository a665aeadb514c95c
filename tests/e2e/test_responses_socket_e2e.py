"""The Responses API's WebSocket mode end to end: the official `openai` SDK's
`client.responses.connect()` (sync and async) against a real gateway and a real runner on
the built-in model. At temperature 0 each lane's response is the SSE response's (its events
the same, but for ids, times and the `stream_id`), two lanes run at once on one socket, and
a continuation by previous_response_id over the socket is the HTTP one's."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support import Gateway, Process

# The SDK (3.57) opens websockets' sync client without a `with`, which websockets 17.1
# deprecates: its warning, not ours.
pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)

MODEL = "orchard-demo"
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}
VOLATILE = {"id", "item_id", "created_at", "completed_at", "stream_id", "sequence_number"}
"""What differs between two runs of one response (sequence numbers: with the deltas' cuts)."""


def shape(value: Any) -> Any:
    """An event without what differs between two runs of one response (ids, times, lane)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return value


def collapsed(events: list[Any]) -> list[str]:
    """The events' types, a run of text deltas as one."""
    kinds: list[str] = []
    for event in events:
        if not (kinds and kinds[-1] == event.type == "response.output_text.delta"):
            kinds.append(event.type)
    return kinds


def deltas(events: list[Any]) -> list[str]:
    return [e.delta for e in events if e.type == "response.output_text.delta"]


def until_ends(events: Any, count: int) -> list[Any]:
    got, ended = [], 0
    for event in events:
        got.append(event)
        ended += event.type in TERMINAL
        if ended == count:
            return got
    raise AssertionError("the socket closed early")


def test_two_lanes_are_each_the_sse_answer(client: openai.OpenAI) -> None:
    questions = {"pears": "Tell me about pear orchards.", "plums": "What do plums need?"}
    sse: dict[str, list[Any]] = {
        lane: list(
            client.responses.create(
                model=MODEL, input=q, temperature=0, max_output_tokens=24, stream=True
            )
        )
        for lane, q in questions.items()
    }
    with client.responses.connect() as conn:
        for lane, question in questions.items():
            conn.response.create(
                model=MODEL, input=question, temperature=0, max_output_tokens=24, stream_id=lane
            )
        events = until_ends(conn, 2)
    order = [e.stream_id for e in events if e.type == "response.output_text.delta"]
    assert len(set(order[:6])) == 2, "the lanes' deltas interleave"
    for lane, expected in sse.items():
        mine = [e for e in events if e.stream_id == lane]
        # Deltas may be cut differently (tokens merge while a client lags): the text is one.
        assert collapsed(mine) == collapsed(expected)
        assert "".join(deltas(mine)) == "".join(deltas(expected))
        assert [e.sequence_number for e in mine] == list(range(len(mine)))
        kept = [e for e in mine if e.type != "response.output_text.delta"]
        theirs = [e for e in expected if e.type != "response.output_text.delta"]
        usage_free = [shape(e.to_dict()) for e in kept[:-1]]
        assert usage_free == [shape(e.to_dict()) for e in theirs[:-1]]
        final: Any = kept[-1].response
        reference: Any = theirs[-1].response
        assert final.output_text == reference.output_text
        assert final.usage.output_tokens == reference.usage.output_tokens
        assert final.usage.input_tokens == reference.usage.input_tokens


async def test_a_chain_over_the_socket_is_the_http_chain(stack: tuple[Gateway, Process]) -> None:
    base = f"{stack[0].base}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        first_http = await client.responses.create(
            model=MODEL, input="Name a fruit tree.", temperature=0, max_output_tokens=16
        )
        second_http = await client.responses.create(
            model=MODEL,
            input="Why that one?",
            temperature=0,
            max_output_tokens=16,
            previous_response_id=first_http.id,
        )
        async with client.responses.connect() as conn:
            await conn.response.create(
                model=MODEL, input="Name a fruit tree.", temperature=0, max_output_tokens=16
            )
            first = await _final(conn)
            await conn.response.create(
                model=MODEL,
                input="Why that one?",
                temperature=0,
                max_output_tokens=16,
                previous_response_id=first.id,
            )
            second = await _final(conn)
        assert first.output_text == first_http.output_text
        assert second.output_text == second_http.output_text
        assert second.previous_response_id == first.id
        assert second.usage is not None
        assert second_http.usage is not None
        assert second.usage.input_tokens == second_http.usage.input_tokens
        stored = await client.responses.retrieve(second.id)
        assert stored.output_text == second.output_text


async def _final(conn: Any) -> Any:
    async for event in conn:
        if event.type in TERMINAL:
            assert event.type != "error", event
            return event.response
    raise AssertionError("the socket closed early")
