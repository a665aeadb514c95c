"""OpenAI's legacy text completions with no event loop: the request, field by field, and the
text_completion objects, streamed (through the chat's CompletionStream) and not."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given

from protocol.core import errors
from protocol.core.errors import ApiError
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import (
    Chunk,
    Echo,
    Error,
    FinishReason,
    Generate,
    LogitBias,
    PromptToken,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from protocol.openai.completions.request import (
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
    CompletionRequest,
    parse_completion_object,
    parse_completion_request,
)
from protocol.openai.completions.response import TextCompletionWriter, text_completion_body
from protocol.openai.sse import SSE
from tests.protocol.strategies import json_values

BASE: dict[str, Any] = {"model": "m", "prompt": "Once upon"}


def body(**fields: Any) -> dict[str, Any]:
    """BASE with `fields` set (a value of ... removes the field)."""
    merged = {**BASE, **fields}
    return {key: value for key, value in merged.items() if value is not ...}


def parse(**fields: Any) -> CompletionRequest:
    return parse_completion_request(orjson.dumps(body(**fields)))


def refusal(data: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_completion_request(data if isinstance(data, bytes) else orjson.dumps(data))
    err = info.value
    assert (err.status, err.type) == (400, "invalid_request_error")
    return err


# --- the request ----------------------------------------------------------------------------


def test_minimal_request_has_the_legacy_defaults() -> None:
    request = parse()
    assert request == CompletionRequest(model="m", prompts=("Once upon",), max_tokens=16)
    assert request.to_generates("cmpl-1") == [
        Generate("cmpl-1", "m", (), max_tokens=16, prompt="Once upon")
    ]


def test_full_request_maps_to_the_exact_generates() -> None:
    request = parse(
        prompt=[[1, 2, 3], [4]],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=0,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=1,
        frequency_penalty=-1,
        seed=7,
        stop=["\n", "END"],
        logit_bias={"13": -100},
        logprobs=2,
        echo=True,
        n=2,
        user="u",
    )
    sampling = SamplingParams(0.5, 0.9, 5, 0.1, 7, 1.0, -1.0, (LogitBias(13, -100.0),))
    expected = [
        Generate(
            f"cmpl-1-{k}",
            "m",
            (),
            max_tokens=0,
            stop=("\n", "END"),
            sampling=sampling,
            logprobs=True,
            top_logprobs=2,
            n=2,
            prompt_tokens=tokens,
            echo=True,
            prompt_logprobs=True,
        )
        for k, tokens in enumerate([(1, 2, 3), (4,)])
    ]
    assert request.to_generates("cmpl-1") == expected
    assert (request.stream, request.include_usage, request.choices) == (True, True, 4)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("", ("",)),
        (None, ("",)),  # OpenAI's default: the start of a document
        (["a", "b"], ("a", "b")),
        ([1, 2], ((1, 2),)),
        ([[1], [2, 3]], ((1,), (2, 3))),
        ([0, 2**31 - 1], ((0, 2**31 - 1),)),
    ],
)
def test_prompt_forms(prompt: Any, expected: tuple[Any, ...]) -> None:
    assert parse(prompt=prompt).prompts == expected


@pytest.mark.parametrize(
    ("fields", "echo", "prompt_logprobs", "logprobs", "top"),
    [
        ({}, False, False, False, 0),
        ({"echo": True}, True, False, False, 0),
        ({"logprobs": 0}, True, False, True, 0),  # the prompt's text: text_offset's start
        ({"logprobs": 5, "echo": True}, True, True, True, 5),
        ({"logprobs": None, "echo": None}, False, False, False, 0),
    ],
)
def test_echo_and_logprobs_in_the_generate(
    fields: dict[str, Any], echo: bool, prompt_logprobs: bool, logprobs: bool, top: int
) -> None:
    (generate,) = parse(**fields).to_generates("c")
    assert (generate.echo, generate.prompt_logprobs) == (echo, prompt_logprobs)
    assert (generate.logprobs, generate.top_logprobs) == (logprobs, top)


def test_best_of_equal_to_n_is_n_choices() -> None:
    assert parse(best_of=3, n=3).n == 3
    assert parse(best_of=1).n == 1
    assert parse(best_of=1, stream=True).stream


def test_limits_are_inclusive() -> None:
    assert len(parse(prompt=["x"] * MAX_PROMPTS).prompts) == MAX_PROMPTS
    assert parse(prompt=[1] * MAX_PROMPT_TOKEN_IDS).prompts == ((1,) * MAX_PROMPT_TOKEN_IDS,)
    assert parse(logprobs=5).logprobs == 5
    assert parse(max_tokens=0).max_tokens == 0


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"prompt": ...}, "prompt", "missing_required_parameter"),
        ({"model": ...}, "model", "missing_required_parameter"),
        ({"model": 1}, "model", "invalid_type"),
        ({"prompt": 1}, "prompt", "invalid_type"),
        ({"prompt": {}}, "prompt", "invalid_type"),
        ({"prompt": []}, "prompt", "empty_array"),
        ({"prompt": [[]]}, "prompt[0]", "empty_array"),
        ({"prompt": ["a", 1]}, "prompt[1]", "invalid_type"),
        ({"prompt": [1, "a"]}, "prompt[1]", "invalid_type"),
        ({"prompt": [1, True]}, "prompt[1]", "invalid_type"),
        ({"prompt": [1.5]}, "prompt[0]", "invalid_type"),
        ({"prompt": [-1]}, "prompt[0]", "integer_below_min_value"),
        ({"prompt": [2**31]}, "prompt[0]", "integer_above_max_value"),
        ({"prompt": [[1], [2, "x"]]}, "prompt[1][1]", "invalid_type"),
        ({"prompt": [[1], 2]}, "prompt[1]", "invalid_type"),
        ({"prompt": [None]}, "prompt[0]", "invalid_type"),
        ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt", "array_above_max_length"),
        ({"prompt": [[1]] * (MAX_PROMPTS + 1)}, "prompt", "array_above_max_length"),
        ({"prompt": [1] * (MAX_PROMPT_TOKEN_IDS + 1)}, "prompt", "array_above_max_length"),
        (
            {"prompt": [[1] * (MAX_PROMPT_TOKEN_IDS // 2 + 1)] * 2},
            "prompt",
            "array_above_max_length",
        ),
        ({"suffix": "end"}, "suffix", "unsupported_parameter"),
        ({"suffix": 1}, "suffix", "invalid_type"),
        ({"best_of": 2}, "best_of", "unsupported_value"),
        ({"best_of": 1, "n": 2}, "best_of", "invalid_value"),
        ({"best_of": 0}, "best_of", "invalid_value"),
        ({"best_of": 21}, "best_of", "integer_above_max_value"),
        ({"best_of": 2, "n": 2, "stream": True}, "best_of", "invalid_parameter_combination"),
        ({"logprobs": True}, "logprobs", "invalid_type"),
        ({"logprobs": 6}, "logprobs", "integer_above_max_value"),
        ({"logprobs": -1}, "logprobs", "integer_below_min_value"),
        ({"echo": 1}, "echo", "invalid_type"),
        ({"max_tokens": -1}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 1.0}, "max_tokens", "invalid_type"),
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"n": 129}, "n", "integer_above_max_value"),
        ({"temperature": 2.5}, "temperature", "decimal_above_max_value"),
        ({"top_p": -0.1}, "top_p", "decimal_below_min_value"),
        ({"presence_penalty": "x"}, "presence_penalty", "invalid_type"),
        ({"seed": 2**63}, "seed", "integer_above_max_value"),
        ({"stop": ""}, "stop", "empty_string"),
        ({"stop": ["a"] * 5}, "stop", "array_above_max_length"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_parameter_combination",
        ),
        ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x", "unknown_parameter"),
        ({"user": 1}, "user", "invalid_type"),
        ({"messages": []}, "messages", "unknown_parameter"),
        ({"tools": []}, "tools", "unknown_parameter"),
        ({"max_completion_tokens": 3}, "max_completion_tokens", "unknown_parameter"),
    ],
)
def test_refusals_name_the_parameter(fields: dict[str, Any], param: str, code: str) -> None:
    err = refusal(body(**fields))
    assert (err.param, err.code) == (param, code)


def test_refusals_say_why() -> None:
    assert refusal(body(suffix="x")).message == (
        "Unsupported parameter: 'suffix' is not supported with this server: inserting text "
        "(a suffix after the completion) is not implemented."
    )
    assert refusal(body(best_of=3)).message == (
        "Unsupported value: 'best_of' does not support 3 with this server. Only the default "
        "(1, the value of n) value is supported."
    )
    assert refusal(body(prompt=[1, "a"])).message == (
        "Invalid type for 'prompt[1]': expected an integer, but got a string instead."
    )


def test_bodies_that_are_not_objects() -> None:
    assert refusal(b"{").code == "invalid_json"
    assert refusal([BASE]).code == "invalid_type"


def test_the_model_is_checked_first() -> None:
    def check(model: str) -> None:
        raise errors.model_not_found(model)

    with pytest.raises(ApiError) as info:
        parse_completion_object({"model": "nope", "prompt": 1, "suffix": "x"}, check)
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_the_gateways_limits() -> None:
    parse(max_tokens=100, n=8).check_ceilings(100, 8)
    with pytest.raises(ApiError) as info:
        parse(max_tokens=101).check_ceilings(100, 8)
    assert (info.value.param, info.value.code) == ("max_tokens", "integer_above_max_value")
    with pytest.raises(ApiError) as info:
        parse(n=9).check_ceilings(100, 8)
    assert (info.value.param, info.value.code) == ("n", "integer_above_max_value")


@given(json_values)
def test_any_json_is_a_request_or_a_400(value: Any) -> None:
    for data in (value, {"model": "m", "prompt": value}, {**BASE, "stop": value}):
        status = 200
        try:
            parse_completion_object(data)
        except ApiError as err:
            status = err.status
        assert status in (200, 400)


# --- the objects ----------------------------------------------------------------------------

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
