"""The completion stream and its non-streaming twin, fed items with no event loop: the order
of what a client sees, for every way a request can end, in both framings."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from protocol.core import errors
from protocol.core.errors import ApiError
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk, Error, FinishReason, Usage
from protocol.openai.chat.response import ChunkWriter, chat_completion_body
from protocol.openai.sse import SSE

ID, CREATED, MODEL = "chatcmpl-1", 1_700_000_000, "m"
HEAD = {
    "id": ID,
    "object": "chat.completion.chunk",
    "created": CREATED,
    "model": MODEL,
    "system_fingerprint": None,
}


def usage(completion: int, prompt: int = 7, cached: int = 3, reasoning: int = 0) -> Usage:
    return Usage(prompt, completion, cached, reasoning)


def usage_dict(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": u.reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def chunk(
    seq: int, text: str = "", reasoning: str = "", finish: FinishReason | None = None
) -> Chunk:
    return Chunk("r", seq, text, reasoning, 1, usage(seq + 1), finish)


class Recording:
    """A framing that shows what the stream asked of it."""

    chunk_prefix = b"<"
    chunk_suffix = b">"

    def error(self, err: ApiError) -> bytes:
        return b"error:" + err.message.encode()

    def end(self, finish_reason: FinishReason | None, usage: Usage | None) -> bytes:
        if finish_reason is None:
            return b""  # as the browser socket: no end message after an error
        assert usage is not None
        return f"end:{finish_reason}:{usage.completion_tokens}".encode()


def stream(**options: Any) -> CompletionStream:
    framing = Recording()
    n = options.pop("n", 1)
    writer = ChunkWriter(
        ID, CREATED, MODEL, prefix=framing.chunk_prefix, suffix=framing.chunk_suffix, **options
    )
    return CompletionStream(writer, framing, n=n)


def decode(messages: list[bytes]) -> list[Any]:
    """Chunk objects as dicts, other messages as strings."""
    out: list[Any] = []
    for message in messages:
        if message.startswith(b"<"):
            out.append(orjson.loads(message[1:-1]))
        else:
            out.append(message.decode())
    return out


def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        **HEAD,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


ROLE = choice({"role": "assistant", "content": "", "refusal": None})


def test_a_whole_stream_in_order() -> None:
    s = stream()
    out: list[bytes] = []
    assert not s.feed(chunk(0, "Hel"), out)
    assert not s.feed(chunk(1, reasoning="hmm"), out)
    assert not s.feed(chunk(2, "", ""), out)  # a held-back token: no delta
    assert s.feed(chunk(3, "lo", finish="length"), out)
    assert decode(out) == [
        ROLE,
        choice({"content": "Hel"}),
        choice({"reasoning_content": "hmm"}),
        choice({"content": "lo"}),
        choice({}, "length"),
        "end:length:4",
    ]
    assert s.started
    assert s.over


def test_include_usage_adds_null_usage_and_a_usage_chunk() -> None:
    s = stream(include_usage=True)
    out: list[bytes] = []
    s.feed(chunk(0, "a"), out)
    s.feed(chunk(1, finish="stop"), out)
    got = decode(out)
    assert got[:3] == [
        {**ROLE, "usage": None},
        {**choice({"content": "a"}), "usage": None},
        {**choice({}, "stop"), "usage": None},
    ]
    assert got[3] == {**HEAD, "choices": [], "usage": usage_dict(usage(2))}
    assert got[4] == "end:stop:2"


def test_continuous_usage_stats_and_the_role_chunks_prompt_usage() -> None:
    s = stream(include_usage=True, continuous_usage_stats=True)
    out: list[bytes] = []
    s.feed(chunk(0, "a"), out)
    s.feed(chunk(1), out)  # no text, but a token: still a chunk, for its usage
    got = decode(out)
    assert got[0]["usage"] == usage_dict(Usage(7, 0, 3, 0))  # the prompt only
    assert got[1]["usage"] == usage_dict(usage(1))
    assert got[2] == {**choice({}), "usage": usage_dict(usage(2))}


def test_an_error_after_the_start() -> None:
    s = stream()
    out: list[bytes] = []
    s.feed(chunk(0, "a"), out)
    assert s.feed(errors.server_error("boom"), out)
    assert decode(out) == [ROLE, choice({"content": "a"}), "error:boom"]
    assert s.over


def test_a_runner_error_frame_is_mapped_to_openais_terms() -> None:
    s = CompletionStream(ChunkWriter(id=ID, created=CREATED, model=MODEL), SSE)
    out: list[bytes] = []
    assert s.feed(Error("r", "context_length_exceeded", "too long"), out)
    assert out == [
        b'data: {"error":{"message":"too long","type":"invalid_request_error",'
        b'"param":"messages","code":"context_length_exceeded"}}\n\n',
        b"data: [DONE]\n\n",
    ]
    assert not s.started  # no role chunk without a runner's chunk


def test_start_commits_with_a_role_chunk_before_any_token() -> None:
    s = stream(include_usage=True, continuous_usage_stats=True)
    out: list[bytes] = []
    s.start(out)
    s.start(out)  # once only
    s.feed(chunk(0, "a"), out)
    got = decode(out)
    assert got[0] == {**ROLE, "usage": None}
    assert got[1]["choices"][0]["delta"] == {"content": "a"}
    assert len(got) == 2


@pytest.mark.parametrize("include_usage", [False, True])
def test_cancelled_by_the_runner_ends_like_stop(include_usage: bool) -> None:
    s = stream(include_usage=include_usage)
    out: list[bytes] = []
    s.feed(chunk(0, "a"), out)
    s.feed(chunk(1, finish="cancelled"), out)
    got = decode(out)
    finish = {**choice({}, "stop"), **({"usage": None} if include_usage else {})}
    assert got[2] == finish  # OpenAI has no "cancelled": the chunk says stop
    assert got[-1] == "end:cancelled:2"  # the end message may say more
    assert len(got) == (5 if include_usage else 4)


def test_cancel_before_the_start_sends_only_the_end() -> None:
    s = stream(include_usage=True)
    out: list[bytes] = []
    assert s.cancel(out)
    assert out == [b"end:cancelled:0"]
    assert not s.started
    assert s.over


def test_cancel_after_the_start_finishes_with_the_usage_so_far() -> None:
    s = stream(include_usage=True)
    out: list[bytes] = []
    s.feed(chunk(0, "a"), out)
    s.feed(chunk(1, "b"), out)
    del out[:]
    assert s.cancel(out)
    got = decode(out)
    assert got == [
        {**choice({}, "stop"), "usage": None},
        {**HEAD, "choices": [], "usage": usage_dict(usage(2))},
        "end:cancelled:2",
    ]


def test_nothing_after_the_end() -> None:
    s = stream()
    out: list[bytes] = []
    s.feed(chunk(0, finish="stop"), out)
    sent = len(out)
    assert s.feed(chunk(1, "late"), out)
    assert s.feed(errors.server_error("late"), out)
    assert s.cancel(out)
    s.start(out)
    assert len(out) == sent


def test_sse_framing_end_to_end() -> None:
    s = CompletionStream(ChunkWriter(id=ID, created=CREATED, model=MODEL), SSE)
    out: list[bytes] = []
    s.feed(chunk(0, "hi", finish="stop"), out)
    assert all(m.startswith(b"data: ") and m.endswith(b"\n\n") for m in out)
    assert out[-1] == b"data: [DONE]\n\n"
    assert orjson.loads(out[1][6:]) == choice({"content": "hi"})


# --- CompletionBuilder -----------------------------------------------------------------------


def test_builder_collects_a_completion() -> None:
    b = CompletionBuilder()
    assert not b.feed(chunk(0, "Hel", "r1"))
    assert not b.feed(chunk(1, "lo", "r2"))
    assert b.feed(chunk(2, "", finish="length"))
    assert b.feed(chunk(3, "ignored"))
    assert chat_completion_body(b, id=ID, created=CREATED, model=MODEL) == {
        "id": ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hello",
                    "refusal": None,
                    "annotations": [],
                    "reasoning_content": "r1r2",
                },
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": usage_dict(usage(3)),
    }


def test_builder_raises_the_requests_error() -> None:
    b = CompletionBuilder()
    b.feed(chunk(0, "a"))
    assert b.feed(Error("r", "internal_error", "engine broke"))
    with pytest.raises(ApiError) as info:
        chat_completion_body(b, id=ID, created=CREATED, model=MODEL)
    assert (info.value.status, info.value.message, info.value.code) == (
        500,
        "engine broke",
        "internal_error",
    )


def test_builder_without_an_end_is_a_server_error() -> None:
    b = CompletionBuilder()
    b.feed(chunk(0, "a"))
    with pytest.raises(ApiError) as info:
        chat_completion_body(b, id=ID, created=CREATED, model=MODEL)
    assert info.value.status == 500
