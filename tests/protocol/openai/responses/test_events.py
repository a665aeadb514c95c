"""The Responses objects with no event loop: the events of a streamed response, field by
field and in order (fed through the chat's `CompletionStream`, as the gateway does), the
non-streaming body, and that both say the same."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from protocol.core.errors import ApiError
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, Error, ToolCallDelta, Usage
from protocol.openai.responses.events import (
    ResponseEvents,
    output_messages,
    response_body,
    usage_object,
)
from tests.protocol.openai.responses.events_support import RID, Ids, base, chunk, parse


def stream(
    items: Sequence[Chunk | Error], finished: list[dict[str, Any]] | None = None, **extra: Any
) -> list[dict[str, Any]]:
    events = ResponseEvents(
        base(**extra),
        clock=lambda: 200,
        new_id=Ids(),
    )
    completion = CompletionStream(events, events)
    out: list[bytes] = []
    for item in items:
        completion.feed(item, out)
    if finished is not None and events.response is not None:
        finished.append(events.response)
    return parse(out)


def strip(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events without sequence numbers (checked by `parse`)."""
    return [{k: v for k, v in e.items() if k != "sequence_number"} for e in events]


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def test_a_text_answer_event_by_event() -> None:
    kept: list[dict[str, Any]] = []
    events = strip(
        stream(
            [chunk(0, "Hel"), chunk(1, "lo", done="stop", usage=Usage(5, 2, 3, 0))],
            kept,
        )
    )
    in_progress = {**base(), "status": "in_progress", "output": []}
    message = {
        "id": "msg_1",
        "type": "message",
        "status": "completed",
        "content": [text_part("Hello")],
        "role": "assistant",
    }
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    completed = {
        **base(),
        "status": "completed",
        "completed_at": 200,
        "output": [message],
        "usage": {
            "input_tokens": 5,
            "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 7,
        },
    }
    assert events == [
        {"type": "response.created", "response": in_progress},
        {"type": "response.in_progress", "response": in_progress},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**message, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **where, "part": text_part("")},
        {"type": "response.output_text.delta", **where, "delta": "Hel", "logprobs": []},
        {"type": "response.output_text.delta", **where, "delta": "lo", "logprobs": []},
        {"type": "response.output_text.done", **where, "text": "Hello", "logprobs": []},
        {"type": "response.content_part.done", **where, "part": text_part("Hello")},
        {"type": "response.output_item.done", "output_index": 0, "item": message},
        {"type": "response.completed", "response": completed},
    ]
    assert kept == [completed]


def test_reasoning_then_text_are_two_items() -> None:
    events = strip(
        stream(
            [
                chunk(0, reasoning="Hmm"),
                chunk(1, reasoning=" ok", usage=Usage(5, 2, 0, 2)),
                chunk(2, "Yes", done="stop", usage=Usage(5, 3, 0, 2)),
            ]
        )
    )
    rs = {"item_id": "rs_1", "output_index": 0, "content_index": 0}
    msg = {"item_id": "msg_2", "output_index": 1, "content_index": 0}
    reasoning_done = {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Hmm ok"}],
        "status": "completed",
    }
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2] == {
        "type": "response.output_item.added",
        "output_index": 0,
        "item": {**reasoning_done, "content": [], "status": "in_progress"},
    }
    assert events[3] == {
        "type": "response.content_part.added",
        **rs,
        "part": {"type": "reasoning_text", "text": ""},
    }
    assert events[4] == {"type": "response.reasoning_text.delta", **rs, "delta": "Hmm"}
    assert events[6] == {"type": "response.reasoning_text.done", **rs, "text": "Hmm ok"}
    assert events[8]["item"] == reasoning_done
    assert events[11] == {
        "type": "response.output_text.delta",
        **msg,
        "delta": "Yes",
        "logprobs": [],
    }
    final = events[-1]["response"]
    assert [item["id"] for item in final["output"]] == ["rs_1", "msg_2"]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}


def test_function_calls_stream_their_arguments() -> None:
    calls = [
        chunk(0, calls=(ToolCallDelta(0, '{"city"', "call_a", "get_weather"),)),
        chunk(1, calls=(ToolCallDelta(0, ': "Paris"}'),)),
        chunk(2, calls=(ToolCallDelta(1, "{}", "call_b", "now"),), done="tool_calls"),
    ]
    events = strip(stream(calls, tools=TOOLS))
    first = {"item_id": "fc_1", "output_index": 0}
    call_a = {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "arguments": '{"city": "Paris"}',
        "call_id": "call_a",
        "name": "get_weather",
    }
    assert events[2:8] == [
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**call_a, "status": "in_progress", "arguments": ""},
        },
        {"type": "response.function_call_arguments.delta", **first, "delta": '{"city"'},
        {"type": "response.function_call_arguments.delta", **first, "delta": ': "Paris"}'},
        {
            "type": "response.function_call_arguments.done",
            **first,
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "response.output_item.done", "output_index": 0, "item": call_a},
        {
            "type": "response.output_item.added",
            "output_index": 1,
            "item": {
                "id": "fc_2",
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": "call_b",
                "name": "now",
            },
        },
    ]
    assert [e["type"] for e in events[8:]] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [item["call_id"] for item in final["output"]] == ["call_a", "call_b"]
    assert final["status"] == "completed"
    assert final["tools"] == [
        {
            "type": "function",
            "name": "get_weather",
            "description": None,
            "parameters": {"type": "object"},
            "strict": True,
        },
        {
            "type": "function",
            "name": "now",
            "description": None,
            "parameters": None,
            "strict": False,
        },
    ]


TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
    {"type": "function", "name": "now", "strict": False},
]


def test_max_output_tokens_is_incomplete() -> None:
    kept: list[dict[str, Any]] = []
    events = strip(stream([chunk(0, "a"), chunk(1, "b", done="length")], kept))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    response = final["response"]
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["completed_at"] is None
    assert response["output"][0]["status"] == "incomplete"
    assert events[-2]["item"]["status"] == "incomplete"
    assert kept == [response]


def test_an_empty_answer_still_has_its_message() -> None:
    events = strip(stream([chunk(0, done="stop")]))
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1]["response"]["output"][0]["content"] == [text_part("")]


def test_an_error_mid_stream_fails_the_response_without_the_open_item() -> None:
    kept: list[dict[str, Any]] = []
    events = strip(
        stream([chunk(0, reasoning="x"), chunk(1, "a"), Error(RID, "internal_error", "boom")], kept)
    )
    failed = events[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert [item["id"] for item in failed["response"]["output"]] == ["rs_1"]
    assert "usage" not in failed["response"]
    assert kept == []


def test_a_rate_limit_error_keeps_its_code() -> None:
    events = ResponseEvents(base(), clock=lambda: 200)
    out = [events.role(None, 0), events.error(ApiError(429, "busy", "rate_limit_error"))]
    assert parse(out)[-1]["response"]["error"] == {
        "code": "rate_limit_exceeded",
        "message": "busy",
    }


def test_an_error_before_anything_was_sent_is_an_error_event() -> None:
    events = ResponseEvents(base(), clock=lambda: 200)
    err = ApiError(500, "boom", "server_error", None, "internal_error")
    assert parse([events.error(err)]) == [
        {
            "type": "error",
            "sequence_number": 0,
            "code": "internal_error",
            "message": "boom",
            "param": None,
        }
    ]


def test_a_cancelled_response_fails() -> None:
    events = ResponseEvents(base(), clock=lambda: 200, new_id=Ids())
    completion = CompletionStream(events, events)
    out: list[bytes] = []
    completion.feed(chunk(0, "a"), out)
    completion.cancel(out)
    parsed = parse(out)
    assert [e["type"] for e in parsed][-3:] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    assert parsed[-2]["item"]["status"] == "incomplete"
    assert parsed[-1]["response"]["error"]["code"] == "server_error"


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls"])
def test_the_body_is_the_streams_last_response(reason: str) -> None:
    calls = (ToolCallDelta(0, "{}", "call_a", "now"),) if reason == "tool_calls" else ()
    items = [
        chunk(0, reasoning="r"),
        chunk(1, "t"),
        chunk(2, calls=calls, done=reason, usage=Usage(5, 3, 1, 1)),
    ]
    streamed = stream(items, tools=TOOLS)[-1]["response"]
    body = response_body(
        base(tools=TOOLS),
        reasoning="r",
        text="t",
        tool_calls=calls,
        reason=reason,  # type: ignore[arg-type]  # a FinishReason
        usage=Usage(5, 3, 1, 1),
        completed_at=200,
        new_id=Ids(),
    )
    assert body == streamed


def test_a_cancelled_body_is_a_server_error() -> None:
    with pytest.raises(ApiError) as caught:
        response_body(
            base(),
            reasoning="",
            text="a",
            tool_calls=(),
            reason="cancelled",
            usage=Usage(1, 1),
            completed_at=1,
        )
    assert caught.value.status == 500


def test_usage_object() -> None:
    assert usage_object(Usage(10, 4, 6, 3)) == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 14,
    }


def test_the_base_echoes_the_request() -> None:
    shown = base(
        instructions="Be brief.",
        max_output_tokens=16,
        temperature=0,
        top_p=0.5,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "now"},
        text={"format": {"type": "json_object"}},
        reasoning={"effort": "low"},
        metadata={"k": "v"},
        user="u",
        parallel_tool_calls=False,
    )
    assert shown["instructions"] == "Be brief."
    assert shown["max_output_tokens"] == 16
    assert (shown["temperature"], shown["top_p"]) == (0.0, 0.5)
    assert shown["tool_choice"] == {"type": "function", "name": "now"}
    assert shown["text"] == {"format": {"type": "json_object"}, "verbosity": "medium"}
    assert shown["reasoning"] == {"effort": "low", "summary": None}
    assert (shown["metadata"], shown["user"], shown["parallel_tool_calls"]) == (
        {"k": "v"},
        "u",
        False,
    )
    assert (shown["status"], shown["output"], shown["store"]) == ("in_progress", [], True)
    # Not nullable in openapi.yaml: no usage until the response is finished, no user unless
    # given.
    assert "usage" not in shown
    assert "user" not in base()
    assert (base()["temperature"], base()["top_p"], base()["tool_choice"]) == (1.0, 1.0, "auto")


def test_output_messages_continue_the_conversation() -> None:
    body = response_body(
        base(tools=TOOLS),
        reasoning="hidden",
        text="Let me check.",
        tool_calls=(ToolCallDelta(0, "{}", "call_a", "now"),),
        reason="tool_calls",
        usage=Usage(1, 1),
        completed_at=1,
    )
    (message,) = output_messages(body["output"])
    assert message.role == "assistant"
    assert message.content == "Let me check."
    assert [(c.id, c.name, c.arguments) for c in message.tool_calls] == [("call_a", "now", "{}")]
    assert message.reasoning == "hidden"
    quiet = response_body(
        base(), reasoning="", text="Hi", tool_calls=(), reason="stop", usage=Usage(1, 1),
        completed_at=1,
    )  # fmt: skip
    (message,) = output_messages(quiet["output"])
    assert (message.content, message.reasoning) == ("Hi", None)
