"""OpenAI response building: exact chunks and bodies, checked against the real `openai` SDK."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx2
import hypothesis.strategies as st
import openai
import orjson
import pytest
from hypothesis import given
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from protocol.core import errors
from protocol.core.errors import ApiError
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, FinishReason, Usage
from protocol.openai.chat.response import ChunkWriter, completion
from protocol.openai.errors import error_body
from protocol.openai.objects import openai_finish_reason, system_fingerprint, usage_dict
from protocol.openai.sse import SSE
from tests.protocol.strategies import text

ID = "chatcmpl-abc"
CREATED = 1_700_000_000
MODEL = "llama"
USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4, reasoning_tokens=2)
USAGE_DICT: dict[str, Any] = {
    "prompt_tokens": 10,
    "completion_tokens": 5,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 2,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    },
}
HEAD = {
    "id": ID,
    "object": "chat.completion.chunk",
    "created": CREATED,
    "model": MODEL,
    "system_fingerprint": None,
}
ROLE = {"role": "assistant", "content": "", "refusal": None}


def writer(include_usage: bool = False, continuous: bool = False) -> ChunkWriter:
    return ChunkWriter(
        id=ID,
        created=CREATED,
        model=MODEL,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
    )


def event(data: bytes) -> Any:
    """The JSON of one SSE event, checking its framing."""
    assert data.startswith(b"data: ")
    assert data.endswith(b"\n\n")
    assert data.count(b"\n") == 2  # one event, one line
    return orjson.loads(data[len(b"data: ") : -2])


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**HEAD, "choices": [choice]}


def sdk_chunk(data: bytes) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(event(data))


# --- usage ----------------------------------------------------------------------------------


def test_usage_dict() -> None:
    assert usage_dict(USAGE) == USAGE_DICT
    assert list(usage_dict(USAGE)) == list(USAGE_DICT)
    for key in ("prompt_tokens_details", "completion_tokens_details"):
        assert list(usage_dict(USAGE)[key]) == list(USAGE_DICT[key])
    assert usage_dict(Usage(prompt_tokens=3, completion_tokens=0)) == {
        "prompt_tokens": 3,
        "completion_tokens": 0,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def test_system_fingerprint() -> None:
    fingerprint = system_fingerprint("0.1.0", "llama", "mlx-lm 0.28")
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fingerprint)
    assert system_fingerprint("0.1.0", "llama", "mlx-lm 0.28") == fingerprint
    assert system_fingerprint("0.1.1", "llama", "mlx-lm 0.28") != fingerprint
    assert system_fingerprint("0.1.0", "qwen", "mlx-lm 0.28") != fingerprint
    assert system_fingerprint("0.1.0", "llama", None) != fingerprint


# --- streaming chunks -----------------------------------------------------------------------


def test_exact_bytes_of_a_delta_chunk() -> None:
    # Key order as OpenAI sends it; some clients print or diff raw chunks.
    assert writer().delta("Hi", "", USAGE) == (
        b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"llama","system_fingerprint":null,"choices":[{"index":0,'
        b'"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n'
    )
    fingerprinted = ChunkWriter(id=ID, created=CREATED, model=MODEL, fingerprint="fp_0123456789")
    assert fingerprinted.delta("Hi", "", USAGE) == (
        b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"llama","system_fingerprint":"fp_0123456789","choices":[{"index":0,'
        b'"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n'
    )


def test_exact_bytes_of_the_role_chunk() -> None:
    assert writer().role() == (
        b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"llama","system_fingerprint":null,"choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
    )


def test_role_chunk() -> None:
    assert event(writer().role()) == chunk(ROLE)
    parsed = sdk_chunk(writer().role())
    assert parsed.choices[0].delta.role == "assistant"
    assert parsed.choices[0].delta.content == ""
    assert parsed.choices[0].delta.refusal is None
    assert parsed.system_fingerprint is None
    assert parsed.usage is None


@pytest.mark.parametrize(
    ("content", "reasoning", "delta"),
    [
        ("Hi", "", {"content": "Hi"}),
        ("", "hmm", {"reasoning_content": "hmm"}),
        ("Hi", "hmm", {"reasoning_content": "hmm", "content": "Hi"}),
        ("", "", {}),
        ('"\\\n\x00🦙', "", {"content": '"\\\n\x00🦙'}),
    ],
)
def test_delta_has_only_non_empty_keys(content: str, reasoning: str, delta: dict[str, Any]) -> None:
    data = writer().delta(content, reasoning, USAGE)
    assert event(data) == chunk(delta)
    parsed = sdk_chunk(data)
    assert parsed.choices[0].delta.content == (content or None)
    assert parsed.choices[0].finish_reason is None
    extra = parsed.choices[0].delta.model_extra or {}
    assert extra.get("reasoning_content") == (reasoning or None)


@pytest.mark.parametrize(
    ("reason", "sent"), [("stop", "stop"), ("length", "length"), ("cancelled", "stop")]
)
def test_finish_chunk(reason: FinishReason, sent: str) -> None:
    data = writer().finish(reason, USAGE)
    assert event(data) == chunk({}, sent)
    assert sdk_chunk(data).choices[0].finish_reason == sent
    assert openai_finish_reason(reason) == sent


def test_without_include_usage_there_is_no_usage_key() -> None:
    w = writer()
    for data in (w.role(), w.delta("a", "", USAGE), w.finish("stop", USAGE)):
        assert "usage" not in event(data)
    assert w.usage_chunk(USAGE) == b""
    assert not w.include_usage
    assert not w.continuous_usage_stats


def test_include_usage_puts_null_usage_on_every_chunk() -> None:
    w = writer(include_usage=True)
    assert event(w.role()) == {**chunk(ROLE), "usage": None}
    assert event(w.delta("a", "", USAGE)) == {**chunk({"content": "a"}), "usage": None}
    assert event(w.finish("length", USAGE)) == {**chunk({}, "length"), "usage": None}
    data = w.usage_chunk(USAGE)
    assert event(data) == {**HEAD, "choices": [], "usage": USAGE_DICT}
    parsed = sdk_chunk(data)
    assert parsed.choices == []
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 15
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4
    assert parsed.usage.completion_tokens_details is not None
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 2


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk() -> None:
    w = writer(include_usage=True, continuous=True)
    assert w.continuous_usage_stats
    assert event(w.role()) == {**chunk(ROLE), "usage": None}
    assert event(w.role(USAGE))["usage"] == USAGE_DICT
    assert event(w.delta("a", "", USAGE)) == {**chunk({"content": "a"}), "usage": USAGE_DICT}
    assert event(w.delta("", "", USAGE)) == {**chunk({}), "usage": USAGE_DICT}
    assert event(w.finish("stop", USAGE)) == {**chunk({}, "stop"), "usage": USAGE_DICT}
    assert event(w.usage_chunk(USAGE)) == {**HEAD, "choices": [], "usage": USAGE_DICT}
    sdk_usage = sdk_chunk(w.delta("a", "", USAGE)).usage
    assert sdk_usage is not None
    assert sdk_usage.model_dump(exclude_none=True) == USAGE_DICT


def test_continuous_usage_stats_need_include_usage() -> None:
    w = writer(include_usage=False, continuous=True)
    assert not w.continuous_usage_stats
    assert "usage" not in event(w.delta("a", "", USAGE))


def test_sse_framing_of_an_error_and_the_end() -> None:
    err = errors.server_error("boom")
    assert event(SSE.error(err)) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}
    }
    assert SSE.end("stop", USAGE) == b"data: [DONE]\n\n"
    assert SSE.end(None, None) == b"data: [DONE]\n\n"  # after an error too, as OpenAI


def test_special_characters_in_id_and_model() -> None:
    w = ChunkWriter(id='x"\\y', created=0, model="é/日本\n")
    assert event(w.delta("a", "", USAGE))["model"] == "é/日本\n"
    assert event(w.finish("stop", USAGE))["id"] == 'x"\\y'


usages = st.builds(
    Usage,
    prompt_tokens=st.integers(0, 2**40),
    completion_tokens=st.integers(0, 2**40),
    cached_tokens=st.integers(0, 2**40),
    reasoning_tokens=st.integers(0, 2**40),
)


@given(
    model=text,
    content=text,
    reasoning=text,
    usage=usages,
    include=st.booleans(),
    continuous=st.booleans(),
)
def test_any_text_makes_valid_chunks(
    *, model: str, content: str, reasoning: str, usage: Usage, include: bool, continuous: bool
) -> None:
    w = ChunkWriter(
        id=ID,
        created=CREATED,
        model=model,
        include_usage=include,
        continuous_usage_stats=continuous,
    )
    for data in (w.role(usage), w.delta(content, reasoning, usage), w.finish("stop", usage)):
        parsed = sdk_chunk(data)
        assert parsed.model == model
        assert parsed.id == ID
        assert parsed.created == CREATED
        assert parsed.object == "chat.completion.chunk"
    parsed = sdk_chunk(w.delta(content, reasoning, usage))
    assert (parsed.choices[0].delta.content or "") == content
    assert ((parsed.choices[0].delta.model_extra or {}).get("reasoning_content") or "") == (
        reasoning
    )
    if include:
        sdk_usage = sdk_chunk(w.usage_chunk(usage)).usage
        assert sdk_usage is not None
        assert sdk_usage.model_dump(exclude_none=True) == {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": usage.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }


# --- non-streaming --------------------------------------------------------------------------


def test_completion() -> None:
    body = completion(
        id=ID,
        created=CREATED,
        model=MODEL,
        content="Hello",
        reasoning="",
        finish_reason="length",
        usage=USAGE,
    )
    assert body == {
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
                },
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": USAGE_DICT,
    }
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "usage",
    ]
    assert list(body["choices"][0]["message"]) == ["role", "content", "refusal", "annotations"]
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hello"
    assert parsed.choices[0].finish_reason == "length"
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 15


def test_completion_with_reasoning_and_cancelled() -> None:
    body = completion(
        id=ID,
        created=CREATED,
        model=MODEL,
        content="",
        reasoning="Let me think.",
        finish_reason="cancelled",
        usage=USAGE,
    )
    assert body["choices"][0] == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": "",
            "refusal": None,
            "annotations": [],
            "reasoning_content": "Let me think.",
        },
        "logprobs": None,
        "finish_reason": "stop",
    }
    parsed = ChatCompletion.model_validate(body)
    assert (parsed.choices[0].message.model_extra or {})["reasoning_content"] == "Let me think."


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("err", "status", "type_", "param", "code"),
    [
        (errors.invalid_request("bad", "temperature", "invalid_type"), 400,
         "invalid_request_error", "temperature", "invalid_type"),
        (errors.context_length_exceeded("too long"), 400, "invalid_request_error", "messages",
         "context_length_exceeded"),
        (errors.authentication(), 401, "authentication_error", None, "invalid_api_key"),
        (errors.model_not_found("x"), 404, "invalid_request_error", None, "model_not_found"),
        (errors.too_large(1024), 413, "invalid_request_error", None, "request_too_large"),
        (errors.rate_limited("slow down"), 429, "rate_limit_error", None, "rate_limit_exceeded"),
        (errors.queue_full(), 429, "rate_limit_error", None, "queue_full"),
        (errors.server_error(), 500, "server_error", None, None),
        (errors.unavailable("no runners"), 503, "server_error", None, "service_unavailable"),
    ],
)  # fmt: skip
def test_error_kinds(
    err: ApiError, status: int, type_: str, param: str | None, code: str | None
) -> None:
    assert (err.status, err.type, err.param, err.code) == (status, type_, param, code)
    assert error_body(err) == {
        "error": {"message": err.message, "type": type_, "param": param, "code": code}
    }
    assert str(err) == err.message
    assert err.retry_after is None


def test_model_not_found_message() -> None:
    assert errors.model_not_found("gpt-9").message == (
        "The model `gpt-9` does not exist or you do not have access to it."
    )


def test_retry_after() -> None:
    assert errors.queue_full(retry_after=2.5).retry_after == 2.5
    assert errors.rate_limited("x", retry_after=1).retry_after == 1
    assert errors.unavailable("x", retry_after=3).retry_after == 3


# --- through the real OpenAI SDK ------------------------------------------------------------


def sdk_client(respond: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    transport = httpx2.MockTransport(respond)
    return openai.OpenAI(
        api_key="k",
        base_url="http://gateway.test/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def sse(*events: bytes) -> Callable[[httpx2.Request], httpx2.Response]:
    body = b"".join(events)
    headers = {"content-type": "text/event-stream; charset=utf-8"}
    return lambda _: httpx2.Response(200, content=body, headers=headers)


def test_sdk_reads_a_whole_stream() -> None:
    completion = CompletionStream(
        ChunkWriter(id=ID, created=CREATED, model=MODEL, include_usage=True), SSE
    )
    out: list[bytes] = []
    pieces: list[tuple[str, str, FinishReason | None]] = [
        ("", "think", None),
        ("Hel", "", None),
        ("lo", "", "stop"),
    ]
    for content, reasoning, finish in pieces:
        completion.feed(Chunk("r", 0, content, reasoning, 1, USAGE, finish), out)
    client = sdk_client(sse(*out))
    with client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        received = list(stream)
    assert [c.id for c in received] == [ID] * 6
    assert "".join(c.choices[0].delta.content or "" for c in received if c.choices) == "Hello"
    assert [c.choices[0].finish_reason for c in received if c.choices][-1] == "stop"
    assert received[-1].choices == []
    assert received[-1].usage is not None
    assert received[-1].usage.completion_tokens == 5


def test_sdk_raises_on_an_error_event() -> None:
    completion = CompletionStream(ChunkWriter(id=ID, created=CREATED, model=MODEL), SSE)
    out: list[bytes] = []
    completion.feed(Chunk("r", 0, "a", "", 1, USAGE), out)
    completion.fail(errors.unavailable("the runner went away"), out)
    client = sdk_client(sse(*out))
    with client:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="the runner went away"):
            list(stream)


def test_sdk_reads_a_completion() -> None:
    body = completion(
        id=ID,
        created=CREATED,
        model=MODEL,
        content="Hello",
        reasoning="r",
        finish_reason="stop",
        usage=USAGE,
    )
    client = sdk_client(lambda _: httpx2.Response(200, content=orjson.dumps(body)))
    with client:
        result = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert result.choices[0].message.content == "Hello"
    assert result.usage is not None
    assert result.usage.prompt_tokens == 10


@pytest.mark.parametrize(
    ("err", "exception"),
    [
        (errors.invalid_request("bad", "top_p", "invalid_type"), openai.BadRequestError),
        (errors.authentication(), openai.AuthenticationError),
        (errors.model_not_found("x"), openai.NotFoundError),
        (errors.queue_full(), openai.RateLimitError),
        (errors.server_error(), openai.InternalServerError),
        (errors.unavailable("down"), openai.InternalServerError),
    ],
)
def test_sdk_maps_error_bodies(err: ApiError, exception: type[openai.APIStatusError]) -> None:
    client = sdk_client(
        lambda _: httpx2.Response(err.status, content=orjson.dumps(error_body(err)))
    )
    with client, pytest.raises(exception) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == err.status
    assert info.value.code == err.code
    assert info.value.param == err.param
    assert info.value.type == err.type
    assert err.message in info.value.message
