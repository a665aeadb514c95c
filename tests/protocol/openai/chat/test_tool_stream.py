"""Tool-call deltas and logprobs in a streamed and a non-streamed chat completion."""

from __future__ import annotations

from typing import Any

import orjson

from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk, TokenLogprob, ToolCallDelta, TopLogprob, Usage
from protocol.openai.chat.response import ChunkWriter, chat_completion_body
from protocol.openai.sse import SSE

HEAD = {
    "id": "c1",
    "object": "chat.completion.chunk",
    "created": 7,
    "model": "m",
    "system_fingerprint": "fp_0123456789",
}
NAME = ToolCallDelta(0, "", id="call_a", name="get_weather")
LP_X = TokenLogprob(
    "x", -0.5, (120,), (TopLogprob("x", -0.5, (120,)), TopLogprob("y", -1.5, (121,)))
)
LP_Y = TokenLogprob("\ufffd", -2.0, (226,), ())


def chunk(seq: int, text: str = "", **fields: Any) -> Chunk:
    return Chunk("r", seq, text, "", fields.pop("tokens", 1), Usage(3, seq + 1), **fields)


def events(items: list[Chunk], **options: Any) -> list[Any]:
    n = options.pop("n", 1)
    writer = ChunkWriter("c1", 7, "m", fingerprint="fp_0123456789", **options)
    stream = CompletionStream(writer, SSE, n=n)
    out: list[bytes] = []
    for item in items:
        stream.feed(item, out)
    data = b"".join(out).decode().split("\n\n")
    assert data[-2:] == ["data: [DONE]", ""]
    return [orjson.loads(event.removeprefix("data: ")) for event in data[:-2]]


def choice(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> Any:
    return {
        **HEAD,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }


def test_a_tool_call_stream_field_by_field() -> None:
    items = [
        chunk(0, tool_calls=(NAME,)),
        chunk(1, tool_calls=(ToolCallDelta(0, '{"city": '),)),
        chunk(2, tool_calls=(ToolCallDelta(0, '"Paris"}'),)),
        chunk(
            3, tool_calls=(ToolCallDelta(1, "", id="call_b", name="time"), ToolCallDelta(1, "{}"))
        ),
        chunk(4, tokens=1, finish_reason="tool_calls"),
    ]
    assert events(items) == [
        choice({"role": "assistant", "content": "", "refusal": None}),
        choice(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            }
        ),
        choice({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        choice({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        choice(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "time", "arguments": "{}"},
                    }
                ]
            }
        ),
        choice({}, "tool_calls"),
    ]


def test_merged_chunks_join_one_calls_pieces_and_keep_text() -> None:
    items = [
        chunk(
            0,
            "Checking.",
            tool_calls=(NAME, ToolCallDelta(0, '{"a"'), ToolCallDelta(0, ": 1}")),
            tokens=3,
            finish_reason="tool_calls",
        )
    ]
    assert events(items)[1] == choice(
        {
            "content": "Checking.",
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"a": 1}'},
                }
            ],
        }
    )


def test_logprobs_ride_with_their_tokens() -> None:
    items = [
        chunk(0, "x", logprobs=(LP_X,)),
        chunk(1, "", logprobs=(LP_Y,), finish_reason="length"),
    ]
    entry_x = {
        "token": "x",
        "logprob": -0.5,
        "bytes": [120],
        "top_logprobs": [
            {"token": "x", "logprob": -0.5, "bytes": [120]},
            {"token": "y", "logprob": -1.5, "bytes": [121]},
        ],
    }
    entry_y = {"token": "\ufffd", "logprob": -2.0, "bytes": [226], "top_logprobs": []}
    assert events(items, logprobs=True) == [
        choice({"role": "assistant", "content": "", "refusal": None}),
        choice({"content": "x"}, logprobs={"content": [entry_x], "refusal": None}),
        # A token that holds part of a character shows no text yet, but its logprob goes now.
        choice({}, logprobs={"content": [entry_y], "refusal": None}),
        choice({}, "length"),
    ]


def test_logprobs_are_not_sent_to_a_request_that_did_not_ask() -> None:
    items = [chunk(0, "x", logprobs=(LP_X,), finish_reason="stop")]
    assert events(items)[1] == choice({"content": "x"})


def test_the_non_streamed_body_has_the_calls_and_null_content() -> None:
    builder = CompletionBuilder(logprobs=True)
    builder.feed(chunk(0, tool_calls=(NAME, ToolCallDelta(0, '{"c')), logprobs=(LP_X,)))
    builder.feed(chunk(1, tool_calls=(ToolCallDelta(0, '": 1}'),), finish_reason="tool_calls"))
    body = chat_completion_body(builder, id="c1", created=7, model="m", fingerprint="fp_0123456789")
    assert body["system_fingerprint"] == "fp_0123456789"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "annotations": [],
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"c": 1}'},
                    }
                ],
            },
            "logprobs": {
                "content": [
                    {
                        "token": "x",
                        "logprob": -0.5,
                        "bytes": [120],
                        "top_logprobs": [
                            {"token": "x", "logprob": -0.5, "bytes": [120]},
                            {"token": "y", "logprob": -1.5, "bytes": [121]},
                        ],
                    }
                ],
                "refusal": None,
            },
            "finish_reason": "tool_calls",
        }
    ]


def test_a_text_answer_keeps_its_content_and_has_no_tool_calls_key() -> None:
    builder = CompletionBuilder()
    builder.feed(chunk(0, "hi", finish_reason="stop"))
    message = chat_completion_body(builder, id="c1", created=7, model="m")["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "hi", "refusal": None, "annotations": []}


def indexed(index: int, delta: dict[str, Any], finish: str | None = None) -> Any:
    return {
        **HEAD,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def test_n_choices_stream_with_their_indexes() -> None:
    items = [
        chunk(0, "a", index=0),
        chunk(1, "b", index=1),
        chunk(2, "c", index=1, choice_finish="length"),
        chunk(3, "d", index=0, finish_reason="stop"),
    ]
    role = {"role": "assistant", "content": "", "refusal": None}
    assert events(items, n=2) == [
        indexed(0, role),
        indexed(1, role),
        indexed(0, {"content": "a"}),
        indexed(1, {"content": "b"}),
        indexed(1, {"content": "c"}),
        indexed(1, {}, "length"),
        indexed(0, {"content": "d"}),
        indexed(0, {}, "stop"),
    ]


def test_a_cancel_finishes_every_open_choice() -> None:
    stream = CompletionStream(
        ChunkWriter(id="c1", created=7, model="m", fingerprint="fp_0123456789"), SSE, n=3
    )
    out: list[bytes] = []
    stream.feed(chunk(0, "a", index=2, choice_finish="stop"), out)
    stream.cancel(out)
    finishes = [
        (event["choices"][0]["index"], event["choices"][0]["finish_reason"])
        for event in (
            orjson.loads(e.removeprefix(b"data: ")) for e in b"".join(out).split(b"\n\n")[:-2]
        )
        if event["choices"][0]["finish_reason"]
    ]
    assert finishes == [(2, "stop"), (0, "stop"), (1, "stop")]


def test_the_non_streamed_body_has_every_choice() -> None:
    builder = CompletionBuilder(n=2)
    builder.feed(chunk(0, "x", index=1, choice_finish="length"))
    builder.feed(chunk(1, "y", index=0, finish_reason="stop"))
    body = chat_completion_body(builder, id="c1", created=7, model="m")
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "y", "stop"),
        (1, "x", "length"),
    ]
    assert body["usage"]["completion_tokens"] == 2


def test_a_chunk_for_a_choice_that_does_not_exist_is_a_server_error() -> None:
    builder = CompletionBuilder(n=1)
    assert builder.feed(chunk(0, "x", index=1))
    assert builder.error is not None
    assert builder.error.status == 500
