"""OpenAI's legacy text_completion objects with no event loop: streamed (through the chat's
CompletionStream, SSE framed) and not (a CompletionBuilder's body), with n, echo and logprobs."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from protocol.core.errors import ApiError
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import (
    Chunk,
    Echo,
    Error,
    FinishReason,
    PromptToken,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from protocol.openai.completions.response import TextCompletionWriter, text_completion_body
from protocol.openai.sse import SSE

ID, CREATED, MODEL, FP = "cmpl-1", 1_700_000_000, "m", "fp_0123456789"
HEAD = {
    "id": ID,
    "object": "text_completion",
    "created": CREATED,
    "model": MODEL,
    "system_fingerprint": FP,
}


def usage(completion: int, prompt: int = 2) -> Usage:
    return Usage(prompt, completion)


def usage_dict(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def event(
    text: str,
    index: int = 0,
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        **HEAD,
        "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}],
        **extra,
    }


def stream(*, echo: bool = False, **options: Any) -> CompletionStream:
    n = options.pop("n", 1)
    writer = TextCompletionWriter(ID, CREATED, MODEL, fingerprint=FP, echo=echo, **options)
    return CompletionStream(writer, SSE, n=n)


def sse(messages: list[bytes]) -> list[Any]:
    events: list[Any] = []
    for block in b"".join(messages).split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ")
        payload = block[6:]
        events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def feed_all(s: CompletionStream, items: list[Any]) -> list[Any]:
    out: list[bytes] = []
    for item in items:
        s.feed(item, out)
    return sse(out)


def piece(
    seq: int,
    text: str,
    *,
    index: int = 0,
    finish: FinishReason | None = None,
    choice_finish: FinishReason | None = None,
    logprobs: tuple[TokenLogprob, ...] = (),
    echo: Echo | None = None,
    tokens: int = 1,
) -> Chunk:
    return Chunk(
        "r",
        seq,
        text,
        "",
        tokens,
        usage(seq + 1),
        finish,
        None,
        (),
        logprobs,
        index,
        choice_finish,
        echo,
    )


def test_a_streamed_completion_has_no_role_chunk() -> None:
    got = feed_all(stream(), [piece(0, "Hel"), piece(1, ""), piece(2, "lo", finish="length")])
    assert got == [event("Hel"), event("lo"), event("", finish="length"), "[DONE]"]


def test_include_usage() -> None:
    got = feed_all(stream(include_usage=True), [piece(0, "a"), piece(1, "b", finish="stop")])
    assert got == [
        event("a", usage=None),
        event("b", usage=None),
        event("", finish="stop", usage=None),
        {**HEAD, "choices": [], "usage": usage_dict(usage(2))},
        "[DONE]",
    ]


def test_continuous_usage_stats() -> None:
    got = feed_all(
        stream(include_usage=True, continuous_usage_stats=True),
        [piece(0, ""), piece(1, "b", finish="stop")],
    )
    assert got[0] == event("", usage=usage_dict(usage(1)))  # no text, but a token
    assert got[1] == event("b", usage=usage_dict(usage(2)))


def test_n_choices_streamed() -> None:
    got = feed_all(
        stream(n=2),
        [
            piece(0, "a", index=0),
            piece(1, "b", index=1),
            piece(2, "c", index=1, choice_finish="length"),
            piece(3, "d", index=0, finish="stop"),
        ],
    )
    assert got == [
        event("a", 0),
        event("b", 1),
        event("c", 1),
        event("", 1, "length"),
        event("d", 0),
        event("", 0, "stop"),
        "[DONE]",
    ]


ECHO = Echo(
    "Hi é",
    (
        PromptToken("Hi", (72, 105)),
        PromptToken(" \ufffd", (32, 195), -1.5, (TopLogprob("!", -0.25, (33,)),)),
        PromptToken("\ufffd", (169,), -0.5, (TopLogprob("\ufffd", -0.5, (169,)),)),
    ),
)


def entry(token: str, raw: bytes, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(
        token, logprob, tuple(raw), tuple(TopLogprob(t, v, tuple(t.encode())) for t, v in top)
    )


def test_echo_and_logprobs_streamed() -> None:
    """The prompt comes first, with its tokens (the first with null logprobs); text_offset
    counts characters from the start of the prompt (a token may end inside one)."""
    got = feed_all(
        stream(echo=True, logprobs=True),
        [
            piece(
                0, "!", logprobs=(entry("!", b"!", -0.25, ("!", -0.25), ("?", -2.0)),), echo=ECHO
            ),
            piece(1, " ok", logprobs=(entry(" ok", b" ok", -3.0, ("!", -1.0)),), finish="length"),
        ],
    )
    assert got == [
        event(
            "Hi é!",
            logprobs={
                "tokens": ["Hi", " \ufffd", "\ufffd", "!"],
                "token_logprobs": [None, -1.5, -0.5, -0.25],
                "top_logprobs": [
                    None,
                    {"!": -0.25, " \ufffd": -1.5},
                    {"\ufffd": -0.5},
                    {"!": -0.25, "?": -2.0},
                ],
                "text_offset": [0, 2, 3, 4],
            },
        ),
        event(
            " ok",
            logprobs={
                "tokens": [" ok"],
                "token_logprobs": [-3.0],
                "top_logprobs": [{"!": -1.0, " ok": -3.0}],  # the chosen one is always there
                "text_offset": [5],
            },
        ),
        event("", finish="length"),
        "[DONE]",
    ]


def test_logprobs_without_echo_count_from_the_prompts_end() -> None:
    got = feed_all(
        stream(logprobs=True, n=2),
        [
            piece(0, "!", logprobs=(entry("!", b"!", -0.25),), echo=Echo("Hi é"), index=1),
            piece(1, "?", logprobs=(entry("?", b"?", -1.0),), index=1, finish="stop"),
        ],
    )
    assert [e["choices"][0]["logprobs"] for e in got[:2]] == [
        {
            "tokens": ["!"],
            "token_logprobs": [-0.25],
            "top_logprobs": [{"!": -0.25}],
            "text_offset": [4],
        },
        {
            "tokens": ["?"],
            "token_logprobs": [-1.0],
            "top_logprobs": [{"?": -1.0}],
            "text_offset": [5],
        },
    ]
    assert [e["choices"][0]["text"] for e in got[:2]] == ["!", "?"]


def test_echo_without_logprobs_and_no_tokens() -> None:
    """max_tokens 0 with echo: the prompt, then the finish."""
    got = feed_all(stream(echo=True), [piece(0, "", echo=Echo("Hi"), tokens=0, finish="length")])
    assert got == [event("Hi"), event("", finish="length"), "[DONE]"]


def test_an_error_mid_stream_and_a_cancel() -> None:
    got = feed_all(stream(), [piece(0, "a"), Error("r", "internal_error", "boom")])
    assert got[0] == event("a")
    assert got[1] == {
        "error": {
            "message": "boom",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert got[2] == "[DONE]"
    s = stream(n=2, include_usage=True)
    out: list[bytes] = []
    s.feed(piece(0, "a", index=1), out)
    assert s.cancel(out)
    assert sse(out) == [
        event("a", 1, usage=None),
        event("", 0, "stop", usage=None),
        event("", 1, "stop", usage=None),
        {**HEAD, "choices": [], "usage": usage_dict(usage(1))},
        "[DONE]",
    ]


def test_a_committed_stream_cancelled_before_its_first_chunk() -> None:
    s = stream()
    out: list[bytes] = []
    s.start(out)  # an SSE response that committed to 200: no opening chunk to send
    assert out == []
    s.cancel(out)
    assert sse(out) == [event("", finish="stop"), "[DONE]"]
    never = stream()
    out = []
    never.cancel(out)
    assert sse(out) == ["[DONE]"]


def test_sse_framing_bytes() -> None:
    out: list[bytes] = []
    CompletionStream(TextCompletionWriter(ID, CREATED, MODEL), SSE).feed(piece(0, "a"), out)
    assert out == [
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m",'
        b'"system_fingerprint":null,"choices":[{"text":"a","index":0,"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
    ]


# --- not streamed -------------------------------------------------------------------------------


def build(items: list[Any], n: int = 1, **options: Any) -> dict[str, Any]:
    builder = CompletionBuilder(n=n)
    for item in items:
        builder.feed(item)
    return text_completion_body(
        builder, id=ID, created=CREATED, model=MODEL, fingerprint=FP, **options
    )


def test_a_body() -> None:
    assert build([piece(0, "Hel"), piece(1, "lo", finish="length")]) == {
        **HEAD,
        "choices": [{"text": "Hello", "index": 0, "logprobs": None, "finish_reason": "length"}],
        "usage": usage_dict(usage(2)),
    }


def test_a_body_with_n_echo_and_logprobs() -> None:
    items = [
        piece(0, "!", index=1, echo=ECHO, logprobs=(entry("!", b"!", -0.25),)),
        piece(1, "?", index=0, echo=ECHO, logprobs=(entry("?", b"?", -1.0),)),
        piece(2, "", index=1, choice_finish="stop"),
        piece(3, " x", index=0, logprobs=(entry(" x", b" x", -2.0),), finish="length"),
    ]
    got = build(items, n=2, echo=True, logprobs=True)
    prompt: dict[str, list[Any]] = {
        "tokens": ["Hi", " \ufffd", "\ufffd"],
        "token_logprobs": [None, -1.5, -0.5],
        "top_logprobs": [None, {"!": -0.25, " \ufffd": -1.5}, {"\ufffd": -0.5}],
        "text_offset": [0, 2, 3],
    }
    assert got["choices"] == [
        {
            "text": "Hi é? x",
            "index": 0,
            "logprobs": {
                "tokens": [*prompt["tokens"], "?", " x"],
                "token_logprobs": [*prompt["token_logprobs"], -1.0, -2.0],
                "top_logprobs": [*prompt["top_logprobs"], {"?": -1.0}, {" x": -2.0}],
                "text_offset": [*prompt["text_offset"], 4, 5],
            },
            "finish_reason": "length",
        },
        {
            "text": "Hi é!",
            "index": 1,
            "logprobs": {
                "tokens": [*prompt["tokens"], "!"],
                "token_logprobs": [*prompt["token_logprobs"], -0.25],
                "top_logprobs": [*prompt["top_logprobs"], {"!": -0.25}],
                "text_offset": [*prompt["text_offset"], 4],
            },
            "finish_reason": "stop",
        },
    ]
    # Without echo: the completion only, its offsets still from the prompt's start.
    plain = build(items, n=2, logprobs=True)["choices"][0]
    assert plain["text"] == "? x"
    assert plain["logprobs"]["text_offset"] == [4, 5]


def test_a_failed_body_raises_its_error() -> None:
    with pytest.raises(ApiError) as info:
        build([piece(0, "a"), Error("r", "context_length_exceeded", "too long", "prompt")])
    assert (info.value.status, info.value.param) == (400, "prompt")


def test_an_echo_in_pieces() -> None:
    """A long prompt's echo comes in pieces, before the completion: offsets go on across
    them, and the completion's start after the whole prompt."""
    first = Echo("Hi", (PromptToken("Hi", (72, 105)),))
    second = Echo(" é", (PromptToken(" é", (32, 195, 169), -1.0),))
    items = [
        piece(0, "", echo=first, tokens=0),
        piece(1, "!", echo=second, logprobs=(entry("!", b"!", -0.25),), finish="stop"),
    ]
    got = feed_all(stream(echo=True, logprobs=True), items)
    assert [e["choices"][0]["text"] for e in got[:2]] == ["Hi", " é!"]
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in got[:2]] == [[0], [2, 4]]
    plain = feed_all(stream(logprobs=True), items)
    assert plain[0]["choices"][0]["logprobs"] == {
        "tokens": ["!"],
        "token_logprobs": [-0.25],
        "top_logprobs": [{"!": -0.25}],
        "text_offset": [4],
    }
    body = build(items, echo=True, logprobs=True)["choices"][0]
    assert body["text"] == "Hi é!"
    assert body["logprobs"]["tokens"] == ["Hi", " é", "!"]
    assert body["logprobs"]["text_offset"] == [0, 2, 4]
