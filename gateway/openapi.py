"""The OpenAPI description of `POST /v1/chat/completions`.

The handler reads the raw body (so that every validation error is OpenAI-shaped), which
leaves Litestar nothing to describe; this operation class writes the request body and the
responses into the schema by hand, so `/schema/openapi.json` documents what clients may
send and schema-driven fuzzers (schemathesis) can exercise it. The 200 answers' schemas are
`gateway.openapi_responses`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

import attrs
from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, Operation, Reference, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.config import GatewayConfig
from gateway.openapi_responses import CHAT_COMPLETION, CHAT_COMPLETION_CHUNK
from protocol.frames import ReasoningEffort
from protocol.openai.request import (
    INT64_MAX,
    INT64_MIN,
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TEMPLATE_KWARGS_BYTES,
    MAX_TOP_LOGPROBS,
    SAMPLING_RANGES,
    TOP_K_MIN,
)
from protocol.openai.tools import MAX_NAME_CHARS, MAX_TOOL_CALLS, MAX_TOOLS, NAME_PATTERN

_STRING = Schema(type=OpenAPIType.STRING)
_BOOLEAN = Schema(type=OpenAPIType.BOOLEAN)
_OBJECT = Schema(type=OpenAPIType.OBJECT)

_ERROR = Schema(
    type=OpenAPIType.OBJECT,
    required=["error"],
    properties={
        "error": Schema(
            type=OpenAPIType.OBJECT,
            required=["message", "type", "param", "code"],
            properties={
                "message": _STRING,
                "type": _STRING,
                "param": Schema(one_of=[_STRING, Schema(type=OpenAPIType.NULL)]),
                "code": Schema(one_of=[_STRING, Schema(type=OpenAPIType.NULL)]),
            },
        )
    },
)


def _only(*values: str) -> Schema:
    return Schema(type=OpenAPIType.STRING, enum=list(values))


def _closed(required: list[str], **properties: Schema | Reference) -> Schema:
    """An object with exactly these keys allowed (the parser refuses unknown ones)."""
    return Schema(
        type=OpenAPIType.OBJECT,
        required=required,
        properties=properties,
        additional_properties=False,
    )


# --- messages (protocol.openai.request._message) --------------------------------------------

_CONTENT = Schema(type=OpenAPIType.STRING, max_length=MAX_PROMPT_CHARS)
_NAME = Schema(type=OpenAPIType.STRING, pattern=NAME_PATTERN, max_length=MAX_NAME_CHARS)

_TOOL_CALL = _closed(
    ["id", "type", "function"],
    id=_STRING,
    type=_only("function"),
    function=_closed(["name", "arguments"], name=_STRING, arguments=_STRING),
)

_PLAIN_MESSAGE = _closed(
    ["role", "content"],
    role=_only("system", "developer", "user"),
    content=_CONTENT,
    name=_STRING,
)
_ASSISTANT_MESSAGE = Schema(
    type=OpenAPIType.OBJECT,
    required=["role"],
    properties={
        "role": _only("assistant"),
        "content": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], max_length=MAX_PROMPT_CHARS),
        "name": _STRING,
        "tool_calls": Schema(type=OpenAPIType.ARRAY, items=_TOOL_CALL, max_items=MAX_TOOL_CALLS),
        "reasoning_content": _STRING,
    },
    additional_properties=False,
    # Content may be null or absent only when the message calls tools.
    any_of=[
        Schema(required=["content"], properties={"content": _STRING}),
        Schema(
            required=["tool_calls"],
            properties={"tool_calls": Schema(type=OpenAPIType.ARRAY, min_items=1)},
        ),
    ],
    description="An earlier answer: its text, the tools it called, or both.",
)
_TOOL_MESSAGE = _closed(
    ["role", "content", "tool_call_id"],
    role=_only("tool"),
    content=_CONTENT,
    tool_call_id=_STRING,
)

# --- tools and output formats (protocol.openai.tools) ---------------------------------------

_TOOL = _closed(
    ["type", "function"],
    type=_only("function"),
    function=_closed(
        ["name"],
        name=_NAME,
        description=_STRING,
        parameters=Schema(type=OpenAPIType.OBJECT, description="A JSON Schema."),
        strict=_BOOLEAN,
    ),
)
_TOOL_CHOICE = Schema(
    one_of=[
        _only("none", "auto", "required"),
        _closed(
            ["type", "function"], type=_only("function"), function=_closed(["name"], name=_NAME)
        ),
    ],
    description='Anything but "none" needs `tools`; a named function must be one of them.',
)
_RESPONSE_FORMAT = Schema(
    one_of=[
        _closed(["type"], type=_only("text")),
        _closed(["type"], type=_only("json_object")),
        _closed(
            ["type", "json_schema"],
            type=_only("json_schema"),
            json_schema=_closed(
                ["name"],
                name=_NAME,
                description=_STRING,
                schema=Schema(type=OpenAPIType.OBJECT, description="A JSON Schema."),
                strict=_BOOLEAN,
            ),
        ),
    ]
)
_WITH_TOOLS = Schema(
    required=["tools"], properties={"tools": Schema(type=OpenAPIType.ARRAY, min_items=1)}
)

# --- the request ----------------------------------------------------------------------------


def _number(name: str) -> Schema:
    minimum, maximum = SAMPLING_RANGES[name]
    return Schema(type=OpenAPIType.NUMBER, minimum=minimum, maximum=maximum)


def _max_tokens() -> Schema:
    # The API takes any positive int64; the gateway's ceiling (default shown) is lower.
    limit = attrs.fields(GatewayConfig).max_tokens_limit.default
    return Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=limit)


_STOP_STRING = Schema(type=OpenAPIType.STRING, min_length=1, max_length=MAX_STOP_CHARS)

# Every limit here is the parser's own constant (protocol.openai.request and .tools), so the
# schema and the validation cannot disagree.
_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "messages"],
    properties={
        "model": Schema(type=OpenAPIType.STRING, max_length=MAX_MODEL_CHARS),
        "messages": Schema(
            type=OpenAPIType.ARRAY,
            items=Schema(one_of=[_PLAIN_MESSAGE, _ASSISTANT_MESSAGE, _TOOL_MESSAGE]),
            min_items=1,
            max_items=MAX_MESSAGES,
        ),
        "stream": _BOOLEAN,
        "max_tokens": _max_tokens(),
        "max_completion_tokens": _max_tokens(),
        **{name: _number(name) for name in SAMPLING_RANGES},
        "top_k": Schema(type=OpenAPIType.INTEGER, minimum=TOP_K_MIN, maximum=INT64_MAX),
        "seed": Schema(type=OpenAPIType.INTEGER, minimum=INT64_MIN, maximum=INT64_MAX),
        "stop": Schema(
            one_of=[
                _STOP_STRING,
                Schema(type=OpenAPIType.ARRAY, items=_STOP_STRING, min_items=0, max_items=MAX_STOP),
            ]
        ),
        "tools": Schema(
            type=OpenAPIType.ARRAY,
            items=_TOOL,
            max_items=MAX_TOOLS,
            description="Function tools; their names must differ.",
        ),
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": Schema(type=OpenAPIType.BOOLEAN, description="Only with `tools`."),
        "response_format": _RESPONSE_FORMAT,
        "logprobs": _BOOLEAN,
        "top_logprobs": Schema(
            type=OpenAPIType.INTEGER,
            minimum=0,
            maximum=MAX_TOP_LOGPROBS,
            description="Only with `logprobs` true.",
        ),
        "reasoning_effort": _only(*get_args(ReasoningEffort)),
        "chat_template_kwargs": Schema(
            type=OpenAPIType.OBJECT,
            description="Extra variables for the model's chat template (vLLM's extension), "
            f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON.",
        ),
        "audio": Schema(
            type=OpenAPIType.OBJECT,
            description="Accepted and ignored while `modalities` asks for no audio.",
        ),
        "user": _STRING,
    },
    # The parameters that only mean something next to another one.
    dependent_schemas={
        "tool_choice": Schema(
            any_of=[Schema(properties={"tool_choice": _only("none")}), _WITH_TOOLS]
        ),
        "parallel_tool_calls": _WITH_TOOLS,
        "top_logprobs": Schema(required=["logprobs"], properties={"logprobs": Schema(const=True)}),
    },
    description="OpenAI's CreateChatCompletionRequest, the subset Orchard implements "
    "(see README: where Orchard differs from OpenAI).",
)

_JSON_ERROR = {"application/json": MediaType(schema=_ERROR)}


@dataclass
class _EventStream(MediaType):
    """A text/event-stream whose `data:` events are JSON objects of one schema: OpenAPI 3.2's
    `itemSchema`, written as an extension because Litestar writes OpenAPI 3.1 (whose
    components.schemas Litestar also overwrites with its own)."""

    item_schema: Schema | None = field(default=None, metadata={"alias": "x-itemSchema"})


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
                "`data:` events (x-itemSchema: a chat.completion.chunk, or an error that ends "
                "the stream), the last of them data: [DONE].",
                content={
                    "application/json": MediaType(schema=CHAT_COMPLETION),
                    "text/event-stream": _EventStream(
                        schema=_STRING, item_schema=Schema(one_of=[CHAT_COMPLETION_CHUNK, _ERROR])
                    ),
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
