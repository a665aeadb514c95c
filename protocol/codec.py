"""Encode frames to JSON bytes and decode them back, strictly.

One cattrs converter (orjson flavour) with the frame unions configured as tagged unions on
`type`. Decoding is strict: a JSON number is not a string, a bool is not an int, a string is
not a list, unknown keys are refused. Anything malformed raises `FrameError`, whose message
names the offending path.
"""

from __future__ import annotations

from typing import Any, TypeVar, get_args

import cattrs
import orjson
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.strategies import configure_tagged_union

from protocol.errors import FrameError
from protocol.frames import (
    TAGS,
    Batch,
    CacheHeld,
    Chunk,
    Echo,
    Error,
    FinishReason,
    Frame,
    GatewayFrame,
    Generate,
    GenerationStats,
    Hardware,
    Heartbeat,
    Hello,
    Message,
    ModelInfo,
    PromptToken,
    RunnerFrame,
    SamplingDefaults,
    SamplingParams,
    Usage,
)
from protocol.strict import make_strict_converter

T = TypeVar("T")


_OPTIONAL_FIELDS: dict[type, tuple[str, ...]] = {
    # Message before Generate: a class's hook is built with the hooks of its fields' classes.
    Message: ("name", "tool_calls", "tool_call_id", "reasoning"),
    PromptToken: ("logprob", "top_logprobs"),
    Echo: ("tokens",),
    GenerationStats: ("cached_disk_tokens",),  # before Chunk, which holds it
    Chunk: ("tool_calls", "logprobs", "index", "choice_finish", "echo", "matched_stop"),
    SamplingParams: ("unset",),  # before Generate, which holds it
    Generate: (
        "tools",
        "tool_choice",
        "tool_name",
        "parallel_tool_calls",
        "response_format",
        "logprobs",
        "top_logprobs",
        "chat_template_kwargs",
        "reasoning_effort",
        "n",
        "prompt",
        "prompt_tokens",
        "echo",
        "prompt_logprobs",
        "prefix",
    ),
    Error: ("param",),
    SamplingDefaults: ("temperature", "top_p", "top_k", "min_p", "max_tokens"),
    ModelInfo: (
        "engine",
        "state",
        "size_bytes",
        "download",
        "error",
        "defaults",
        "draft_model",
        "kv_bits",
        "adapter",
    ),
    Hardware: ("accelerator", "gpu_cores", "accelerator_memory_bytes", "accelerator_limit_bytes"),
    Hello: ("memory_budget_bytes", "members"),  # after ModelInfo and Hardware, which it holds
    Heartbeat: ("kv_prefix_bytes", "kv_disk_bytes", "kv_disk_limit_bytes", "speculation"),
    CacheHeld: ("added", "removed", "reset"),
}
"""Fields left off the wire while they hold their default: a plain chunk is as small (and
takes the decoder's fast path) whatever features other requests use."""


def _make_converter() -> cattrs.Converter:
    conv = make_strict_converter()
    for cl, names in _OPTIONAL_FIELDS.items():
        overrides: dict[str, Any] = {name: override(omit_if_default=True) for name in names}
        conv.register_unstructure_hook(cl, make_dict_unstructure_fn(cl, conv, **overrides))

    def tag_of(cl: type) -> str:
        return TAGS[cl]

    # The same class may sit in both unions (Heartbeat); each union gets its own hooks.
    for union in (RunnerFrame, GatewayFrame, Frame):
        configure_tagged_union(union, conv, tag_generator=tag_of, tag_name="type")
    return conv


converter = _make_converter()
"""The one converter for the runner protocol."""


def encode(frame: Frame) -> bytes:
    """Serialise a frame to UTF-8 JSON bytes (send them as a text frame).

    Raises `FrameError` for what JSON cannot carry (integers past 64 bits, lone surrogates).
    Senders must keep floats finite: orjson writes NaN and infinities as null, which the
    peer's strict decoder refuses.
    """
    try:
        return orjson.dumps(converter.unstructure(frame, Frame))
    except orjson.JSONEncodeError as exc:
        raise FrameError(f"cannot encode {type(frame).__name__}: {exc}") from exc


def _decode(data: bytes | str, union: Any) -> Any:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise FrameError(f"a frame must be a JSON object, got {type(obj).__name__}")
    tag = obj.get("type")
    if not isinstance(tag, str):
        raise FrameError("a frame needs a string 'type' field")
    if tag not in _TAGS_BY_UNION[id(union)]:
        raise FrameError(f"unknown frame type {tag!r}")
    if tag == "chunk" and (chunk := fast_chunk(obj)) is not None:
        return chunk
    if tag == "batch" and (batch := fast_batch(obj)) is not None:
        return batch
    try:
        return converter.structure(obj, union)
    except Exception as exc:
        messages = "; ".join(cattrs.transform_error(exc, path=tag))
        raise FrameError(f"invalid {tag} frame: {messages}") from exc


_CHUNK_KEYS = frozenset(
    ("type", "request_id", "seq", "text", "reasoning", "tokens", "usage", "finish_reason", "stats")
)
_USAGE_KEYS = frozenset(("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens"))
_FINISH_REASONS = frozenset(get_args(FinishReason))


def fast_chunk(obj: dict[str, Any], keys: frozenset[str] = _CHUNK_KEYS) -> Chunk | None:
    """The per-token frame without cattrs' generic machinery (a quarter of the gateway's
    relay CPU in profiles). Only a complete, well-typed plain chunk (no stats, no optional
    field) takes this path; anything else returns None and goes through the converter, which
    also words the errors. The tests check both paths agree."""
    if obj.keys() != keys or obj["stats"] is not None:
        return None
    usage = obj["usage"]
    rid, seq, text, reasoning, tokens = (
        obj["request_id"],
        obj["seq"],
        obj["text"],
        obj["reasoning"],
        obj["tokens"],
    )
    finish = obj["finish_reason"]
    if (
        type(rid) is not str
        or type(seq) is not int
        or type(text) is not str
        or type(reasoning) is not str
        or type(tokens) is not int
        or type(usage) is not dict
        or usage.keys() != _USAGE_KEYS
        or (finish is not None and (type(finish) is not str or finish not in _FINISH_REASONS))
    ):
        return None
    prompt, completion, cached, thought = (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["cached_tokens"],
        usage["reasoning_tokens"],
    )
    if (
        type(prompt) is not int
        or type(completion) is not int
        or type(cached) is not int
        or type(thought) is not int
    ):
        return None
    reason: Any = finish  # checked against FinishReason above
    return Chunk(
        rid, seq, text, reasoning, tokens, Usage(prompt, completion, cached, thought), reason, None
    )


def fast_batch(obj: dict[str, Any]) -> Batch | None:
    """A batch whose chunks all take the fast path; otherwise None (the converter decides)."""
    frames = obj.get("frames")
    if obj.keys() != _BATCH_KEYS or type(frames) is not list:
        return None
    chunks = []
    for item in frames:
        if type(item) is not dict:
            return None
        chunk = fast_chunk(item, _CHUNK_FIELDS)
        if chunk is None:
            return None
        chunks.append(chunk)
    return Batch(tuple(chunks))


_BATCH_KEYS = frozenset(("type", "frames"))
_CHUNK_FIELDS = _CHUNK_KEYS - {"type"}  # chunks inside a batch carry no tag


_TAGS_BY_UNION: dict[int, frozenset[str]] = {
    id(union): frozenset(TAGS[cl] for cl in get_args(union))
    for union in (RunnerFrame, GatewayFrame, Frame)
}


def decode_runner_frame(data: bytes | str) -> RunnerFrame:
    """Decode a frame a runner sent; raises `FrameError` on anything else."""
    frame: RunnerFrame = _decode(data, RunnerFrame)
    return frame


def decode_gateway_frame(data: bytes | str) -> GatewayFrame:
    """Decode a frame the gateway sent; raises `FrameError` on anything else."""
    frame: GatewayFrame = _decode(data, GatewayFrame)
    return frame


def decode(data: bytes | str) -> Frame:
    """Decode any frame; raises `FrameError`."""
    frame: Frame = _decode(data, Frame)
    return frame
