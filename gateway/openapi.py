"""The OpenAPI description of `POST /v1/chat/completions`.

The handler reads the raw body (so that every validation error is OpenAI-shaped), which
leaves Litestar nothing to describe; this operation class writes the request body and the
responses into the schema by hand, so `/schema/openapi.json` documents what clients may
send and schema-driven fuzzers (schemathesis) can exercise it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, Operation, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType

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
        "role": Schema(type=OpenAPIType.STRING, enum=["system", "developer", "user", "assistant"]),
        "content": Schema(type=OpenAPIType.STRING, max_length=10_000),
        "name": Schema(type=OpenAPIType.STRING, max_length=64),
    },
)


def _number(minimum: float, maximum: float) -> Schema:
    return Schema(type=OpenAPIType.NUMBER, minimum=minimum, maximum=maximum)


_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "messages"],
    properties={
        "model": Schema(type=OpenAPIType.STRING, max_length=256),
        "messages": Schema(type=OpenAPIType.ARRAY, items=_MESSAGE, min_items=1, max_items=16),
        "stream": Schema(type=OpenAPIType.BOOLEAN),
        "max_tokens": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=32768),
        "max_completion_tokens": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=32768),
        "temperature": _number(0, 2),
        "top_p": _number(0, 1),
        "top_k": Schema(type=OpenAPIType.INTEGER, minimum=-1),
        "min_p": _number(0, 1),
        "presence_penalty": _number(-2, 2),
        "frequency_penalty": _number(-2, 2),
        "seed": Schema(type=OpenAPIType.INTEGER),
        "stop": Schema(
            one_of=[
                Schema(type=OpenAPIType.STRING, min_length=1, max_length=256),
                Schema(
                    type=OpenAPIType.ARRAY,
                    items=Schema(type=OpenAPIType.STRING, min_length=1, max_length=256),
                    min_items=1,
                    max_items=4,
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
