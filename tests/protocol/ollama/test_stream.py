"""Ollama's NDJSON lines and whole answers, rendered with no I/O and fake clocks: the objects
field by field and in Ollama's key order, tool calls sent whole, the counts the runner
computed, the durations from the gateway's timings, errors as `{"error": ...}` lines."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
import pytest
from ollama import ChatResponse, GenerateResponse

from protocol.core.errors import ApiError
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, Error, ModelInfo, ToolCallDelta, Usage
from protocol.ollama.models import ServedModel, ps_body, show_body, tags_body, version_body
from protocol.ollama.stream import (
    NDJSON,
    Endpoint,
    OllamaWriter,
    TimedBuilder,
    Timings,
    answer_body,
    created_at,
    load_body,
)
from tests.support import on_the_wire

SECOND = 1_000_000_000
WALL = 1_764_547_200 * SECOND  # 2025-12-01T00:00:00Z
STAMP = "2025-12-01T00:00:00.000000001Z"


def clocks() -> tuple[Any, Any]:
    """A wall clock that ticks 1 ns a read, and a monotonic one that ticks 1 ms a read."""
    wall = itertools.count(WALL + 1)
    mono = itertools.count(10_000_000, 1_000_000)
    return (lambda: next(wall)), (lambda: next(mono))


def chunk(seq: int, text: str = "", **fields: Any) -> Chunk:
    return Chunk("r", seq, text, fields.pop("reasoning", ""), 1, Usage(5, seq + 1), **fields)


def stream_of(endpoint: Endpoint, timings: Timings) -> CompletionStream:
    wall, mono = clocks()
    return CompletionStream(OllamaWriter(endpoint, "m", timings, wall=wall, mono=mono), NDJSON)


def lines(out: list[bytes]) -> list[dict[str, Any]]:
    body = b"".join(out)
    assert body.endswith(b"\n")
    return [orjson.loads(line) for line in body.split(b"\n")[:-1]]


def test_created_at_is_rfc3339_with_nanoseconds_as_go_writes_it() -> None:
    assert created_at(WALL) == "2025-12-01T00:00:00Z"
    assert created_at(WALL + 123_456_789) == "2025-12-01T00:00:00.123456789Z"
    assert created_at(WALL + 120_000_000) == "2025-12-01T00:00:00.12Z"


def test_a_streamed_chat_line_by_line() -> None:
    timings = Timings(arrived=0, dispatched=2_000_000)
    stream = stream_of("chat", timings)
    out: list[bytes] = []
    stream.start(out)  # Ollama has no opening object
    assert out == []
    assert not stream.feed(chunk(0, "Hel", reasoning="hm"), out)
    assert not stream.feed(chunk(1, ""), out)  # a held-back token: nothing to send
    assert not stream.feed(chunk(2, "lo"), out)
    assert stream.feed(chunk(3, "", finish_reason="length"), out)
    raw = b"".join(out)
    assert raw == (
        b'{"model":"m","created_at":"2025-12-01T00:00:00.000000001Z","message":{"role":'
        b'"assistant","content":"Hel","thinking":"hm"},"done":false}\n'
        b'{"model":"m","created_at":"2025-12-01T00:00:00.000000002Z","message":{"role":'
        b'"assistant","content":"lo"},"done":false}\n'
        b'{"model":"m","created_at":"2025-12-01T00:00:00.000000003Z","message":{"role":'
        b'"assistant","content":""},"done_reason":"length","done":true,'
        b'"total_duration":11000000,"load_duration":2000000,"prompt_eval_count":5,'
        b'"prompt_eval_duration":8000000,"eval_count":4,"eval_duration":1000000}\n'
    )
    parsed = [ChatResponse(**line) for line in lines(out)]
    assert [p.message.content for p in parsed] == ["Hel", "lo", ""]
    assert parsed[0].message.thinking == "hm"
    last = parsed[-1]
    assert (last.done, last.done_reason, last.prompt_eval_count, last.eval_count) == (
        True,
        "length",
        5,
        4,
    )
    assert last.total_duration == (last.load_duration or 0) + (last.prompt_eval_duration or 0) + (
        last.eval_duration or 0
    )


def test_a_streamed_generate_has_response_and_done_before_done_reason() -> None:
    stream = stream_of("generate", Timings(0, 0))
    out: list[bytes] = []
    stream.feed(chunk(0, "Once"), out)
    stream.feed(chunk(1, "", finish_reason="stop"), out)
    first, last = lines(out)
    assert first == {
        "model": "m",
        "created_at": "2025-12-01T00:00:00.000000001Z",
        "response": "Once",
        "done": False,
    }
    assert list(last) == [
        "model",
        "created_at",
        "response",
        "done",
        "done_reason",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    ]
    assert (last["response"], last["done_reason"], last["eval_count"]) == ("", "stop", 2)
    assert GenerateResponse(**last).done


def call(index: int, arguments: str, name: str | None = None) -> ToolCallDelta:
    call_id = f"call_{index}" if name else None
    return ToolCallDelta(index, arguments, call_id, name)


def test_tool_calls_are_sent_whole_when_complete() -> None:
    stream = stream_of("chat", Timings(0, 0))
    out: list[bytes] = []
    stream.feed(chunk(0, tool_calls=(call(0, '{"city": ', "get_weather"),)), out)
    assert out == []  # arguments still being written
    stream.feed(chunk(1, tool_calls=(call(0, '"Paris"}'), call(1, '{"city"', "get_weather"))), out)
    (paris,) = lines(out)
    assert paris["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    out.clear()
    stream.feed(chunk(2, tool_calls=(call(1, ': "London"}'),)), out)
    stream.feed(chunk(3, finish_reason="tool_calls"), out)
    london, last = lines(out)
    message = ChatResponse(**london).message
    assert message.tool_calls is not None
    ((name, arguments),) = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert (name, arguments) == ("get_weather", {"city": "London"})
    assert last["done_reason"] == "stop"
    assert "tool_calls" not in last["message"]


def test_a_call_cut_short_is_sent_as_text() -> None:
    stream = stream_of("chat", Timings(0, 0))
    out: list[bytes] = []
    stream.feed(chunk(0, tool_calls=(call(0, '{"city": "Pa', "get_weather"),)), out)
    stream.feed(chunk(1, finish_reason="length"), out)
    text, last = lines(out)
    assert text["message"] == {
        "role": "assistant",
        "content": '{"name": "get_weather", "arguments": {"city": "Pa}',
    }
    assert last["done_reason"] == "length"


def test_an_error_mid_stream_is_an_error_line_and_the_end() -> None:
    stream = stream_of("chat", Timings(0, 0))
    out: list[bytes] = []
    stream.feed(chunk(0, "a"), out)
    assert stream.feed(Error("r", "internal_error", "the engine failed"), out)
    assert lines(out)[1] == {"error": "the engine failed"}
    assert stream.feed(chunk(1, "late"), out)
    assert len(lines(out)) == 2


def test_a_cancelled_stream_still_ends_with_its_counts() -> None:
    stream = stream_of("chat", Timings(0, 0))
    out: list[bytes] = []
    stream.feed(chunk(0, "a"), out)
    stream.cancel(out)
    last = lines(out)[-1]
    assert (last["done"], last["done_reason"], last["eval_count"]) == (True, "stop", 1)


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_the_whole_answer(endpoint: Endpoint) -> None:
    wall, mono = clocks()
    timings = Timings(arrived=0, dispatched=1_000_000)
    builder = TimedBuilder(timings, mono)
    builder.feed(chunk(0, "Hel", reasoning="hm"))
    assert timings.first == 10_000_000
    builder.feed(chunk(1, "lo", tool_calls=(call(0, '{"city": "Paris"}', "get_weather"),)))
    builder.feed(chunk(2, "", finish_reason="tool_calls"))
    body = on_the_wire(answer_body(builder, endpoint, "m", wall=wall, mono=mono))
    metrics = {
        "total_duration": 11_000_000,
        "load_duration": 1_000_000,
        "prompt_eval_count": 5,
        "prompt_eval_duration": 9_000_000,
        "eval_count": 3,
        "eval_duration": 1_000_000,
    }
    if endpoint == "chat":
        assert body == {
            "model": "m",
            "created_at": STAMP,
            "message": {
                "role": "assistant",
                "content": "Hello",
                "thinking": "hm",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "function": {
                            "index": 0,
                            "name": "get_weather",
                            "arguments": {"city": "Paris"},
                        },
                    }
                ],
            },
            "done_reason": "stop",
            "done": True,
            **metrics,
        }
        assert ChatResponse(**body).message.content == "Hello"
    else:
        assert body == {
            "model": "m",
            "created_at": STAMP,
            "response": "Hello",
            "thinking": "hm",
            "done": True,
            "done_reason": "stop",
            **metrics,
        }
        assert GenerateResponse(**body).response == "Hello"


def test_the_whole_answer_has_every_call() -> None:
    wall, mono = clocks()
    builder = TimedBuilder(Timings(0, 0), mono)
    builder.feed(chunk(0, tool_calls=(call(0, '{"city": "Paris"}', "get_weather"),)))
    builder.feed(chunk(1, tool_calls=(call(1, '{"city": "London"}', "get_weather"),)))
    builder.feed(chunk(2, tool_calls=(call(2, '{"city": ', "get_weather"),)))
    builder.feed(chunk(3, finish_reason="length"))
    message = on_the_wire(answer_body(builder, "chat", "m", wall=wall, mono=mono))["message"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
        {"city": "Paris"},
        {"city": "London"},
    ]
    assert [c["function"]["index"] for c in message["tool_calls"]] == [0, 1]
    assert message["content"] == '{"name": "get_weather", "arguments": {"city": }'


def test_a_failed_answer_raises_its_error() -> None:
    _, mono = clocks()
    builder = TimedBuilder(Timings(0, 0), mono)
    builder.feed(Error("r", "context_length_exceeded", "too long"))
    with pytest.raises(ApiError) as info:
        answer_body(builder, "chat", "m", wall=mono, mono=mono)
    assert info.value.message == "too long"


def test_load_only_answers() -> None:
    assert load_body("chat", "m", WALL) == {
        "model": "m",
        "created_at": "2025-12-01T00:00:00Z",
        "message": {"role": "assistant", "content": ""},
        "done_reason": "load",
        "done": True,
    }
    assert load_body("generate", "m", WALL) == {
        "model": "m",
        "created_at": "2025-12-01T00:00:00Z",
        "response": "",
        "done": True,
        "done_reason": "load",
    }


def test_model_bodies() -> None:
    models = [
        ServedModel(ModelInfo("b", 4096, "mlx-lm 0.32.2, mlx 0.32.4, gpu"), WALL),
        ServedModel(ModelInfo("a", 2048), WALL + SECOND),
    ]
    details = {
        "parent_model": "",
        "format": "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }
    assert tags_body(models) == {
        "models": [
            {"name": "a", "model": "a", "modified_at": "2025-12-01T00:00:01Z", "details": details},
            {
                "name": "b",
                "model": "b",
                "modified_at": "2025-12-01T00:00:00Z",
                "details": {**details, "format": "mlx"},
            },
        ]
    }
    assert ps_body(models[1:]) == {
        "models": [{"name": "a", "model": "a", "details": details, "context_length": 2048}]
    }
    assert show_body(models[0]) == {
        "details": {**details, "format": "mlx"},
        "model_info": {
            "general.architecture": "orchard",
            "general.basename": "b",
            "orchard.context_length": 4096,
            "orchard.engine": "mlx-lm 0.32.2, mlx 0.32.4, gpu",
        },
        "capabilities": ["completion", "tools"],
        "modified_at": "2025-12-01T00:00:00Z",
    }
    assert version_body() == {"version": "0.12.0"}


def test_a_calls_numbers_reach_the_client_as_the_model_wrote_them() -> None:
    wall, mono = clocks()
    builder = TimedBuilder(Timings(0, 0), mono)
    arguments = '{"n": 18446744073709551617, "price": 1.10}'
    builder.feed(chunk(0, tool_calls=(call(0, arguments, "f"),)))
    builder.feed(chunk(1, finish_reason="tool_calls"))
    wire = orjson.dumps(answer_body(builder, "chat", "m", wall=wall, mono=mono))
    assert b'"arguments":' + arguments.encode() in wire
    parsed = json.loads(wire)["message"]["tool_calls"][0]["function"]["arguments"]
    assert parsed == {"n": 18446744073709551617, "price": 1.10}
    assert type(parsed["n"]) is int
