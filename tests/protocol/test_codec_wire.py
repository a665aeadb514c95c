"""The codec's encoding: the frame unions and tags, round trips, the exact wire format field by
field, and the per-token fast paths agreeing with the converter."""

from __future__ import annotations

from typing import Any, get_args

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

from protocol.codec import (
    converter,
    decode,
    decode_gateway_frame,
    decode_runner_frame,
    encode,
    fast_batch,
    fast_chunk,
)
from protocol.frames import (
    TAGS,
    Batch,
    CacheHeld,
    Cancel,
    Chunk,
    Drain,
    Error,
    Frame,
    GatewayFrame,
    Generate,
    Heartbeat,
    Hello,
    ModelStatus,
    RunnerFrame,
    Usage,
    Welcome,
)
from tests.protocol import strategies
from tests.protocol.codec_cases import DECODERS, WIRE_EXAMPLES
from tests.protocol.strategies import FRAME_STRATEGIES


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
