"""The OpenAPI description of `POST /v1/chat/completions`.

The handler reads the raw body (so that every validation error is OpenAI-shaped), which
leaves Litestar nothing to describe; this operation class writes the request body and the
responses into the schema by hand, so `/schema/openapi.json` documents what clients may
send and schema-driven fuzzers (schemathesis) can exercise it. The 200 answers' schemas are
`gateway.openai.chat.openapi_answers`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from litestar.openapi.spec import Operation, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openai.chat.openapi_answers import CHAT_COMPLETION, CHAT_COMPLETION_CHUNK, TOOL_CALL
from gateway.openapi import (
    BOOLEAN,
    DECODING,
    JSON_SCHEMA,
    MODEL,
    PROMPT_TEXT,
    STRING,
    TOOL_NAME,
    closed,
    generation_responses,
    json_body,
    limit,
    non_empty,
    only,
    output_format,
)
from protocol.core.limits import MAX_MESSAGES, MAX_PROMPT_CHARS
from protocol.core.tools import MAX_TOOLS
from protocol.frames import ReasoningEffort
from protocol.openai.chat.request import MAX_TEMPLATE_KWARGS_BYTES, MAX_TOP_LOGPROBS
from protocol.openai.tools import MAX_TOOL_CALLS

# --- messages (protocol.openai.chat.request._message) --------------------------------------------

_PLAIN_MESSAGE = closed(
    ["role", "content"],
    role=only("system", "developer", "user"),
    content=PROMPT_TEXT,
    name=STRING,
)
_ASSISTANT_MESSAGE = Schema(
    type=OpenAPIType.OBJECT,
    required=["role"],
    properties={
        "role": only("assistant"),
        "content": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], max_length=MAX_PROMPT_CHARS),
        "name": STRING,
        "tool_calls": Schema(type=OpenAPIType.ARRAY, items=TOOL_CALL, max_items=MAX_TOOL_CALLS),
        "reasoning_content": STRING,
        "reasoning": STRING,
    },
    additional_properties=False,
    # Content may be null or absent only when the message calls tools.
    any_of=[
        Schema(required=["content"], properties={"content": STRING}),
        non_empty("tool_calls"),
    ],
    description="An earlier answer: its text, the tools it called, or both.",
)
_TOOL_MESSAGE = closed(
    ["role", "content", "tool_call_id"],
    role=only("tool"),
    content=PROMPT_TEXT,
    tool_call_id=STRING,
)

# --- tools and output formats (protocol.openai.tools) ---------------------------------------

_TOOL = closed(
    ["type", "function"],
    type=only("function"),
    function=closed(
        ["name"],
        name=TOOL_NAME,
        description=STRING,
        parameters=JSON_SCHEMA,
        strict=BOOLEAN,
    ),
)
TOOLS = Schema(
    type=OpenAPIType.ARRAY,
    items=_TOOL,
    max_items=MAX_TOOLS,
    description="Function tools; their names must differ.",
)
_TOOL_CHOICE = Schema(
    one_of=[
        only("none", "auto", "required"),
        closed(
            ["type", "function"],
            type=only("function"),
            function=closed(["name"], name=TOOL_NAME),
        ),
    ],
    description='Anything but "none" needs `tools`; a named function must be one of them.',
)
_RESPONSE_FORMAT = output_format(
    closed(
        ["type", "json_schema"],
        type=only("json_schema"),
        json_schema=closed(
            ["name"],
            name=TOOL_NAME,
            description=STRING,
            schema=JSON_SCHEMA,
            strict=BOOLEAN,
        ),
    )
)
_WITH_TOOLS = non_empty("tools")

# --- the request ----------------------------------------------------------------------------


def _max_tokens() -> Schema:
    # The API takes any positive int64; the gateway's ceiling (default shown) is lower.
    return Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=limit("max_tokens_limit"))


# Every limit here is the parser's own constant (protocol.openai.chat.request and .tools), so the
# schema and the validation cannot disagree.
_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "messages"],
    properties={
        "model": MODEL,
        "messages": Schema(
            type=OpenAPIType.ARRAY,
            items=Schema(one_of=[_PLAIN_MESSAGE, _ASSISTANT_MESSAGE, _TOOL_MESSAGE]),
            min_items=1,
            max_items=MAX_MESSAGES,
        ),
        "stream": BOOLEAN,
        "max_tokens": _max_tokens(),
        "max_completion_tokens": _max_tokens(),
        **DECODING,
        "tools": TOOLS,
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": Schema(type=OpenAPIType.BOOLEAN, description="Only with `tools`."),
        "response_format": _RESPONSE_FORMAT,
        "logprobs": BOOLEAN,
        "top_logprobs": Schema(
            type=OpenAPIType.INTEGER,
            minimum=0,
            maximum=MAX_TOP_LOGPROBS,
            description="Only with `logprobs` true.",
        ),
        "reasoning_effort": only(*get_args(ReasoningEffort)),
        "chat_template_kwargs": Schema(
            type=OpenAPIType.OBJECT,
            description="Extra variables for the model's chat template (vLLM's extension), "
            f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON.",
        ),
        "audio": Schema(
            type=OpenAPIType.OBJECT,
            description="Accepted and ignored while `modalities` asks for no audio.",
        ),
        "user": STRING,
    },
    # The parameters that only mean something next to another one.
    dependent_schemas={
        "tool_choice": Schema(
            any_of=[Schema(properties={"tool_choice": only("none")}), _WITH_TOOLS]
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
        self.request_body = json_body(_REQUEST)
        self.responses = generation_responses(
            CHAT_COMPLETION, "chat.completion", CHAT_COMPLETION_CHUNK, "chat.completion.chunk"
        )
