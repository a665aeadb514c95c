"""What test_codec_wire and test_codec_strict share: the codec's three decoders, each with the
frame types it takes, and one example of every frame with the exact JSON it is on the wire."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

from protocol.codec import decode, decode_gateway_frame, decode_runner_frame
from protocol.frames import (
    Batch,
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
    PromptToken,
    RunnerFrame,
    SamplingParams,
    TopLogprob,
    Usage,
    Welcome,
)

Decoder = Callable[[bytes | str], Any]

RUNNER_TYPES = frozenset(get_args(RunnerFrame))
GATEWAY_TYPES = frozenset(get_args(GatewayFrame))
DECODERS: tuple[tuple[Decoder, frozenset[type]], ...] = (
    (decode, frozenset(get_args(Frame))),
    (decode_runner_frame, RUNNER_TYPES),
    (decode_gateway_frame, GATEWAY_TYPES),
)


def generate_wire(request_id: str, **sampling: Any) -> dict[str, Any]:
    """A `Generate` frame of model "m" with no messages on the wire: every default written
    out, `sampling` over the default sampling's fields."""
    return {
        "type": "generate",
        "request_id": request_id,
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
            **sampling,
        },
    }


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
        generate_wire("req-2"),
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
            **generate_wire("req-3"),
            "max_tokens": 0,
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
