"""The OpenAPI description of `POST /v1/chat/completions`.

The handler reads the raw body (so that every validation error is OpenAI-shaped), which
leaves Litestar nothing to describe; this operation class writes the request body and the
responses into the schema by hand, so `/schema/openapi.json` documents what clients may
send and schema-driven fuzzers (schemathesis) can exercise it. The 200 answers' schemas are
`gateway.openapi_responses`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from litestar.openapi.spec import Operation, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openapi_common import (
    _BOOLEAN,
    _DECODING,
    _JSON_SCHEMA,
    _MODEL,
    _PROMPT_TEXT,
    _STRING,
    _TOOL_NAME,
    _closed,
    _generation_responses,
    _json_body,
    _limit,
    _non_empty,
    _only,
    _output_format,
)
from gateway.openapi_responses import _TOOL_CALL, CHAT_COMPLETION, CHAT_COMPLETION_CHUNK
from protocol.core.limits import MAX_MESSAGES, MAX_PROMPT_CHARS
from protocol.core.tools import MAX_TOOLS
from protocol.frames import ReasoningEffort
from protocol.openai.chat.request import MAX_TEMPLATE_KWARGS_BYTES, MAX_TOP_LOGPROBS
from protocol.openai.tools import MAX_TOOL_CALLS

# --- messages (protocol.openai.chat.request._message) --------------------------------------------

_PLAIN_MESSAGE = _closed(
    ["role", "content"],
    role=_only("system", "developer", "user"),
    content=_PROMPT_TEXT,
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
        "reasoning": _STRING,
    },
    additional_properties=False,
    # Content may be null or absent only when the message calls tools.
    any_of=[
        Schema(required=["content"], properties={"content": _STRING}),
        _non_empty("tool_calls"),
    ],
    description="An earlier answer: its text, the tools it called, or both.",
)
_TOOL_MESSAGE = _closed(
    ["role", "content", "tool_call_id"],
    role=_only("tool"),
    content=_PROMPT_TEXT,
    tool_call_id=_STRING,
)

# --- tools and output formats (protocol.openai.tools) ---------------------------------------

_TOOL = _closed(
    ["type", "function"],
    type=_only("function"),
    function=_closed(
        ["name"],
        name=_TOOL_NAME,
        description=_STRING,
        parameters=_JSON_SCHEMA,
        strict=_BOOLEAN,
    ),
)
_TOOLS = Schema(
    type=OpenAPIType.ARRAY,
    items=_TOOL,
    max_items=MAX_TOOLS,
    description="Function tools; their names must differ.",
)
_TOOL_CHOICE = Schema(
    one_of=[
        _only("none", "auto", "required"),
        _closed(
            ["type", "function"],
            type=_only("function"),
            function=_closed(["name"], name=_TOOL_NAME),
        ),
    ],
    description='Anything but "none" needs `tools`; a named function must be one of them.',
)
_RESPONSE_FORMAT = _output_format(
    _closed(
        ["type", "json_schema"],
        type=_only("json_schema"),
        json_schema=_closed(
            ["name"],
            name=_TOOL_NAME,
            description=_STRING,
            schema=_JSON_SCHEMA,
            strict=_BOOLEAN,
        ),
    )
)
_WITH_TOOLS = _non_empty("tools")

# --- the request ----------------------------------------------------------------------------


def _max_tokens() -> Schema:
    # The API takes any positive int64; the gateway's ceiling (default shown) is lower.
    return Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=_limit("max_tokens_limit"))


# Every limit here is the parser's own constant (protocol.openai.chat.request and .tools), so the
# schema and the validation cannot disagree.
_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "messages"],
    properties={
        "model": _MODEL,
        "messages": Schema(
            type=OpenAPIType.ARRAY,
            items=Schema(one_of=[_PLAIN_MESSAGE, _ASSISTANT_MESSAGE, _TOOL_MESSAGE]),
            min_items=1,
            max_items=MAX_MESSAGES,
        ),
        "stream": _BOOLEAN,
        "max_tokens": _max_tokens(),
        "max_completion_tokens": _max_tokens(),
        **_DECODING,
        "tools": _TOOLS,
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


@dataclass
class ChatCompletionsOperation(Operation):
    """Operation for the chat endpoint, with its body and every status it answers."""

    def __post_init__(self) -> None:
        self.request_body = _json_body(_REQUEST)
        self.responses = _generation_responses(
            CHAT_COMPLETION, "chat.completion", CHAT_COMPLETION_CHUNK, "chat.completion.chunk"
        )
