"""The OpenAPI schemas of what `POST /v1/chat/completions` answers: `CHAT_COMPLETION` (the
non-streaming body) and `CHAT_COMPLETION_CHUNK` (each event of a stream), as
`protocol.openai.chat.response` writes them.

They describe Orchard's answers exactly (no keys beyond these), so a test can hold every body
the protocol builds against them.
"""

from __future__ import annotations

from litestar.openapi.spec import Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openapi_common import (
    _COUNT,
    _INTEGER,
    _NULL,
    _STRING,
    _closed,
    _counts,
    _only,
    _only_or_null,
)

_FINISH_REASONS = ["stop", "length", "tool_calls"]

_USAGE = _closed(
    [
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ],
    prompt_tokens=_COUNT,
    completion_tokens=_COUNT,
    total_tokens=_COUNT,
    prompt_tokens_details=_counts("cached_tokens", "audio_tokens"),
    completion_tokens_details=_counts(
        "reasoning_tokens",
        "audio_tokens",
        "accepted_prediction_tokens",
        "rejected_prediction_tokens",
    ),
)

_BYTES = Schema(
    type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=255)
)
_TOP_LOGPROB = _closed(
    ["token", "logprob", "bytes"],
    token=_STRING,
    logprob=Schema(type=OpenAPIType.NUMBER),
    bytes=_BYTES,
)
_TOKEN_LOGPROB = _closed(
    ["token", "logprob", "bytes", "top_logprobs"],
    token=_STRING,
    logprob=Schema(type=OpenAPIType.NUMBER),
    bytes=_BYTES,
    top_logprobs=Schema(type=OpenAPIType.ARRAY, items=_TOP_LOGPROB),
)
_LOGPROBS = Schema(
    one_of=[
        _NULL,
        _closed(
            ["content", "refusal"],
            content=Schema(type=OpenAPIType.ARRAY, items=_TOKEN_LOGPROB),
            refusal=_NULL,
        ),
    ],
    description="Null unless the request asked for logprobs.",
)
_FINGERPRINT = Schema(
    type=[OpenAPIType.STRING, OpenAPIType.NULL],
    pattern="^fp_[0-9a-f]{10}$",
    description="The serving configuration (Orchard's version, the model, the runner's engine).",
)


def _openai_object(kind: str, required: list[str], **fields: Schema) -> Schema:
    """An OpenAI answer object of `kind` (its id, object, created, model and
    system_fingerprint first), with these `fields` besides, `required` of them required."""
    return _closed(
        ["id", "object", "created", "model", "system_fingerprint", *required],
        id=_STRING,
        object=_only(kind),
        created=_INTEGER,
        model=_STRING,
        system_fingerprint=_FINGERPRINT,
        **fields,
    )


_TOOL_CALL = _closed(
    ["id", "type", "function"],
    id=_STRING,
    type=_only("function"),
    function=_closed(["name", "arguments"], name=_STRING, arguments=_STRING),
)
"""A function call of an assistant message (an answer's, or one in a request's history)."""

# --- the non-streaming body -----------------------------------------------------------------

_MESSAGE = _closed(
    ["role", "content", "refusal", "annotations"],
    role=_only("assistant"),
    content=Schema(
        type=[OpenAPIType.STRING, OpenAPIType.NULL], description="Null when it only calls tools."
    ),
    refusal=_NULL,
    annotations=Schema(type=OpenAPIType.ARRAY, max_items=0),
    tool_calls=Schema(type=OpenAPIType.ARRAY, items=_TOOL_CALL, min_items=1),
    reasoning_content=_STRING,
)

CHAT_COMPLETION = _openai_object(
    "chat.completion",
    ["choices", "usage"],
    choices=Schema(
        type=OpenAPIType.ARRAY,
        items=_closed(
            ["index", "message", "logprobs", "finish_reason"],
            index=_INTEGER,
            message=_MESSAGE,
            logprobs=_LOGPROBS,
            finish_reason=_only(*_FINISH_REASONS),
        ),
        min_items=1,
        max_items=1,
    ),
    usage=_USAGE,
)

# --- one event of a stream ------------------------------------------------------------------

_DELTA = _closed(
    [],
    role=_only("assistant"),
    content=_STRING,
    refusal=_NULL,
    reasoning_content=_STRING,
    tool_calls=Schema(
        type=OpenAPIType.ARRAY,
        items=_closed(
            ["index", "function"],
            index=_INTEGER,
            id=_STRING,
            type=_only("function"),
            function=_closed(["arguments"], name=_STRING, arguments=_STRING),
        ),
        min_items=1,
        description="A call's first piece has its id, type and name; later ones only more "
        "arguments.",
    ),
)

CHAT_COMPLETION_CHUNK = _openai_object(
    "chat.completion.chunk",
    ["choices"],
    choices=Schema(
        type=OpenAPIType.ARRAY,
        items=_closed(
            ["index", "delta", "logprobs", "finish_reason"],
            index=_INTEGER,
            delta=_DELTA,
            logprobs=_LOGPROBS,
            finish_reason=_only_or_null(*_FINISH_REASONS),
        ),
        max_items=1,
        description="Empty in the last chunk, which carries the whole request's usage.",
    ),
    usage=Schema(
        one_of=[_NULL, _USAGE],
        description="Only with stream_options.include_usage: null but in the last chunk (the "
        "usage so far in every chunk with continuous_usage_stats).",
    ),
)
