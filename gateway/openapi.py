"""The OpenAPI description of `POST /v1/chat/completions`.

The handler reads the raw body (so that every validation error is OpenAI-shaped), which
leaves Litestar nothing to describe; this operation class writes the request body and the
responses into the schema by hand, so `/schema/openapi.json` documents what clients may
send and schema-driven fuzzers (schemathesis) can exercise it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import attrs
from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, Operation, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.config import GatewayConfig
from protocol.openai.request import (
    INT64_MAX,
    INT64_MIN,
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    ROLES,
    SAMPLING_RANGES,
    TOP_K_MIN,
)

_ERROR = Schema(
    type=OpenAPIType.OBJECT,
    required=["error"],
    properties={
        "error": Schema(
            type=OpenAPIType.OBJECT,
            required=["message", "type", "param", "code"],
            properties={
                "message": Schema(type=OpenAPIType.STRING),
                "type": Schema(type=OpenAPIType.STRING),
                "param": Schema(
                    one_of=[Schema(type=OpenAPIType.STRING), Schema(type=OpenAPIType.NULL)]
                ),
                "code": Schema(
                    one_of=[Schema(type=OpenAPIType.STRING), Schema(type=OpenAPIType.NULL)]
                ),
            },
        )
    },
)

_MESSAGE = Schema(
    type=OpenAPIType.OBJECT,
    required=["role", "content"],
    properties={
        "role": Schema(type=OpenAPIType.STRING, enum=list(ROLES)),
        "content": Schema(type=OpenAPIType.STRING, max_length=MAX_PROMPT_CHARS),
        "name": Schema(type=OpenAPIType.STRING),
    },
)


def _number(name: str) -> Schema:
    minimum, maximum = SAMPLING_RANGES[name]
    return Schema(type=OpenAPIType.NUMBER, minimum=minimum, maximum=maximum)


def _max_tokens() -> Schema:
    # The API takes any positive int64; the gateway's ceiling (default shown) is lower.
    limit = attrs.fields(GatewayConfig).max_tokens_limit.default
    return Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=limit)


_STOP_STRING = Schema(type=OpenAPIType.STRING, min_length=1, max_length=MAX_STOP_CHARS)

# Every limit here is the parser's own constant (protocol.openai.request), so the schema and
# the validation cannot disagree.
_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "messages"],
    properties={
        "model": Schema(type=OpenAPIType.STRING, max_length=MAX_MODEL_CHARS),
        "messages": Schema(
            type=OpenAPIType.ARRAY, items=_MESSAGE, min_items=1, max_items=MAX_MESSAGES
        ),
        "stream": Schema(type=OpenAPIType.BOOLEAN),
        "max_tokens": _max_tokens(),
        "max_completion_tokens": _max_tokens(),
        **{name: _number(name) for name in SAMPLING_RANGES},
        "top_k": Schema(type=OpenAPIType.INTEGER, minimum=TOP_K_MIN, maximum=INT64_MAX),
        "seed": Schema(type=OpenAPIType.INTEGER, minimum=INT64_MIN, maximum=INT64_MAX),
        "stop": Schema(
            one_of=[
                _STOP_STRING,
                Schema(
                    type=OpenAPIType.ARRAY,
                    items=_STOP_STRING,
                    min_items=1,
                    max_items=MAX_STOP,
                ),
            ]
        ),
        "user": Schema(type=OpenAPIType.STRING),
    },
    description="OpenAI's CreateChatCompletionRequest, the subset Orchard implements "
    "(see README: where Orchard differs from OpenAI).",
)

_JSON_ERROR = {"application/json": MediaType(schema=_ERROR)}


def _error(description: str) -> OpenAPIResponse:
    return OpenAPIResponse(description=description, content=_JSON_ERROR)


@dataclass
class ChatCompletionsOperation(Operation):
    """Operation for the chat endpoint, with its body and every status it answers."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True, content={"application/json": MediaType(schema=_REQUEST)}
        )
        responses: dict[str, Any] = {
            "200": OpenAPIResponse(
                description="A chat.completion, or with stream=true a text/event-stream of "
                "chat.completion.chunk events ending with data: [DONE].",
                content={
                    "application/json": MediaType(schema=Schema(type=OpenAPIType.OBJECT)),
                    "text/event-stream": MediaType(schema=Schema(type=OpenAPIType.STRING)),
                },
            ),
            "400": _error("Invalid request (the error names the parameter)."),
            "401": _error("Missing or wrong API key."),
            "403": _error("Origin not allowed."),
            "404": _error("No runner serves the model."),
            "413": _error("Body too large."),
            "429": _error("Every runner is busy and the model's queue is full or timed out."),
            "502": _error("The runner was lost."),
            "503": _error("The model's runners are reconnecting, or the gateway is stopping."),
            "504": _error("The runner sent nothing for the stream timeout."),
        }
        self.responses = responses
