"""The Messages API's streamed events and non-streaming body, sans-I/O: `MessageWriter` in the
chat's `CompletionStream` with Anthropic's framing, fed runner chunks, checked event by event."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from protocol.anthropic.stream import (
    ANTHROPIC_SSE,
    MessageWriter,
    message_body,
    tool_use_id,
    usage_of,
)
from protocol.core.errors import ApiError, queue_full
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk, Error, ToolCallDelta, Usage
from tests.support import on_the_wire

RID = "msg_1"


def stream() -> CompletionStream:
    return CompletionStream(MessageWriter(RID, "m"), ANTHROPIC_SSE)


def events(out: list[bytes]) -> list[tuple[str, Any]]:
    """(event name, data) of each SSE event, checking the `event:` line names the data's type."""
    body = b"".join(out)
    assert body.endswith(b"\n\n")
    parsed = []
    for block in body.split(b"\n\n")[:-1]:
        name_line, data_line = block.split(b"\n")
        assert name_line.startswith(b"event: ")
        assert data_line.startswith(b"data: ")
        name, data = name_line[7:].decode(), orjson.loads(data_line[6:])
        assert data["type"] == name
        parsed.append((name, data))
    return parsed


def chunk(seq: int, text: str = "", reasoning: str = "", **kw: Any) -> Chunk:
    usage = kw.pop("usage", Usage(10, seq + 1, cached_tokens=4))
    return Chunk(RID, seq, text, reasoning, 1, usage, **kw)


USAGE_START = {
    "input_tokens": 6,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 4,
    "output_tokens": 0,
}


def test_text_and_thinking_in_anthropics_order() -> None:
    s = stream()
    out: list[bytes] = []
    assert not s.feed(chunk(0, reasoning="Hmm"), out)
    assert not s.feed(chunk(1, reasoning=" ok"), out)
    assert not s.feed(chunk(2, text="Hi"), out)
    assert s.feed(chunk(3, text="!", finish_reason="stop"), out)
    assert events(out) == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": RID,
                    "type": "message",
                    "role": "assistant",
                    "model": "m",
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": USAGE_START,
                },
            },
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "Hmm"},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": " ok"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "text_delta", "text": "Hi"},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "text_delta", "text": "!"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {**USAGE_START, "output_tokens": 4},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_tool_calls_stream_their_input_as_generated() -> None:
    s = stream()
    out: list[bytes] = []
    s.feed(chunk(0, text="Let me see."), out)
    s.feed(chunk(1, tool_calls=(ToolCallDelta(0, "", id="call_a", name="get"),)), out)
    s.feed(chunk(2, tool_calls=(ToolCallDelta(0, '{"city": '),)), out)
    s.feed(chunk(3, tool_calls=(ToolCallDelta(0, '"Paris"}'),)), out)
    s.feed(chunk(4, tool_calls=(ToolCallDelta(1, "{}", id="call_b", name="get"),)), out)
    s.feed(chunk(5, finish_reason="tool_calls"), out)
    names = [(name, data.get("index")) for name, data in events(out)]
    assert names == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    data = [d for _, d in events(out)]
    assert data[5]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_a",
        "name": "get",
        "input": {},
    }
    assert [d["delta"] for d in data[6:8]] == [
        {"type": "input_json_delta", "partial_json": '{"city": '},
        {"type": "input_json_delta", "partial_json": '"Paris"}'},
    ]
    assert data[9]["content_block"]["id"] == "toolu_b"
    assert data[12]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


@pytest.mark.parametrize(("finish", "reason"), [("length", "max_tokens"), ("stop", "end_turn")])
def test_stop_reasons(finish: Any, reason: str) -> None:
    s = stream()
    out: list[bytes] = []
    s.feed(chunk(0, text="a", finish_reason=finish), out)
    assert events(out)[-2][1]["delta"]["stop_reason"] == reason


def test_an_error_mid_stream_is_an_error_event_and_the_end() -> None:
    s = stream()
    out: list[bytes] = []
    s.feed(chunk(0, text="a"), out)
    assert s.feed(Error(RID, "internal_error", "boom"), out)
    assert events(out)[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
    )
    assert [name for name, _ in events(out)] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    more: list[bytes] = []
    assert s.feed(chunk(1, text="late"), more)
    assert more == []


def test_overload_mid_stream_is_overloaded_error() -> None:
    s = stream()
    out: list[bytes] = []
    s.feed(chunk(0, text="a"), out)
    s.fail(ApiError(503, "busy", "server_error"), out)
    assert events(out)[-1][1]["error"] == {"type": "overloaded_error", "message": "busy"}
    out2: list[bytes] = []
    s2 = stream()
    s2.start(out2)
    s2.fail(queue_full(), out2)
    assert events(out2)[-1][1]["error"]["type"] == "rate_limit_error"


def test_a_stream_started_before_the_first_chunk() -> None:
    """message_start cannot know the prompt yet: message_delta carries the usage."""
    s = stream()
    out: list[bytes] = []
    s.start(out)
    s.feed(chunk(0, text="a", finish_reason="stop"), out)
    start, *_, delta, _stop = [d for _, d in events(out)]
    assert start["message"]["usage"] == {
        "input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert delta["usage"] == {**USAGE_START, "output_tokens": 1}


def test_a_cancelled_stream_ends_with_an_error_not_a_stop_reason() -> None:
    s = stream()
    out: list[bytes] = []
    s.feed(chunk(0, text="a"), out)
    assert s.cancel(out)
    assert [name for name, _ in events(out)][-1] == "error"
    assert "message_delta" not in [name for name, _ in events(out)]


def test_usage_splits_cached_tokens_out_of_input_tokens() -> None:
    assert usage_of(Usage(30, 7, cached_tokens=12, reasoning_tokens=3)) == {
        "input_tokens": 18,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 12,
        "output_tokens": 7,
    }
    assert tool_use_id("call_x1") == "toolu_x1"


def collected(*chunks: Chunk) -> CompletionBuilder:
    builder = CompletionBuilder()
    for c in chunks:
        builder.feed(c)
    return builder


def test_the_non_streaming_body() -> None:
    builder = collected(
        chunk(0, reasoning="Hmm"),
        chunk(1, text="Sure"),
        chunk(2, tool_calls=(ToolCallDelta(0, '{"a"', id="call_1", name="f"),)),
        chunk(3, tool_calls=(ToolCallDelta(0, ": 1}"),)),
        chunk(4, tool_calls=(ToolCallDelta(1, "{}", id="call_2", name="g"),)),
        chunk(5, finish_reason="tool_calls"),
    )
    choices, usage = builder.result()
    assert on_the_wire(message_body(choices[0], usage, id=RID, model="m")) == {
        "id": RID,
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "Hmm", "signature": ""},
            {"type": "text", "text": "Sure"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
            {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {**USAGE_START, "output_tokens": 6},
    }


def test_an_empty_answer_has_no_blocks() -> None:
    choices, usage = collected(chunk(0, finish_reason="length")).result()
    body = message_body(choices[0], usage, id=RID, model="m")
    assert (body["content"], body["stop_reason"]) == ([], "max_tokens")


def test_a_cancelled_answer_is_a_server_error() -> None:
    choices, usage = collected(chunk(0, text="a", finish_reason="cancelled")).result()
    with pytest.raises(ApiError) as err:
        message_body(choices[0], usage, id=RID, model="m")
    assert err.value.status == 500


def test_a_call_whose_arguments_are_not_an_object_is_sent_as_text() -> None:
    # Cut short by max_tokens: what the model wrote is text, after the answer's own; a whole
    # call beside it is still a tool_use block.
    choices, usage = collected(
        chunk(0, text="Let me see. "),
        chunk(1, tool_calls=(ToolCallDelta(0, '{"city": "Par', id="call_1", name="f"),)),
        chunk(2, tool_calls=(ToolCallDelta(1, "{}", id="call_2", name="g"),)),
        chunk(3, tool_calls=(ToolCallDelta(2, "[1]", id="call_3", name="h"),)),
        chunk(4, finish_reason="length"),
    ).result()
    body = on_the_wire(message_body(choices[0], usage, id=RID, model="m"))
    assert body["content"] == [
        {
            "type": "text",
            "text": 'Let me see. {"name": "f", "arguments": {"city": "Par}'
            '{"name": "h", "arguments": [1]}',
        },
        {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}},
    ]
    assert body["stop_reason"] == "max_tokens"


def test_a_calls_numbers_reach_the_client_as_the_model_wrote_them() -> None:
    # Past 64 bits an integer does not fit a float (or orjson's integers); a decimal's
    # trailing zero is part of what the model wrote.
    arguments = '{"n": 18446744073709551617, "price": 1.10, "list": [-0, 1e400]}'
    choices, usage = collected(
        chunk(0, tool_calls=(ToolCallDelta(0, arguments[:9], id="call_1", name="f"),)),
        chunk(1, tool_calls=(ToolCallDelta(0, arguments[9:]),)),
        chunk(2, finish_reason="tool_calls"),
    ).result()
    wire = orjson.dumps(message_body(choices[0], usage, id=RID, model="m"))
    assert b'"input":' + arguments.encode() in wire
    block = json.loads(wire)["content"][0]
    assert block["input"]["n"] == 18446744073709551617
    assert type(block["input"]["n"]) is int
