"""The Responses events in each transport's framing, with no event loop: SSE byte for byte as
before the framings were apart, and the WebSocket mode's messages (one JSON object per event,
its `stream_id`, the nested error event), field by field; a steered response's end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from protocol.core.errors import ApiError, invalid_request, server_error
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, Error, Usage
from protocol.openai.responses.events import ResponseEvents
from protocol.openai.responses.framing import (
    SSE_EVENTS,
    SocketEvents,
    error_event,
    split_events,
)
from tests.protocol.openai.responses.events_support import Ids, base, chunk, parse


def run(
    items: Sequence[Chunk | Error | ApiError], stream_id: str | None, *, steered: bool = False
) -> tuple[list[bytes], ResponseEvents]:
    events = ResponseEvents(
        base(), clock=lambda: 200, new_id=Ids(), framing=SocketEvents(stream_id)
    )
    events.steered = steered
    completion = CompletionStream(events, events)
    out: list[bytes] = []
    for item in items:
        if isinstance(item, ApiError):
            completion.fail(item, out)
        else:
            completion.feed(item, out)
    return out, events


def messages(out: list[bytes]) -> list[dict[str, Any]]:
    """The socket's messages: each line one JSON object, each a whole event."""
    found = [orjson.loads(line) for data in out for line in split_events(data)]
    assert all(data.endswith(b"\n") for data in out)
    return found


def test_sse_framing_is_the_event_and_data_lines() -> None:
    data = orjson.dumps({"type": "response.created", "sequence_number": 0})
    assert SSE_EVENTS.event("response.created", data) == (
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    )
    err = invalid_request("Bad.", "input", "invalid_value")
    assert SSE_EVENTS.error(err, 0) == (
        b'event: error\ndata: {"type":"error","sequence_number":0,"code":"invalid_value",'
        b'"message":"Bad.","param":"input"}\n\n'
    )


def test_sse_is_still_the_default() -> None:
    events = ResponseEvents(base(), clock=lambda: 200, new_id=Ids())
    out: list[bytes] = []
    CompletionStream(events, events).feed(chunk(0, "Hi", done="stop"), out)
    assert [e["type"] for e in parse(out)][:2] == ["response.created", "response.in_progress"]


@pytest.mark.parametrize("stream_id", ["agent_1", None])
def test_each_event_is_one_message_with_its_lane(stream_id: str | None) -> None:
    out, _ = run([chunk(0, "Hel"), chunk(1, "lo", done="stop", usage=Usage(5, 2))], stream_id)
    found = messages(out)
    assert [e["type"] for e in found] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in found] == list(range(len(found)))
    for event in found:
        if stream_id is None:
            assert "stream_id" not in event
        else:
            assert event["stream_id"] == stream_id
    delta = found[4]
    assert delta == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "Hel",
        "logprobs": [],
        **({"stream_id": stream_id} if stream_id else {}),
    }
    assert found[-1]["response"]["status"] == "completed"


def test_the_same_events_as_sse_but_the_lane() -> None:
    items = [chunk(0, "a"), chunk(1, "b", done="length")]
    sse_events = ResponseEvents(base(), clock=lambda: 200, new_id=Ids())
    sse: list[bytes] = []
    completion = CompletionStream(sse_events, sse_events)
    for item in items:
        completion.feed(item, sse)
    out, _ = run(items, "lane")
    assert [{k: v for k, v in e.items() if k != "stream_id"} for e in messages(out)] == parse(sse)


def test_an_error_before_the_start_is_the_nested_error_event() -> None:
    err = ApiError(429, "Queue full.", "rate_limit_error", None, "queue_full")
    out, _ = run([err], "agent_1")
    assert out == [
        b'{"type":"error","status":429,"sequence_number":0,"stream_id":"agent_1",'
        b'"error":{"type":"rate_limit_error","code":"queue_full","message":"Queue full.",'
        b'"param":null}}\n'
    ]


def test_an_error_after_the_start_is_response_failed() -> None:
    out, _ = run([chunk(0, "a"), server_error()], None)
    found = messages(out)
    assert found[-1]["type"] == "response.failed"
    assert found[-1]["response"]["error"]["code"] == "server_error"


def test_error_event_fields() -> None:
    err = invalid_request("Bad stream_id.", "stream_id", "invalid_value")
    assert orjson.loads(error_event(err)) == {
        "type": "error",
        "status": 400,
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_value",
            "message": "Bad stream_id.",
            "param": "stream_id",
        },
    }
    assert list(orjson.loads(error_event(err, stream_id="s", sequence_number=3))) == [
        "type",
        "status",
        "sequence_number",
        "stream_id",
        "error",
    ]


def test_a_stream_id_is_written_as_json() -> None:
    out, _ = run([chunk(0, "x", done="stop")], 'a"b')  # the session refuses it; still JSON
    assert all(e["stream_id"] == 'a"b' for e in messages(out))


def test_a_newline_in_the_text_stays_in_one_message() -> None:
    out, _ = run([chunk(0, "line\nnext", done="stop")], "s")
    found = messages(out)
    assert found[4]["delta"] == "line\nnext"


def test_a_steered_response_ends_incomplete_and_is_kept() -> None:
    out, events = run(
        [chunk(0, "Hel"), Chunk("resp_1", 1, "", "", 1, Usage(5, 1), "cancelled")],
        "s",
        steered=True,
    )
    found = messages(out)
    assert [e["type"] for e in found][-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = found[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "steered"}
    assert final["completed_at"] is None
    assert final["output"][0]["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == "Hel"
    assert final["usage"]["output_tokens"] == 1
    assert events.response == final


def test_a_cancelled_response_not_steered_still_fails() -> None:
    out, events = run(
        [chunk(0, "Hel"), Chunk("resp_1", 1, "", "", 1, Usage(5, 1), "cancelled")], None
    )
    assert messages(out)[-1]["type"] == "response.failed"
    assert events.response is None
