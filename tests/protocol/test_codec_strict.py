"""The codec's strict decoding: what is not a frame, a frame going the wrong way, every bad
field named with its path, and hostile input never escaping as anything but FrameError."""

from __future__ import annotations

from typing import Any

import attrs
import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

from protocol.closecodes import CloseCode
from protocol.codec import decode, decode_gateway_frame, decode_runner_frame, encode
from protocol.errors import FrameError, ProtocolError
from protocol.frames import (
    TAGS,
    Cancel,
    Chunk,
    Error,
    Frame,
    Generate,
    GenerationStats,
    Hardware,
    Heartbeat,
    Hello,
    Message,
    ModelInfo,
    Usage,
)
from tests.protocol.codec_cases import DECODERS, RUNNER_TYPES, WIRE_EXAMPLES, Decoder
from tests.protocol.strategies import hostile_bytes, json_values, mutated_frame_objects

# Strict decoding.


def _expect_frame_error(decoder: Decoder, data: bytes | str, *fragments: str) -> FrameError:
    with pytest.raises(FrameError) as info:
        decoder(data)
    error = info.value
    assert error.close_code is CloseCode.MALFORMED_FRAME
    assert isinstance(error, ProtocolError)
    for fragment in fragments:
        assert fragment in str(error)
    assert len(error.reason.encode()) <= 123
    return error


NOT_A_FRAME: dict[str, tuple[bytes | str, str]] = {
    "empty": (b"", "not valid JSON"),
    "truncated": (b'{"type": "heartbeat"', "not valid JSON"),
    "not-utf8": (b"\xff\xfe{}", "not valid JSON"),
    "lone-surrogate-str": ('{"type": "cancel", "request_id": "\ud800"}', "not valid JSON"),
    "lone-surrogate-escape": (b'{"type": "cancel", "request_id": "\\ud800"}', "not valid JSON"),
    "nan": (b'{"type": "heartbeat", "sent_at": NaN}', "not valid JSON"),
    "infinity": (b'{"type": "heartbeat", "sent_at": Infinity}', "not valid JSON"),
    "-infinity": (b'{"type": "heartbeat", "sent_at": -Infinity}', "not valid JSON"),
    "float-overflow": (b'{"type": "heartbeat", "sent_at": 1e400}', "not valid JSON"),
    "array": (b"[]", "must be a JSON object, got list"),
    "string": (b'"hello"', "must be a JSON object, got str"),
    "null": (b"null", "must be a JSON object"),
    "number": (b"42", "must be a JSON object, got int"),
    "missing-type": (b"{}", "needs a string 'type' field"),
    "int-type": (b'{"type": 1}', "needs a string 'type' field"),
    "null-type": (b'{"type": null}', "needs a string 'type' field"),
    "list-type": (b'{"type": ["hello"]}', "needs a string 'type' field"),
    "unknown-type": (b'{"type": "bogus"}', "unknown frame type 'bogus'"),
    "tag-case": (b'{"type": "Heartbeat", "sent_at": 1.0}', "unknown frame type 'Heartbeat'"),
}


@pytest.mark.parametrize(("data", "fragment"), NOT_A_FRAME.values(), ids=list(NOT_A_FRAME))
def test_not_a_frame(data: bytes | str, fragment: str) -> None:
    for decoder, _ in DECODERS:
        _expect_frame_error(decoder, data, fragment)


WRONG_WAY = [
    (frame, decoder)
    for frame, _ in WIRE_EXAMPLES
    for decoder, types in DECODERS
    if type(frame) not in types
]


@pytest.mark.parametrize(
    ("frame", "decoder"),
    WRONG_WAY,
    ids=[f"{TAGS[type(frame)]}-to-{decoder.__name__}" for frame, decoder in WRONG_WAY],
)
def test_frame_going_the_wrong_way(frame: Frame, decoder: Decoder) -> None:
    _expect_frame_error(decoder, encode(frame), f"unknown frame type '{TAGS[type(frame)]}'")


_USAGE = {"prompt_tokens": 1, "completion_tokens": 1}
_MESSAGE = {"role": "user", "content": "hi"}
_HARDWARE = {"chip": "c", "cpu_count": 1, "memory_bytes": 1, "backend": "cpu", "platform": "p"}
_STATS = {"prompt_tps": 1.0, "generation_tps": 1.0, "time_to_first_token": 0.1}


def _frame(tag: str, base: dict[str, Any], changes: dict[str, Any], drop: str) -> bytes:
    fields = {key: value for key, value in {**base, **changes}.items() if key != drop}
    return orjson.dumps({"type": tag, **fields})


def _chunk(drop: str = "", **changes: Any) -> bytes:
    base = {"request_id": "r", "seq": 0, "text": "", "reasoning": "", "tokens": 1}
    return _frame("chunk", {**base, "usage": _USAGE}, changes, drop)


def _generate(drop: str = "", **changes: Any) -> bytes:
    return _frame(
        "generate", {"request_id": "r", "model": "m", "messages": [_MESSAGE]}, changes, drop
    )


def _hello(drop: str = "", **changes: Any) -> bytes:
    base = {"protocol_version": 1, "runner_name": "r", "max_concurrent": 1}
    models = [{"id": "m", "context_length": 8}]
    return _frame("hello", {**base, "models": models, "hardware": _HARDWARE}, changes, drop)


def _cancel(**changes: Any) -> bytes:
    return _frame("cancel", {"request_id": "r"}, changes, "")


def _heartbeat(drop: str = "", **changes: Any) -> bytes:
    return _frame("heartbeat", {"sent_at": 1.0}, changes, drop)


def _error(**changes: Any) -> bytes:
    return _frame(
        "error", {"request_id": "r", "code": "internal_error", "message": "m"}, changes, ""
    )


def _u64_plus_one(data: bytes) -> bytes:
    # orjson will not write an integer past 64 bits, so patch one in.
    return data.replace(b'"seq":0', b'"seq":18446744073709551616')


# Each: the frame, then what the message must contain. A path inside a list item is checked
# as the list's path and the field's name, whatever the index notation.
BAD_FIELDS: dict[str, tuple[bytes, tuple[str, ...]]] = {
    # Missing and extra fields.
    "missing-field": (_heartbeat(drop="sent_at"), ("required field missing @ heartbeat.sent_at",)),
    "missing-object": (_chunk(drop="usage"), ("@ chunk.usage",)),
    "missing-nested": (_chunk(usage={"prompt_tokens": 1}), ("@ chunk.usage.completion_tokens",)),
    "missing-in-hardware": (
        _hello(hardware={k: v for k, v in _HARDWARE.items() if k != "backend"}),
        ("required field missing @ hello.hardware.backend",),
    ),
    "missing-in-list-item": (
        _generate(messages=[{"role": "user"}]),
        ("required field missing", "generate.messages", "content"),
    ),
    "extra-field": (_heartbeat(extra=1), ("extra fields found (extra) @ heartbeat",)),
    "unknown-parameter": (_generate(stream=True), ("extra fields found (stream) @ generate",)),
    "extra-nested": (
        _chunk(usage={**_USAGE, "total_tokens": 2}),
        ("extra fields found (total_tokens) @ chunk.usage",),
    ),
    "extra-in-list-item": (
        _generate(messages=[{**_MESSAGE, "attachments": []}]),
        ("extra fields found (attachments)", "generate.messages"),
    ),
    # Wrong scalar types.
    "bool-for-int": (_chunk(seq=True), ("@ chunk.seq",)),
    "float-for-int": (_chunk(seq=1.0), ("@ chunk.seq",)),
    "str-for-int": (_chunk(seq="0"), ("@ chunk.seq",)),
    "null-for-int": (_chunk(seq=None), ("@ chunk.seq",)),
    "int-past-u64": (_u64_plus_one(_chunk()), ("@ chunk.seq",)),
    "bool-for-float": (_heartbeat(sent_at=True), ("@ heartbeat.sent_at",)),
    "str-for-float": (_heartbeat(sent_at="1.0"), ("@ heartbeat.sent_at",)),
    "int-for-str": (_cancel(request_id=1), ("@ cancel.request_id",)),
    "bool-for-str": (_cancel(request_id=False), ("@ cancel.request_id",)),
    "null-for-str": (_cancel(request_id=None), ("@ cancel.request_id",)),
    "list-for-str": (_cancel(request_id=["r"]), ("@ cancel.request_id",)),
    "int-for-optional-str": (_error(request_id=7), ("@ error.request_id",)),
    "bool-for-optional-int": (_generate(max_tokens=True), ("@ generate.max_tokens",)),
    # Wrong container types.
    "str-for-list": (_generate(stop="\n"), ("@ generate.stop",)),
    "str-for-list-of-objects": (_generate(messages="hi"), ("@ generate.messages",)),
    "object-for-list": (_generate(messages={"0": _MESSAGE}), ("@ generate.messages",)),
    "list-for-object": (_generate(sampling=[]), ("@ generate.sampling",)),
    "str-for-object": (_hello(hardware="m2"), ("@ hello.hardware",)),
    "null-for-object": (_chunk(usage=None), ("@ chunk.usage",)),
    # Wrong types further down.
    "int-in-str-list": (_generate(stop=["a", 1]), ("@ generate.stop",)),
    "str-in-object-list": (_generate(messages=[_MESSAGE, "hi"]), ("@ generate.messages",)),
    "int-for-content": (
        _generate(messages=[{**_MESSAGE, "content": 1}]),
        ("generate.messages", "content"),
    ),
    "str-for-nested-float": (
        _generate(sampling={"temperature": "hot"}),
        ("@ generate.sampling.temperature",),
    ),
    "float-for-nested-optional-int": (
        _generate(sampling={"seed": 1.5}),
        ("@ generate.sampling.seed",),
    ),
    "str-for-int-in-list-item": (
        _generate(sampling={"logit_bias": [{"token": "13", "bias": 1.0}]}),
        ("generate.sampling.logit_bias", "token"),
    ),
    "bool-for-int-in-list-item": (
        _hello(models=[{"id": "m", "context_length": True}]),
        ("hello.models", "context_length"),
    ),
    "float-for-int-in-optional-object": (
        _chunk(stats={**_STATS, "peak_memory_bytes": 1.5}),
        ("@ chunk.stats.peak_memory_bytes",),
    ),
    # Literal values.
    "finish-reason-foo": (_chunk(finish_reason="foo"), ("@ chunk.finish_reason",)),
    "finish-reason-case": (_chunk(finish_reason="STOP"), ("@ chunk.finish_reason",)),
    "finish-reason-empty": (_chunk(finish_reason=""), ("@ chunk.finish_reason",)),
    "finish-reason-int": (_chunk(finish_reason=1), ("@ chunk.finish_reason",)),
    "finish-reason-list": (_chunk(finish_reason=["stop"]), ("@ chunk.finish_reason",)),
    "finish-reason-object": (_chunk(finish_reason={}), ("@ chunk.finish_reason",)),
    "role-function": (
        _generate(messages=[{**_MESSAGE, "role": "function"}]),
        ("generate.messages", "role"),
    ),
    "role-null": (
        _generate(messages=[{**_MESSAGE, "role": None}]),
        ("generate.messages", "role"),
    ),
    "error-code": (_error(code="oops"), ("@ error.code",)),
}


@pytest.mark.parametrize(("data", "fragments"), BAD_FIELDS.values(), ids=list(BAD_FIELDS))
def test_bad_field(data: bytes, fragments: tuple[str, ...]) -> None:
    tag = orjson.loads(data)["type"]
    error = _expect_frame_error(decode, data, f"invalid {tag} frame: ", *fragments)
    assert error.__cause__ is not None
    # The direction-specific decoder says the same.
    runner_tags = {TAGS[cls] for cls in RUNNER_TYPES}
    specific: Decoder = decode_runner_frame if tag in runner_tags else decode_gateway_frame
    assert str(_expect_frame_error(specific, data)) == str(error)


def test_good_examples_of_the_bad_field_helpers_decode() -> None:
    # The tables above change one thing each; unchanged, every base frame is valid.
    chunk = Chunk("r", 0, "", "", 1, Usage(1, 1))
    assert [
        decode(data)
        for data in (_chunk(), _generate(), _hello(), _cancel(), _heartbeat(), _error())
    ] == [
        chunk,
        Generate("r", "m", (Message("user", "hi"),)),
        Hello(1, "r", (ModelInfo("m", 8),), 1, Hardware("c", 1, 1, "cpu", "p")),
        Cancel("r"),
        Heartbeat(1.0),
        Error("r", "internal_error", "m"),
    ]
    # The integer that "float-for-int-in-optional-object" spoils, as an integer.
    decoded = decode(_chunk(stats={**_STATS, "peak_memory_bytes": 1}))
    assert decoded == attrs.evolve(chunk, stats=GenerationStats(1.0, 1.0, 1, 0.1))
    assert isinstance(decoded, Chunk)
    assert decoded.stats is not None
    assert type(decoded.stats.peak_memory_bytes) is int


def test_every_bad_field_is_named() -> None:
    data = _error(request_id=7, code="oops", message=None)
    with pytest.raises(FrameError) as info:
        decode(data)
    message = str(info.value)
    assert message.startswith("invalid error frame: ")
    for path in ("error.request_id", "error.code", "error.message"):
        assert f"@ {path}" in message


# Hostile input never escapes as anything but FrameError.


def _decode_all(data: bytes | str) -> None:
    for decoder, types in DECODERS:
        try:
            frame = decoder(data)
        except FrameError as exc:
            error = exc
        else:
            # Whatever decodes is a real frame of the right direction, and round-trips.
            assert type(frame) in types
            assert decoder(encode(frame)) == frame
            continue
        assert error.close_code is CloseCode.MALFORMED_FRAME
        assert len(error.reason.encode()) <= 123


@given(st.binary() | hostile_bytes())
def test_arbitrary_bytes_raise_only_frame_error(data: bytes) -> None:
    _decode_all(data)


@given(json_values | mutated_frame_objects())
def test_arbitrary_json_raises_only_frame_error(value: Any) -> None:
    data = orjson.dumps(value)
    _decode_all(data)
    _decode_all(data.decode())
