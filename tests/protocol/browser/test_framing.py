"""The browser socket's framing of one completion: its bytes are exactly `encode()` of the
messages, and a `CompletionStream` framed with it sends what docs/websocket-api.md says."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

from protocol.browser.framing import BrowserFraming
from protocol.browser.messages import (
    ChunkMessage,
    Done,
    ErrorMessage,
    GatewayMessage,
    decode_gateway_message,
    encode,
)
from protocol.core.errors import ApiError, invalid_request, model_not_found, server_error
from protocol.core.stream import CompletionStream, Framing
from protocol.frames import Chunk, Error, FinishReason, Usage
from protocol.openai.chat.response import ChunkWriter
from protocol.openai.errors import error_body
from protocol.openai.objects import usage_dict
from tests.protocol.strategies import finish_reasons, text

request_ids = st.one_of(st.sampled_from(("r1", 'quote"', "back\\slash", "é🦙", "x" * 256)), text)
usages = st.builds(
    Usage,
    prompt_tokens=st.integers(0, 2**40),
    completion_tokens=st.integers(0, 2**40),
    cached_tokens=st.integers(0, 2**40),
    reasoning_tokens=st.integers(0, 2**40),
)
api_errors = st.builds(
    ApiError,
    status=st.sampled_from((400, 404, 429, 500, 503)),
    message=text,
    type=text,
    param=st.none() | text,
    code=st.none() | text,
)


def test_is_a_framing() -> None:
    framing: Framing = BrowserFraming("r1")  # mypy checks the protocol
    assert framing.chunk_prefix == b'{"type":"chunk","request_id":"r1","chunk":'
    assert framing.chunk_suffix == b"}"
    # Plain attributes: read once per token.
    assert type(BrowserFraming("r1").chunk_prefix) is bytes
    assert type(BrowserFraming("r1").chunk_suffix) is bytes


@given(rid=request_ids, chunk=st.dictionaries(text, text, max_size=3))
def test_chunk_bytes_are_a_chunk_message(rid: str, chunk: dict[str, Any]) -> None:
    framing = BrowserFraming(rid)
    wire = framing.chunk_prefix + orjson.dumps(chunk) + framing.chunk_suffix
    assert wire == encode(ChunkMessage(rid, chunk))


@given(rid=request_ids, err=api_errors)
def test_error_bytes_are_an_error_message(rid: str, err: ApiError) -> None:
    assert BrowserFraming(rid).error(err) == encode(ErrorMessage(rid, error_body(err)["error"]))


@given(rid=request_ids, reason=finish_reasons, usage=usages)
def test_end_bytes_are_a_done_message(rid: str, reason: FinishReason, usage: Usage) -> None:
    assert BrowserFraming(rid).end(reason, usage) == encode(Done(rid, reason, usage_dict(usage)))


def test_end_exact_bytes() -> None:
    assert BrowserFraming("r1").end("cancelled", Usage(15, 3, 5, 1)) == (
        b'{"type":"done","request_id":"r1","finish_reason":"cancelled","usage":'
        b'{"prompt_tokens":15,"completion_tokens":3,"total_tokens":18,'
        b'"prompt_tokens_details":{"cached_tokens":5,"audio_tokens":0},'
        b'"completion_tokens_details":{"reasoning_tokens":1,"audio_tokens":0,'
        b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}'
    )


def test_no_done_after_an_error() -> None:
    assert BrowserFraming("r1").end(None, None) == b""


# A whole completion through CompletionStream.

ID, CREATED, MODEL = "chatcmpl-1", 1795998132, "orchard-demo"


def _stream(rid: str, include_usage: bool = False) -> CompletionStream:
    framing = BrowserFraming(rid)
    writer = ChunkWriter(
        ID,
        CREATED,
        MODEL,
        include_usage,
        prefix=framing.chunk_prefix,
        suffix=framing.chunk_suffix,
    )
    return CompletionStream(writer, framing)


def _bare(include_usage: bool = False) -> ChunkWriter:
    """The chat.completion.chunk objects, rendered bare, to compare with."""
    return ChunkWriter(ID, CREATED, MODEL, include_usage, prefix=b"", suffix=b"")


def _decoded(out: list[bytes]) -> list[GatewayMessage]:
    return [decode_gateway_message(data) for data in out]


def chunk(seq: int, text: str, finish: FinishReason | None = None) -> Chunk:
    return Chunk("runner-rid", seq, text, "", 1, Usage(15, seq + 1, 5, 0), finish)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_completion(include_usage: bool, finish: FinishReason) -> None:
    stream, bare = _stream("r1", include_usage), _bare(include_usage)
    out: list[bytes] = []
    assert not stream.feed(chunk(0, "Nov"), out)
    assert stream.feed(chunk(1, "r", finish), out)
    usage = Usage(15, 2, 5, 0)
    expected: list[GatewayMessage] = [
        ChunkMessage("r1", orjson.loads(bare.role(None))),
        ChunkMessage("r1", orjson.loads(bare.delta("Nov", "", Usage(15, 1, 5, 0)))),
        ChunkMessage("r1", orjson.loads(bare.delta("r", "", usage))),
        ChunkMessage("r1", orjson.loads(bare.finish(finish, usage))),
    ]
    if include_usage:
        expected.append(ChunkMessage("r1", orjson.loads(bare.usage_chunk(usage))))
    expected.append(Done("r1", finish, usage_dict(usage)))
    assert _decoded(out) == expected
    assert orjson.loads(out[0])["chunk"]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
        "refusal": None,
    }


def test_an_error_ends_with_the_error_only() -> None:
    stream = _stream("r1")
    out: list[bytes] = []
    stream.feed(chunk(0, "a"), out)
    assert stream.feed(Error("runner-rid", "internal_error", "boom"), out)
    decoded = _decoded(out)
    assert [type(message) for message in decoded] == [ChunkMessage, ChunkMessage, ErrorMessage]
    assert decoded[-1] == ErrorMessage(
        "r1", {"message": "boom", "type": "server_error", "param": None, "code": "internal_error"}
    )


@pytest.mark.parametrize("err", [model_not_found("nope"), invalid_request("bad", "x", "y")])
def test_an_error_before_any_chunk(err: ApiError) -> None:
    out: list[bytes] = []
    assert _stream('r"2').fail(err, out)
    assert _decoded(out) == [ErrorMessage('r"2', error_body(err)["error"])]


def test_a_cancel_before_any_chunk_is_done_with_zero_usage() -> None:
    out: list[bytes] = []
    assert _stream("r1").cancel(out)
    assert _decoded(out) == [Done("r1", "cancelled", usage_dict(Usage(0, 0)))]


def test_a_cancelled_generation_finishes_with_stop_and_done_says_cancelled() -> None:
    stream = _stream("r1", include_usage=True)
    out: list[bytes] = []
    stream.feed(chunk(0, "a"), out)
    stream.feed(chunk(1, "", "cancelled"), out)
    decoded = _decoded(out)
    assert decoded[-1] == Done("r1", "cancelled", usage_dict(Usage(15, 2, 5, 0)))
    finishes = [
        choice["finish_reason"]
        for message in decoded
        if isinstance(message, ChunkMessage)
        for choice in message.chunk["choices"]
    ]
    # The finish chunk says "stop" (OpenAI has no "cancelled"); the done says cancelled.
    assert finishes == [None, None, "stop"]


@given(
    rid=request_ids,
    texts=st.lists(text, min_size=1, max_size=5),
    finish=finish_reasons,
    include_usage=st.booleans(),
    fail=st.none() | st.just(server_error()),
)
def test_every_message_decodes_exactly(
    rid: str, texts: list[str], finish: FinishReason, include_usage: bool, fail: ApiError | None
) -> None:
    stream = _stream(rid, include_usage)
    out: list[bytes] = []
    for seq, piece in enumerate(texts[:-1]):
        stream.feed(chunk(seq, piece), out)
    if fail is None:
        stream.feed(chunk(len(texts) - 1, texts[-1], finish), out)
    else:
        stream.fail(fail, out)
    decoded = _decoded(out)
    # Re-encoding gives the very bytes sent: nothing in them but the message's fields.
    assert [encode(message) for message in decoded] == out
    assert all(
        isinstance(message, ChunkMessage | Done | ErrorMessage) and message.request_id == rid
        for message in decoded
    )
    *chunks, last = decoded
    assert all(type(message) is ChunkMessage for message in chunks)
    assert isinstance(last, ErrorMessage if fail is not None else Done)
