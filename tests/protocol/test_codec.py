"""The codec: round trips, the exact wire format, and strict decoding of hostile input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import attrs
import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

from protocol.closecodes import CloseCode
from protocol.codec import (
    converter,
    decode,
    decode_gateway_frame,
    decode_runner_frame,
    encode,
    fast_batch,
    fast_chunk,
)
from protocol.errors import FrameError, ProtocolError
from protocol.frames import (
    TAGS,
    Batch,
    CacheHeld,
    Cancel,
    Chunk,
    Drain,
    Echo,
    Error,
    Frame,
    GatewayFrame,
    Generate,
    GenerationStats,
    Hardware,
    Heartbeat,
    Hello,
    LogitBias,
    Message,
    ModelInfo,
    ModelStatus,
    PromptToken,
    RunnerFrame,
    SamplingParams,
    TopLogprob,
    Usage,
    Welcome,
)
from tests.protocol import strategies
from tests.protocol.strategies import (
    FRAME_STRATEGIES,
    hostile_bytes,
    json_values,
    mutated_frame_objects,
)

Decoder = Callable[[bytes | str], Any]

RUNNER_TYPES = frozenset(get_args(RunnerFrame))
GATEWAY_TYPES = frozenset(get_args(GatewayFrame))
DECODERS: tuple[tuple[Decoder, frozenset[type]], ...] = (
    (decode, frozenset(get_args(Frame))),
    (decode_runner_frame, RUNNER_TYPES),
    (decode_gateway_frame, GATEWAY_TYPES),
)


def test_unions_and_tags() -> None:
    assert set(get_args(RunnerFrame)) == {
        Hello,
        Chunk,
        Error,
        Heartbeat,
        Drain,
        Batch,
        ModelStatus,
        CacheHeld,
    }
    assert set(get_args(GatewayFrame)) == {Welcome, Generate, Cancel, Heartbeat}
    assert dict(TAGS) == {
        Hello: "hello",
        Welcome: "welcome",
        Generate: "generate",
        Cancel: "cancel",
        Chunk: "chunk",
        Error: "error",
        Heartbeat: "heartbeat",
        Drain: "drain",
        Batch: "batch",
        ModelStatus: "model_status",
        CacheHeld: "cache_held",
    }
    assert set(FRAME_STRATEGIES) == set(TAGS)


# Round trips.


@pytest.mark.parametrize("cls", list(FRAME_STRATEGIES), ids=lambda cls: TAGS[cls])
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    frame = data.draw(FRAME_STRATEGIES[cls])
    wire = encode(frame)
    for decoder, types in DECODERS:
        if cls not in types:
            continue
        decoded = decoder(wire)
        assert decoded == frame
        assert decoder(wire.decode()) == frame
        # Stable: encoding what was decoded gives the same bytes.
        assert encode(decoded) == wire
        assert type(decoded) is cls
    assert orjson.loads(wire)["type"] == TAGS[cls]


# The wire format, field by field.


def _types(value: Any) -> Any:
    """The JSON value with every scalar replaced by its type, to tell 1 from 1.0 and True."""
    if isinstance(value, dict):
        return {key: _types(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_types(item) for item in value]
    return type(value)


WIRE_EXAMPLES: list[tuple[Frame, dict[str, Any]]] = [
    (
        Hello(
            protocol_version=1,
            runner_name="studio-1",
            models=(ModelInfo("qwen3-0.6b", 40960), ModelInfo("llama-3.2-1b", 131072)),
            max_concurrent=4,
            hardware=Hardware("Apple M2 Ultra", 24, 206158430208, "gpu", "macOS-15.5-arm64"),
        ),
        {
            "type": "hello",
            "protocol_version": 1,
            "runner_name": "studio-1",
            "models": [
                {"id": "qwen3-0.6b", "context_length": 40960},
                {"id": "llama-3.2-1b", "context_length": 131072},
            ],
            "max_concurrent": 4,
            "hardware": {
                "chip": "Apple M2 Ultra",
                "cpu_count": 24,
                "memory_bytes": 206158430208,
                "backend": "gpu",
                "platform": "macOS-15.5-arm64",
            },
        },
    ),
    (
        Welcome(runner_id="rn-7f3a", protocol_version=1, heartbeat_interval=5.0),
        {
            "type": "welcome",
            "runner_id": "rn-7f3a",
            "protocol_version": 1,
            "heartbeat_interval": 5.0,
        },
    ),
    (
        Generate(
            request_id="req-1",
            model="qwen3-0.6b",
            messages=(
                Message("system", "Be brief."),
                Message("user", "Hi ✋", name="ana"),
            ),
            max_tokens=256,
            stop=("\n\n", "END"),
            sampling=SamplingParams(
                temperature=0.7,
                top_p=0.9,
                top_k=40,
                min_p=0.05,
                seed=42,
                presence_penalty=0.5,
                frequency_penalty=-0.5,
                logit_bias=(LogitBias(token=13, bias=-100.0),),
            ),
        ),
        {
            "type": "generate",
            "request_id": "req-1",
            "model": "qwen3-0.6b",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi ✋", "name": "ana"},
            ],
            "max_tokens": 256,
            "stop": ["\n\n", "END"],
            "sampling": {
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 40,
                "min_p": 0.05,
                "seed": 42,
                "presence_penalty": 0.5,
                "frequency_penalty": -0.5,
                "logit_bias": [{"token": 13, "bias": -100.0}],
            },
        },
    ),
    (
        # Defaults are written out, not left for the peer to assume.
        Generate(request_id="req-2", model="m", messages=()),
        {
            "type": "generate",
            "request_id": "req-2",
            "model": "m",
            "messages": [],
            "max_tokens": None,
            "stop": [],
            "sampling": {
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "min_p": 0.0,
                "seed": None,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "logit_bias": [],
            },
        },
    ),
    (
        # A raw prompt (legacy completions): messages empty, the prompt as given.
        Generate(
            request_id="req-3",
            model="m",
            messages=(),
            max_tokens=0,
            prompt_tokens=(1212, 318),
            echo=True,
            prompt_logprobs=True,
        ),
        {
            "type": "generate",
            "request_id": "req-3",
            "model": "m",
            "messages": [],
            "max_tokens": 0,
            "stop": [],
            "sampling": {
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "min_p": 0.0,
                "seed": None,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "logit_bias": [],
            },
            "prompt_tokens": [1212, 318],
            "echo": True,
            "prompt_logprobs": True,
        },
    ),
    (Cancel(request_id="req-1"), {"type": "cancel", "request_id": "req-1"}),
    (
        Chunk("req-1", 0, "Hel", "", 2, Usage(prompt_tokens=12, completion_tokens=2)),
        {
            "type": "chunk",
            "request_id": "req-1",
            "seq": 0,
            "text": "Hel",
            "reasoning": "",
            "tokens": 2,
            "usage": {
                "prompt_tokens": 12,
                "completion_tokens": 2,
                "cached_tokens": 0,
                "reasoning_tokens": 0,
            },
            "finish_reason": None,
            "stats": None,
        },
    ),
    (
        Chunk(
            request_id="req-1",
            seq=3,
            text="",
            reasoning="hmm",
            tokens=1,
            usage=Usage(12, 9, cached_tokens=8, reasoning_tokens=3),
            finish_reason="stop",
            stats=GenerationStats(
                prompt_tps=512.5,
                generation_tps=88.25,
                peak_memory_bytes=1073741824,
                time_to_first_token=0.125,
            ),
        ),
        {
            "type": "chunk",
            "request_id": "req-1",
            "seq": 3,
            "text": "",
            "reasoning": "hmm",
            "tokens": 1,
            "usage": {
                "prompt_tokens": 12,
                "completion_tokens": 9,
                "cached_tokens": 8,
                "reasoning_tokens": 3,
            },
            "finish_reason": "stop",
            "stats": {
                "prompt_tps": 512.5,
                "generation_tps": 88.25,
                "peak_memory_bytes": 1073741824,
                "time_to_first_token": 0.125,
            },
        },
    ),
    (
        # The first chunk of a choice of a request with echo: the first prompt token has no
        # logprob (nothing precedes it), so its key is left off.
        Chunk(
            "req-3",
            0,
            "",
            "",
            0,
            Usage(2, 0),
            echo=Echo(
                "Hi!",
                (
                    PromptToken("Hi", (72, 105)),
                    PromptToken("!", (33,), -2.5, (TopLogprob(",", -0.5, (44,)),)),
                ),
            ),
        ),
        {
            "type": "chunk",
            "request_id": "req-3",
            "seq": 0,
            "text": "",
            "reasoning": "",
            "tokens": 0,
            "usage": {
                "prompt_tokens": 2,
                "completion_tokens": 0,
                "cached_tokens": 0,
                "reasoning_tokens": 0,
            },
            "finish_reason": None,
            "stats": None,
            "echo": {
                "text": "Hi!",
                "tokens": [
                    {"token": "Hi", "bytes": [72, 105]},
                    {
                        "token": "!",
                        "bytes": [33],
                        "logprob": -2.5,
                        "top_logprobs": [{"token": ",", "logprob": -0.5, "bytes": [44]}],
                    },
                ],
            },
        },
    ),
    (
        Error("req-1", "context_length_exceeded", "prompt is 50000 tokens"),
        {
            "type": "error",
            "request_id": "req-1",
            "code": "context_length_exceeded",
            "message": "prompt is 50000 tokens",
        },
    ),
    (
        Error(None, "internal_error", "engine crashed"),
        {
            "type": "error",
            "request_id": None,
            "code": "internal_error",
            "message": "engine crashed",
        },
    ),
    (
        Heartbeat(sent_at=1718000000.25, kv_bytes=4096),
        {
            "type": "heartbeat",
            "sent_at": 1718000000.25,
            "kv_bytes": 4096,
            "kv_limit_bytes": None,
        },
    ),
    (Drain(), {"type": "drain", "reason": "shutting down"}),
    (
        Batch((Chunk("r1", 3, "a", "", 1, Usage(2, 4)),)),
        {
            "type": "batch",
            "frames": [
                {
                    "request_id": "r1",
                    "seq": 3,
                    "text": "a",
                    "reasoning": "",
                    "tokens": 1,
                    "usage": {
                        "prompt_tokens": 2,
                        "completion_tokens": 4,
                        "cached_tokens": 0,
                        "reasoning_tokens": 0,
                    },
                    "finish_reason": None,
                    "stats": None,
                }
            ],
        },
    ),
]


@pytest.mark.parametrize(
    ("frame", "expected"), WIRE_EXAMPLES, ids=[TAGS[type(f)] for f, _ in WIRE_EXAMPLES]
)
def test_wire_format(frame: Frame, expected: dict[str, Any]) -> None:
    wire = encode(frame)
    assert isinstance(wire, bytes)
    obj = orjson.loads(wire)
    assert obj == expected
    assert _types(obj) == _types(expected)
    assert decode(wire) == frame
    # The peer may order keys any way it likes.
    assert decode(orjson.dumps(dict(reversed(list(expected.items()))))) == frame


def test_usage_total_is_derived_not_sent() -> None:
    usage = Usage(prompt_tokens=10, completion_tokens=5)
    assert usage.total_tokens == 15
    assert "total_tokens" not in orjson.loads(encode(Chunk("r", 0, "", "", 0, usage)))["usage"]


def test_decode_fills_defaults_and_widens_ints_to_floats() -> None:
    frame = decode(b'{"type": "generate", "request_id": "r", "model": "m", "messages": []}')
    assert frame == Generate("r", "m", ())
    heartbeat = decode(b'{"type": "heartbeat", "sent_at": 5}')
    assert heartbeat == Heartbeat(5.0)
    assert isinstance(heartbeat, Heartbeat)
    assert type(heartbeat.sent_at) is float


def test_decoders_are_typed_per_direction() -> None:
    wire = encode(Heartbeat(1.0))
    assert decode_runner_frame(wire) == decode_gateway_frame(wire) == Heartbeat(1.0)


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


# --- the per-token fast path ----------------------------------------------------------------


@given(strategies.chunks)
def test_fast_chunk_path_agrees_with_the_converter(chunk: Chunk) -> None:
    obj = orjson.loads(encode(chunk))
    fast = fast_chunk(obj)
    if chunk.stats is None and chunk.matched_stop is None:
        assert fast == chunk  # every plain stats-less chunk takes the fast path
    else:
        assert fast is None
    assert decode_runner_frame(encode(chunk)) == chunk


@given(strategies.mutated_frame_objects())
def test_fast_chunk_path_never_accepts_what_the_converter_refuses(obj: Any) -> None:
    if not isinstance(obj, dict) or obj.get("type") != "chunk":
        return
    fast = fast_chunk(obj)
    if fast is None:
        return
    union: Any = RunnerFrame
    assert converter.structure(obj, union) == fast


@given(strategies.batches)
def test_fast_batch_path_agrees_with_the_converter(batch: Batch) -> None:
    fast = fast_batch(orjson.loads(encode(batch)))
    if all(chunk.stats is None and chunk.matched_stop is None for chunk in batch.frames):
        assert fast == batch
    else:
        assert fast is None
    assert decode_runner_frame(encode(batch)) == batch
