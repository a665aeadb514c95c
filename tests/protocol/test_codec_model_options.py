"""Protocol 5's additions on the wire, exactly: a hello's per-model `defaults`, `draft_model`,
`kv_bits` and `adapter`, and a generate's `sampling.unset`; each left off while it holds its
default, so that a frame without them reads as before."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from protocol.codec import decode, decode_gateway_frame, decode_runner_frame, encode
from protocol.errors import FrameError
from protocol.frames import (
    Generate,
    Hardware,
    Hello,
    ModelInfo,
    SamplingDefaults,
    SamplingParams,
)
from tests.protocol.codec_cases import generate_wire

HARDWARE = Hardware("Apple M2", 8, 17179869184, "gpu", "macOS-15.5-arm64")
HARDWARE_WIRE = {
    "chip": "Apple M2",
    "cpu_count": 8,
    "memory_bytes": 17179869184,
    "backend": "gpu",
    "platform": "macOS-15.5-arm64",
}


def _hello(*models: ModelInfo) -> Hello:
    return Hello(5, "studio", models, 4, HARDWARE)


def _hello_wire(*models: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "hello",
        "protocol_version": 5,
        "runner_name": "studio",
        "models": list(models),
        "max_concurrent": 4,
        "hardware": HARDWARE_WIRE,
    }


def test_a_models_options_on_the_wire() -> None:
    info = ModelInfo(
        "qwen",
        40960,
        defaults=SamplingDefaults(temperature=0.6, top_k=20, max_tokens=512),
        draft_model="qwen-small",
        kv_bits=8,
        adapter="/adapters/legal",
    )
    wire = encode(_hello(info))
    assert orjson.loads(wire) == _hello_wire(
        {
            "id": "qwen",
            "context_length": 40960,
            # Only the defaults set; an int stays an int.
            "defaults": {"temperature": 0.6, "top_k": 20, "max_tokens": 512},
            "draft_model": "qwen-small",
            "kv_bits": 8,
            "adapter": "/adapters/legal",
        }
    )
    assert decode_runner_frame(wire) == _hello(info)
    assert encode(decode(wire)) == wire


def test_every_default_round_trips() -> None:
    every = SamplingDefaults(temperature=0.0, top_p=0.9, top_k=0, min_p=0.05, max_tokens=1)
    info = ModelInfo("m", 8, defaults=every)
    wire = encode(_hello(info))
    assert orjson.loads(wire)["models"][0]["defaults"] == {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "max_tokens": 1,
    }
    assert decode_runner_frame(wire) == _hello(info)


def test_a_model_without_options_is_as_in_protocol_4() -> None:
    wire = encode(_hello(ModelInfo("m", 8)))
    assert orjson.loads(wire) == _hello_wire({"id": "m", "context_length": 8})


def test_an_older_peers_hello_decodes_with_none_for_them() -> None:
    # As a protocol 4 runner wrote it: a loaded model with its engine and size, no options.
    old = _hello_wire(
        {"id": "m", "context_length": 8, "engine": "mlx-lm 0.32.2", "size_bytes": 1024}
    )
    decoded = decode_runner_frame(orjson.dumps(old))
    assert decoded == _hello(ModelInfo("m", 8, "mlx-lm 0.32.2", size_bytes=1024))
    (info,) = decoded.models
    assert (info.defaults, info.draft_model, info.kv_bits, info.adapter) == (None,) * 4


def test_empty_defaults_decode_as_no_default_set() -> None:
    frame = decode_runner_frame(
        orjson.dumps(_hello_wire({"id": "m", "context_length": 8, "defaults": {}}))
    )
    assert frame == _hello(ModelInfo("m", 8, defaults=SamplingDefaults()))


def test_a_bad_default_is_refused_with_its_path() -> None:
    bad = _hello_wire({"id": "m", "context_length": 8, "defaults": {"top_k": "forty"}})
    with pytest.raises(FrameError, match=r"hello\.models\[0\]\.defaults\.top_k"):
        decode_runner_frame(orjson.dumps(bad))
    unknown = _hello_wire({"id": "m", "context_length": 8, "defaults": {"top_n": 3}})
    with pytest.raises(FrameError, match="top_n"):
        decode_runner_frame(orjson.dumps(unknown))


def _generate(sampling: SamplingParams) -> Generate:
    return Generate("r", "m", (), sampling=sampling)


def _generate_wire(**sampling: Any) -> dict[str, Any]:
    return generate_wire("r", **sampling)


def test_a_generates_unset_on_the_wire() -> None:
    frame = _generate(SamplingParams(top_p=0.5, unset=("temperature", "top_k", "min_p")))
    wire = encode(frame)
    assert orjson.loads(wire) == _generate_wire(top_p=0.5, unset=["temperature", "top_k", "min_p"])
    assert decode_gateway_frame(wire) == frame


def test_a_generate_with_nothing_unset_is_as_in_protocol_4() -> None:
    wire = encode(_generate(SamplingParams()))
    assert orjson.loads(wire) == _generate_wire()
    assert decode_gateway_frame(orjson.dumps(_generate_wire())) == _generate(SamplingParams())


def test_an_unset_name_outside_the_four_is_refused() -> None:
    with pytest.raises(FrameError, match=r"generate\.sampling\.unset\[1\]"):
        decode_gateway_frame(orjson.dumps(_generate_wire(unset=["top_p", "seed"])))
