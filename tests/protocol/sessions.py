"""Frames the session tests of both ends build: a runner's hello, a request, a chunk."""

from __future__ import annotations

from protocol.frames import (
    PROTOCOL_VERSION,
    Chunk,
    FinishReason,
    Generate,
    GenerationStats,
    Hardware,
    Hello,
    Message,
    ModelInfo,
    Usage,
)

HARDWARE = Hardware("Apple M2", 8, 16 * 2**30, "gpu", "macOS-15.5-arm64")


USAGE = Usage(prompt_tokens=5, completion_tokens=1)


STATS = GenerationStats(100.0, 50.0, 2**30, 0.25)


def make_hello(
    models: tuple[str, ...] = ("m1", "m2"),
    max_concurrent: int = 2,
    protocol_version: int = PROTOCOL_VERSION,
) -> Hello:
    return Hello(
        protocol_version=protocol_version,
        runner_name="runner-a",
        models=tuple(ModelInfo(model, 4096) for model in models),
        max_concurrent=max_concurrent,
        hardware=HARDWARE,
    )


def generate(request_id: str, model: str = "m1") -> Generate:
    return Generate(request_id=request_id, model=model, messages=(Message("user", "hi"),))


def chunk(request_id: str, seq: int, finish_reason: FinishReason | None = None) -> Chunk:
    stats = STATS if finish_reason is not None else None
    return Chunk(request_id, seq, "x", "", 1, USAGE, finish_reason, stats)
