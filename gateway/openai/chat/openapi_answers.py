"""The OpenAPI schemas of what `POST /v1/chat/completions` answers: `CHAT_COMPLETION` (the
non-streaming body) and `CHAT_COMPLETION_CHUNK` (each event of a stream), as
`protocol.openai.chat.response` writes them.

They describe Orchard's answers exactly (no keys beyond these), so a test can hold every body
the protocol builds against them.
"""

from __future__ import annotations

from litestar.openapi.spec import Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openapi import COUNT, INTEGER, NULL, STRING, closed, counts, only, only_or_null

_FINISH_REASONS = ["stop", "length", "tool_calls"]

USAGE = closed(
    [
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ],
    prompt_tokens=COUNT,
    completion_tokens=COUNT,
    total_tokens=COUNT,
    prompt_tokens_details=counts("cached_tokens", "audio_tokens"),
    completion_tokens_details=counts(
        "reasoning_tokens",
        "audio_tokens",
        "accepted_prediction_tokens",
        "rejected_prediction_tokens",
    ),
)

_BYTES = Schema(
    type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=255)
)
_TOP_LOGPROB = closed(
    ["token", "logprob", "bytes"],
    token=STRING,
    logprob=Schema(type=OpenAPIType.NUMBER),
    bytes=_BYTES,
)
_TOKEN_LOGPROB = closed(
    ["token", "logprob", "bytes", "top_logprobs"],
    token=STRING,
    logprob=Schema(type=OpenAPIType.NUMBER),
    bytes=_BYTES,
    top_logprobs=Schema(type=OpenAPIType.ARRAY, items=_TOP_LOGPROB),
)
_LOGPROBS = Schema(
    one_of=[
        NULL,
        closed(
            ["content", "refusal"],
            content=Schema(type=OpenAPIType.ARRAY, items=_TOKEN_LOGPROB),
            refusal=NULL,
        ),
    ],
    description="Null unless the request asked for logprobs.",
)
_FINGERPRINT = Schema(
    type=[OpenAPIType.STRING, OpenAPIType.NULL],
    pattern="^fp_[0-9a-f]{10}$",
    description="The serving configuration (Orchard's version, the model, the runner's engine).",
)


def openai_object(kind: str, required: list[str], **fields: Schema) -> Schema:
    """An OpenAI answer object of `kind` (its id, object, created, model and
    system_fingerprint first), with these `fields` besides, `required` of them required."""
    return closed(
        ["id", "object", "created", "model", "system_fingerprint", *required],
        id=STRING,
        object=only(kind),
        created=INTEGER,
        model=STRING,
        system_fingerprint=_FINGERPRINT,
        **fields,
    )


TOOL_CALL = closed(
    ["id", "type", "function"],
    id=STRING,
    type=only("function"),
    function=closed(["name", "arguments"], name=STRING, arguments=STRING),
)
"""A function call of an assistant message (an answer's, or one in a request's history)."""

# --- the non-streaming body -----------------------------------------------------------------

_MESSAGE = closed(
    ["role", "content", "refusal", "annotations"],
    role=only("assistant"),
    content=Schema(
        type=[OpenAPIType.STRING, OpenAPIType.NULL], description="Null when it only calls tools."
    ),
    refusal=NULL,
    annotations=Schema(type=OpenAPIType.ARRAY, max_items=0),
    tool_calls=Schema(type=OpenAPIType.ARRAY, items=TOOL_CALL, min_items=1),
    reasoning_content=STRING,
)

CHAT_COMPLETION = openai_object(
    "chat.completion",
    ["choices", "usage"],
    choices=Schema(
        type=OpenAPIType.ARRAY,
        items=closed(
            ["index", "message", "logprobs", "finish_reason"],
            index=INTEGER,
            message=_MESSAGE,
            logprobs=_LOGPROBS,
            finish_reason=only(*_FINISH_REASONS),
        ),
        min_items=1,
        max_items=1,
    ),
    usage=USAGE,
)

# --- one event of a stream ------------------------------------------------------------------

_DELTA = closed(
    [],
    role=only("assistant"),
    content=STRING,
    refusal=NULL,
    reasoning_content=STRING,
    tool_calls=Schema(
        type=OpenAPIType.ARRAY,
        items=closed(
            ["index", "function"],
            index=INTEGER,
            id=STRING,
            type=only("function"),
            function=closed(["arguments"], name=STRING, arguments=STRING),
        ),
        min_items=1,
        description="A call's first piece has its id, type and name; later ones only more "
        "arguments.",
    ),
)

CHAT_COMPLETION_CHUNK = openai_object(
    "chat.completion.chunk",
    ["choices"],
    choices=Schema(
        type=OpenAPIType.ARRAY,
        items=closed(
            ["index", "delta", "logprobs", "finish_reason"],
            index=INTEGER,
            delta=_DELTA,
            logprobs=_LOGPROBS,
            finish_reason=only_or_null(*_FINISH_REASONS),
        ),
        max_items=1,
        description="Empty in the last chunk, which carries the whole request's usage.",
    ),
    usage=Schema(
        one_of=[NULL, USAGE],
        description="Only with stream_options.include_usage: null but in the last chunk (the "
        "usage so far in every chunk with continuous_usage_stats).",
    ),
)
