"""The OpenAPI description of Anthropic's Messages API: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, as gateway.openai.chat.openapi describes the chat endpoint.

The request bodies are what protocol.anthropic.request accepts, with its own limits (closed
objects: the parser refuses unknown fields); the answers are what protocol.anthropic.stream
writes (a `message`, or its server-sent events), exactly; errors are Anthropic's
`{"type": "error", "error": {type, message}}`, each status with the type
protocol.anthropic.errors gives it. Rules a JSON Schema cannot state (no final assistant
turn, distinct tool names, a thinking budget below max_tokens, the prompt's total length)
are in the descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from litestar.openapi.spec import OpenAPIResponse, Operation, Reference, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openapi import (
    BOOLEAN,
    COUNT,
    EMPTY_STRING,
    INT64_COUNT,
    JSON_SCHEMA,
    MODEL,
    NULL,
    OBJECT,
    PROMPT_TEXT,
    STOP_STRING,
    STRING,
    UNIMPLEMENTED_NULL,
    closed,
    counts,
    json_body,
    json_response,
    limit,
    named_event,
    non_empty,
    only,
    streamed_response,
    with_server_error,
)
from protocol.anthropic.errors import ERROR_TYPES, error_type
from protocol.anthropic.request import (
    MAX_BLOCKS,
    MAX_STOP_SEQUENCES,
    MAX_TOOLS,
    MIN_THINKING_BUDGET,
)
from protocol.anthropic.stream import StopReason
from protocol.core.limits import INT64_MAX, MAX_MESSAGES, MAX_PROMPT_CHARS

# --- errors ---------------------------------------------------------------------------------


def _error_schema(kind: Schema) -> Schema:
    return closed(
        ["type", "error"],
        type=only("error"),
        error=closed(["type", "message"], type=kind, message=STRING),
    )


ERROR = _error_schema(only(*sorted({*ERROR_TYPES.values(), "invalid_request_error", "api_error"})))
"""Any Anthropic error (an `error` event may end a stream with any of them)."""


def _error(status: str, description: str) -> OpenAPIResponse:
    """An error response: its `type` is the one Anthropic gives the status."""
    return json_response(description, _error_schema(only(error_type(int(status)))))


_SERVER_ERROR = (
    "The runner failed, or its answer cannot be written as a message (a tool call whose "
    "arguments are not a JSON object; a request cancelled by the gateway)."
)


def _errors() -> dict[str, OpenAPIResponse]:
    return {status: _error(status, why) for status, why in with_server_error(_SERVER_ERROR).items()}


# --- the request (protocol.anthropic.request) -----------------------------------------------

_CACHE_CONTROL = closed(["type"], type=only("ephemeral"), ttl=only("5m", "1h"))
_TEXT_BLOCK = closed(
    ["type", "text"],
    type=only("text"),
    text=PROMPT_TEXT,
    cache_control=_CACHE_CONTROL,
    citations=UNIMPLEMENTED_NULL,
)
_TEXT_BLOCKS = Schema(type=OpenAPIType.ARRAY, items=_TEXT_BLOCK, max_items=MAX_BLOCKS)
_TOOL_RESULT = closed(
    ["type", "tool_use_id"],
    type=only("tool_result"),
    tool_use_id=STRING,
    content=Schema(
        one_of=[PROMPT_TEXT, Schema(type=OpenAPIType.ARRAY, items=_TEXT_BLOCK)],
        description="The result, which the model reads (an error too: `is_error` has no "
        "counterpart in the chat template).",
    ),
    is_error=BOOLEAN,
    cache_control=_CACHE_CONTROL,
)
_TOOL_USE = closed(
    ["type", "id", "name", "input"],
    type=only("tool_use"),
    id=STRING,
    name=STRING,
    input=OBJECT,
    cache_control=_CACHE_CONTROL,
)
_THINKING_BLOCK = closed(
    ["type", "thinking"],
    type=only("thinking"),
    thinking=STRING,
    signature=STRING,
)
"""The reasoning of the turn it is in, given back to the chat template (which decides
whether it is rendered)."""
_REDACTED_THINKING = closed(["type"], type=only("redacted_thinking"), data=STRING)


def _message(role: str, *blocks: Schema) -> Schema:
    return closed(
        ["role", "content"],
        role=only(role),
        content=Schema(
            one_of=[
                PROMPT_TEXT,
                Schema(
                    type=OpenAPIType.ARRAY,
                    items=Schema(one_of=list(blocks)),
                    max_items=MAX_BLOCKS,
                ),
            ]
        ),
    )


_MESSAGES = Schema(
    type=OpenAPIType.ARRAY,
    items=Schema(
        one_of=[
            _message("user", _TEXT_BLOCK, _TOOL_RESULT),
            _message("assistant", _TEXT_BLOCK, _TOOL_USE, _THINKING_BLOCK, _REDACTED_THINKING),
        ]
    ),
    min_items=1,
    max_items=MAX_MESSAGES,
    description="The conversation; the last message is the user's (a final assistant "
    "message, a prefill, is refused: the chat template opens a new turn). System, messages "
    f"and tool results have at most {MAX_PROMPT_CHARS} characters in all.",
)
_SYSTEM = Schema(one_of=[PROMPT_TEXT, _TEXT_BLOCKS], description="The system prompt.")
_TOOL = closed(
    ["name", "input_schema"],
    type=only("custom"),
    name=Schema(type=OpenAPIType.STRING, pattern="^[a-zA-Z0-9_-]{1,128}$"),
    description=STRING,
    input_schema=Schema(
        type=OpenAPIType.OBJECT,
        required=["type"],
        properties={"type": Schema(const="object")},
        description="A JSON Schema of an object.",
    ),
    cache_control=_CACHE_CONTROL,
    strict=BOOLEAN,
)
_TOOLS = Schema(
    type=OpenAPIType.ARRAY,
    items=_TOOL,
    max_items=MAX_TOOLS,
    description="Client tools; their names must differ (server tools are not implemented).",
)
_SERIAL = Schema(type=OpenAPIType.BOOLEAN, description="True: at most one tool call.")
_TOOL_CHOICE = Schema(
    one_of=[
        closed(["type"], type=only("auto"), disable_parallel_tool_use=_SERIAL),
        closed(["type"], type=only("any"), disable_parallel_tool_use=_SERIAL),
        closed(["type", "name"], type=only("tool"), name=STRING, disable_parallel_tool_use=_SERIAL),
        closed(["type"], type=only("none")),
    ],
    description='"any" and "tool" need `tools`; a named tool must be one of them.',
)
_THINKING = Schema(
    one_of=[
        closed(
            ["type", "budget_tokens"],
            type=only("enabled"),
            budget_tokens=Schema(
                type=OpenAPIType.INTEGER,
                minimum=MIN_THINKING_BUDGET,
                maximum=INT64_MAX,
                description="Less than max_tokens (on /v1/messages). Thinking is turned on in "
                "the chat template; the budget is not enforced apart from max_tokens.",
            ),
            display=only("summarized"),
        ),
        closed(["type"], type=only("disabled")),
    ],
    description="Thinking on or off through the model's chat template (a model without "
    "think markers refuses either); absent: the model's default.",
)
# `tool_choice` "any" or "tool" needs at least one tool.
_CHOICE_NEEDS_TOOLS = Schema(
    any_of=[
        Schema(properties={"tool_choice": Schema(properties={"type": only("auto", "none")})}),
        non_empty("tools"),
    ]
)
_COMMON: dict[str, Schema | Reference] = {
    "model": MODEL,
    "messages": _MESSAGES,
    "system": _SYSTEM,
    "tools": _TOOLS,
    "tool_choice": _TOOL_CHOICE,
    "thinking": _THINKING,
    "output_config": closed(
        [],
        format=closed(["type", "schema"], type=only("json_schema"), schema=JSON_SCHEMA),
        effort=only("low", "medium", "high", "xhigh", "max"),
    ),
}

_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "messages", "max_tokens"],
    properties={
        **_COMMON,
        "max_tokens": Schema(
            type=OpenAPIType.INTEGER,
            minimum=0,
            maximum=limit("max_tokens_limit"),
            description="0: no token is generated. The API takes any int64; the gateway's "
            "ceiling (default shown) is lower.",
        ),
        "stop_sequences": Schema(
            type=OpenAPIType.ARRAY,
            items=STOP_STRING,
            max_items=MAX_STOP_SEQUENCES,
        ),
        "temperature": Schema(type=OpenAPIType.NUMBER, minimum=0, maximum=1),
        "top_p": Schema(type=OpenAPIType.NUMBER, minimum=0, maximum=1),
        "top_k": INT64_COUNT,
        "stream": BOOLEAN,
        "metadata": closed([], user_id=STRING),
    },
    additional_properties=False,
    dependent_schemas={"tool_choice": _CHOICE_NEEDS_TOOLS},
    description="Anthropic's Messages request, the subset Orchard implements (see "
    "docs/dialects.md: images, documents, server tools, adaptive thinking and a prefill are "
    "refused, naming the field).",
)
_COUNT_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "messages"],
    properties=_COMMON,
    additional_properties=False,
    dependent_schemas={"tool_choice": _CHOICE_NEEDS_TOOLS},
    description="The Messages request's prompt fields: what its input tokens are counted of.",
)

# --- the answers (protocol.anthropic.stream) ------------------------------------------------

_USAGE = counts(
    "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens"
)
_STOP_REASON = only(*get_args(StopReason))
_STOP_SEQUENCE = Schema(
    type=[OpenAPIType.STRING, OpenAPIType.NULL],
    description='The stop sequence that ended the answer (stop_reason "stop_sequence").',
)
_TOOL_USE_ID = Schema(type=OpenAPIType.STRING, pattern="^toolu_")


def _answer_blocks(text: Schema, tool_input: Schema) -> Schema:
    """An answer's content block: thinking, text or a tool call, whose texts are `text` and
    whose tool input a `tool_input` (whole, or empty as a streamed block starts)."""
    return Schema(
        one_of=[
            closed(
                ["type", "thinking", "signature"],
                type=only("thinking"),
                thinking=text,
                signature=text,
            ),
            closed(["type", "text"], type=only("text"), text=text),
            closed(
                ["type", "id", "name", "input"],
                type=only("tool_use"),
                id=_TOOL_USE_ID,
                name=STRING,
                input=tool_input,
            ),
        ]
    )


def _message_object(content: Schema, stop_reason: Schema, stop_sequence: Schema) -> Schema:
    return closed(
        ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        id=STRING,
        type=only("message"),
        role=only("assistant"),
        model=STRING,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=_USAGE,
    )


MESSAGE = _message_object(
    Schema(
        type=OpenAPIType.ARRAY,
        items=_answer_blocks(STRING, OBJECT),
        description="Thinking, text and tool calls, in that order, each only when not empty.",
    ),
    _STOP_REASON,
    _STOP_SEQUENCE,
)
"""The non-streaming answer."""


def _event(name: str, required: list[str] | None = None, **fields: Schema) -> Schema:
    return closed(["type", *(required or [])], type=only(name), **fields)


EVENT = Schema(
    one_of=[
        _event(
            "message_start",
            ["message"],
            message=_message_object(Schema(type=OpenAPIType.ARRAY, max_items=0), NULL, NULL),
        ),
        _event("ping"),
        _event(
            "content_block_start",
            ["index", "content_block"],
            index=COUNT,
            content_block=_answer_blocks(
                EMPTY_STRING, Schema(type=OpenAPIType.OBJECT, max_properties=0)
            ),
        ),
        _event(
            "content_block_delta",
            ["index", "delta"],
            index=COUNT,
            delta=Schema(
                one_of=[
                    closed(["type", "thinking"], type=only("thinking_delta"), thinking=STRING),
                    closed(["type", "text"], type=only("text_delta"), text=STRING),
                    closed(
                        ["type", "partial_json"],
                        type=only("input_json_delta"),
                        partial_json=STRING,
                    ),
                ]
            ),
        ),
        _event("content_block_stop", ["index"], index=COUNT),
        _event(
            "message_delta",
            ["delta", "usage"],
            delta=closed(
                ["stop_reason", "stop_sequence"],
                stop_reason=_STOP_REASON,
                stop_sequence=_STOP_SEQUENCE,
            ),
            usage=_USAGE,
        ),
        _event("message_stop"),
        ERROR,
    ]
)
"""The data of one streamed event (its `event:` line names the same type)."""

_EVENT_NAMES = [
    "message_start",
    "ping",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "error",
]
SSE_EVENT = named_event(_EVENT_NAMES, EVENT)
"""One server-sent event (its `event` and `data` fields), the JSON in its data an `EVENT`."""


@dataclass
class MessagesOperation(Operation):
    """Operation for `POST /v1/messages`, with its body and every status it answers."""

    def __post_init__(self) -> None:
        self.request_body = json_body(_REQUEST)
        self.responses = {
            "200": streamed_response(
                "A message, or with stream=true a text/event-stream of Anthropic's events, each "
                "an `event: <type>` line and a `data:` JSON object of that type (x-itemSchema): "
                "message_start, ping (also the keep-alive), content blocks' start, deltas and "
                "stop, message_delta, message_stop; or an error event that ends the stream. No "
                "[DONE].",
                MESSAGE,
                SSE_EVENT,
                EVENT,
            ),
            **_errors(),
        }


@dataclass
class CountTokensOperation(Operation):
    """Operation for `POST /v1/messages/count_tokens`."""

    def __post_init__(self) -> None:
        self.request_body = json_body(_COUNT_REQUEST)
        self.responses = {
            "200": json_response(
                "The prompt's tokens, through the model's chat template.",
                counts("input_tokens"),
            ),
            **_errors(),
        }
