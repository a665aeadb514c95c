"""The OpenAPI description of OpenAI's Responses API: `POST /v1/responses`, `GET` and
`DELETE /v1/responses/{response_id}`, as gateway.openai.chat.openapi describes the chat endpoint.

The request body is what protocol.openai.responses accepts, with its own limits (closed
objects: the parser refuses unknown fields; a field it refuses unless default is shown only
with its default); the answers are what protocol.openai.responses.events writes (the
`response` object, or its server-sent events), exactly, in openapi.yaml's shapes (`Response`,
`ResponseStreamEvent`); errors are OpenAI's. Rules a JSON Schema cannot state (input with
something for the model, the prompt's total length, distinct tool names, a named tool among
`tools`) are in the descriptions. (gateway.openai.chat.openapi_answers holds chat's answer schemas.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import get_args

from litestar.openapi.spec import Operation, Reference, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openapi import (
    BOOLEAN,
    COUNT,
    DECODING,
    GENERATION_ERRORS,
    INTEGER,
    JSON_SCHEMA,
    MODEL,
    NULL,
    OBJECT,
    PROMPT_TEXT,
    STRING,
    TOOL_NAME,
    closed,
    error,
    json_body,
    json_response,
    limit,
    named_event,
    non_empty,
    only,
    output_format,
    streamed_response,
    with_server_error,
)
from protocol.core.limits import INT64_MAX, MAX_MESSAGES, MAX_PROMPT_CHARS
from protocol.frames import ReasoningEffort
from protocol.openai.params import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
)
from protocol.openai.responses.input import MAX_CONTENT_PARTS
from protocol.openai.responses.request import MAX_INSTRUCTIONS_CHARS, MAX_TOOLS, MIN_OUTPUT_TOKENS


def nullable(schema: Schema) -> Schema:
    """`schema` or null (its description on the whole)."""
    return Schema(one_of=[replace(schema, description=None), NULL], description=schema.description)


def _or_null(required: list[str], properties: dict[str, Schema]) -> dict[str, Schema | Reference]:
    """`properties`, a field not `required` also null (which the parser reads as left out)."""
    return {
        key: value if key in required or value is NULL else nullable(value)
        for key, value in properties.items()
    }


def _optional(required: list[str], **properties: Schema) -> Schema:
    """A closed object of the request whose fields not required may also be null."""
    return closed(required, **_or_null(required, properties))


def array(items: Schema, **bounds: int) -> Schema:
    return Schema(type=OpenAPIType.ARRAY, items=items, **bounds)  # type: ignore[arg-type]


_EMPTY = Schema(type=OpenAPIType.ARRAY, max_items=0)
_ITEM_STATUS = only("in_progress", "completed", "incomplete")
_METADATA = Schema(
    type=OpenAPIType.OBJECT,
    property_names=Schema(type=OpenAPIType.STRING, max_length=MAX_METADATA_KEY_CHARS),
    additional_properties=Schema(type=OpenAPIType.STRING, max_length=MAX_METADATA_VALUE_CHARS),
    max_properties=MAX_METADATA_KEYS,
)
_EFFORT = only(*get_args(ReasoningEffort))

# --- the request (protocol.openai.responses, .responses_input) -------------------------------

INPUT_TEXT = closed(["type", "text"], type=only("input_text"), text=PROMPT_TEXT)
_OUTPUT_TEXT_IN = _optional(
    ["type", "text"],
    type=only("output_text"),
    text=PROMPT_TEXT,
    annotations=Schema(type=OpenAPIType.ARRAY),
    logprobs=Schema(type=OpenAPIType.ARRAY),
)


def _content(part: Schema) -> Schema:
    return Schema(one_of=[PROMPT_TEXT, array(part, max_items=MAX_CONTENT_PARTS)])


def _message(roles: Schema, part: Schema) -> Schema:
    return _optional(
        ["role", "content"],
        type=only("message"),
        role=roles,
        content=_content(part),
        id=STRING,
        status=_ITEM_STATUS,
        phase=STRING,
    )


_INPUT_ITEM = Schema(
    one_of=[
        _message(only("user", "system", "developer"), INPUT_TEXT),
        _message(only("assistant"), _OUTPUT_TEXT_IN),
        _optional(
            ["type", "call_id", "name", "arguments"],
            type=only("function_call"),
            call_id=STRING,
            name=STRING,
            arguments=STRING,
            id=STRING,
            status=_ITEM_STATUS,
        ),
        _optional(
            ["type", "call_id", "output"],
            type=only("function_call_output"),
            call_id=STRING,
            output=_content(INPUT_TEXT),
            id=STRING,
            status=_ITEM_STATUS,
        ),
        _optional(
            ["type", "encrypted_content"],
            type=only("compaction"),
            id=STRING,
            encrypted_content=STRING,
            created_by=STRING,
        ),
        _optional(
            ["type"],
            type=only("reasoning"),
            id=STRING,
            summary=Schema(type=OpenAPIType.ARRAY),
            content=Schema(type=OpenAPIType.ARRAY),
            status=_ITEM_STATUS,
            encrypted_content=NULL,
        ),
    ]
)
_INPUT = Schema(
    one_of=[
        PROMPT_TEXT,
        array(_INPUT_ITEM, min_items=1, max_items=MAX_MESSAGES),
    ],
    description="A user message, or items: messages (type may be left out), the model's "
    "function calls and their outputs, reasoning items (checked, not re-fed), compaction "
    "items (POST /v1/responses/compact's, unchanged). Something "
    f"for the model besides reasoning; at most {MAX_PROMPT_CHARS} characters in all.",
)
_TOOL = _optional(
    ["type", "name"],
    type=only("function"),
    name=TOOL_NAME,
    description=STRING,
    parameters=JSON_SCHEMA,
    strict=BOOLEAN,
)
_TOOL_CHOICE = Schema(
    one_of=[
        only("none", "auto", "required"),
        closed(["type", "name"], type=only("function"), name=TOOL_NAME),
    ],
    description='"required" and a named function need `tools`; the function must be one of them.',
)


_TEXT_FORMAT = output_format(
    closed(
        ["type", "name"],
        type=only("json_schema"),
        name=TOOL_NAME,
        description=STRING,
        schema=JSON_SCHEMA,
        strict=BOOLEAN,
    )
)
_WITH_TOOLS = non_empty("tools")

# Every limit is the parser's own constant, so the schema and the validation cannot disagree.
REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "input"],
    properties=_or_null(
        ["model", "input"],
        {
            "model": MODEL,
            "input": _INPUT,
            "instructions": Schema(type=OpenAPIType.STRING, max_length=MAX_INSTRUCTIONS_CHARS),
            "max_output_tokens": Schema(
                type=OpenAPIType.INTEGER,
                minimum=MIN_OUTPUT_TOKENS,
                maximum=limit("max_tokens_limit"),
            ),
            "temperature": DECODING["temperature"],
            "presence_penalty": DECODING["presence_penalty"],
            "frequency_penalty": DECODING["frequency_penalty"],
            "top_p": DECODING["top_p"],
            "tools": array(_TOOL, max_items=MAX_TOOLS),
            "tool_choice": _TOOL_CHOICE,
            "parallel_tool_calls": BOOLEAN,
            "text": _optional([], format=_TEXT_FORMAT, verbosity=only("medium")),
            "reasoning": _optional([], effort=_EFFORT, summary=NULL, generate_summary=NULL),
            "stream": BOOLEAN,
            "stream_options": _optional([], include_obfuscation=BOOLEAN),
            "store": Schema(
                type=OpenAPIType.BOOLEAN,
                description="Keep the response (default true where the gateway keeps responses; "
                "true is refused where its store's limits are zero).",
            ),
            "previous_response_id": Schema(
                type=OpenAPIType.STRING,
                description="A stored response this one continues (refused where the gateway "
                "keeps no responses).",
            ),
            "metadata": _METADATA,
            "user": STRING,
            "safety_identifier": Schema(type=OpenAPIType.STRING, max_length=64),
            "prompt_cache_key": STRING,
            "prompt_cache_retention": only("in_memory", "24h"),
            "prompt_cache_options": _optional([], ttl=only("30m"), mode=only("implicit")),
            "max_tool_calls": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=INT64_MAX),
            "truncation": only("disabled"),
            "service_tier": only("auto", "default"),
            "background": Schema(
                type=OpenAPIType.BOOLEAN,
                description="Run without the client: answered queued at once; retrieved, "
                "cancelled and its events streamed again by sequence number (needs store).",
            ),
            # Refused unless default.
            "include": _EMPTY,
            "top_logprobs": Schema(const=0),
            **dict.fromkeys(("conversation", "prompt", "context_management", "moderation"), NULL),
        },
    ),
    additional_properties=False,
    # The parameters that only mean something next to another one.
    dependent_schemas={
        "tool_choice": Schema(
            any_of=[
                Schema(properties={"tool_choice": Schema(one_of=[only("none", "auto"), NULL])}),
                _WITH_TOOLS,
            ]
        ),
        "stream_options": Schema(
            any_of=[
                Schema(properties={"stream_options": NULL}),
                Schema(required=["stream"], properties={"stream": Schema(const=True)}),
            ]
        ),
        "background": Schema(  # a background response is stored
            any_of=[
                Schema(properties={"background": Schema(one_of=[Schema(const=False), NULL])}),
                Schema(properties={"store": Schema(one_of=[Schema(const=True), NULL])}),
            ]
        ),
    },
    description="OpenAI's CreateResponse, the subset Orchard implements (function tools; no "
    "conversations, prompt templates, includes or logprobs). A field that is not "
    "required may also be null: the parser reads it as left out.",
)


# --- the response object (protocol.openai.responses.events) ----------------------------------

_OUTPUT_TEXT = closed(
    ["type", "text", "annotations", "logprobs"],
    type=only("output_text"),
    text=STRING,
    annotations=_EMPTY,
    logprobs=_EMPTY,
)
_REASONING_TEXT = closed(["type", "text"], type=only("reasoning_text"), text=STRING)
OUTPUT_ITEM = Schema(
    one_of=[
        closed(
            ["id", "type", "summary", "content", "status"],
            type=only("reasoning"),
            id=STRING,
            summary=_EMPTY,
            content=array(_REASONING_TEXT, max_items=1),
            status=_ITEM_STATUS,
        ),
        closed(
            ["id", "type", "status", "content", "role"],
            type=only("message"),
            id=STRING,
            status=_ITEM_STATUS,
            content=array(_OUTPUT_TEXT, max_items=1),
            role=only("assistant"),
        ),
        closed(
            ["id", "type", "status", "arguments", "call_id", "name"],
            type=only("function_call"),
            id=STRING,
            status=_ITEM_STATUS,
            arguments=STRING,
            call_id=STRING,
            name=STRING,
        ),
    ]
)
_USAGE_FIELDS: dict[str, Schema] = {
    "input_tokens": INTEGER,
    "input_tokens_details": closed(
        ["cached_tokens", "cache_write_tokens"], cached_tokens=INTEGER, cache_write_tokens=INTEGER
    ),
    "output_tokens": INTEGER,
    "output_tokens_details": closed(["reasoning_tokens"], reasoning_tokens=INTEGER),
    "total_tokens": INTEGER,
}
USAGE = closed(list(_USAGE_FIELDS), **_USAGE_FIELDS)
_SHOWN_FORMAT = output_format(
    closed(
        ["type", "name", "schema", "strict"],
        type=only("json_schema"),
        name=STRING,
        description=STRING,
        schema=JSON_SCHEMA,
        strict=BOOLEAN,
    )
)
_FIELDS: dict[str, Schema] = {
    "id": STRING,
    "object": only("response"),
    "created_at": INTEGER,
    "status": STRING,
    "background": BOOLEAN,
    "completed_at": nullable(INTEGER),
    "error": NULL,
    "incomplete_details": Schema(
        one_of=[NULL, closed(["reason"], reason=only("max_output_tokens"))]
    ),
    "instructions": nullable(STRING),
    "max_output_tokens": nullable(INTEGER),
    "max_tool_calls": nullable(INTEGER),
    "model": STRING,
    "output": array(OUTPUT_ITEM),
    "parallel_tool_calls": BOOLEAN,
    "previous_response_id": nullable(STRING),
    "prompt_cache_key": nullable(STRING),
    "prompt_cache_retention": nullable(only("in_memory", "24h")),
    "prompt_cache_options": nullable(_optional([], ttl=only("30m"), mode=only("implicit"))),
    "conversation": NULL,
    "prompt": NULL,
    "moderation": NULL,
    "reasoning": closed(["effort", "summary"], effort=nullable(_EFFORT), summary=NULL),
    "safety_identifier": nullable(STRING),
    "service_tier": only("default"),
    "store": BOOLEAN,
    "temperature": Schema(type=OpenAPIType.NUMBER),
    "presence_penalty": Schema(type=OpenAPIType.NUMBER),
    "frequency_penalty": Schema(type=OpenAPIType.NUMBER),
    "text": closed(["format", "verbosity"], format=_SHOWN_FORMAT, verbosity=only("medium")),
    "tool_choice": Schema(
        one_of=[
            only("none", "auto", "required"),
            closed(["type", "name"], type=only("function"), name=STRING),
        ]
    ),
    "tools": array(
        closed(
            ["type", "name", "description", "parameters", "strict"],
            type=only("function"),
            name=STRING,
            description=nullable(STRING),
            parameters=nullable(OBJECT),
            strict=BOOLEAN,
        )
    ),
    "top_logprobs": Schema(const=0),
    "top_p": Schema(type=OpenAPIType.NUMBER),
    "truncation": only("disabled"),
    "metadata": Schema(type=OpenAPIType.OBJECT, additional_properties=STRING),
    "usage": USAGE,
    "user": STRING,
}


def _response(status: Schema, *, finished: bool, **fields: Schema) -> Schema:
    """The response object with its `status` (and any field told otherwise); `usage` only
    once `finished` (openapi.yaml's usage is not nullable), `user` only when given."""
    properties = {**_FIELDS, "status": status, **fields}
    if not finished:
        del properties["usage"]
    optional = ("user",) if finished else ("user", "usage")
    return closed([key for key in properties if key not in optional], **properties)


RESPONSE = _response(only("completed", "incomplete"), finished=True)
"""A finished response: the whole answer, and what GET /v1/responses/{id} gives back."""
IN_PROGRESS = _response(
    only("in_progress"), finished=False, completed_at=NULL, incomplete_details=NULL
)
"""A response running: the items done so far."""
QUEUED = _response(only("queued"), finished=False, completed_at=NULL, incomplete_details=NULL)
"""A background response no runner has started yet."""
CANCELLED = _response(only("cancelled"), finished=False, completed_at=NULL, incomplete_details=NULL)
"""A background response cancelled: the items done, and those cut short incomplete."""
FAILED = _response(
    only("failed"),
    finished=False,
    completed_at=NULL,
    incomplete_details=NULL,
    error=closed(
        ["code", "message"], code=only("server_error", "rate_limit_exceeded"), message=STRING
    ),
)

# --- the events (ResponseEvents) ------------------------------------------------------------


def _event(kind: str, **fields: Schema) -> Schema:
    return closed(
        ["type", "sequence_number", *fields],
        type=only(kind),
        sequence_number=COUNT,
        **fields,
    )


_WHERE = {"item_id": STRING, "output_index": COUNT}
_PART = {**_WHERE, "content_index": Schema(const=0)}
EVENT = Schema(
    one_of=[
        _event("response.created", response=Schema(one_of=[IN_PROGRESS, QUEUED])),
        _event("response.queued", response=QUEUED),
        _event("response.in_progress", response=IN_PROGRESS),
        _event("response.output_item.added", output_index=_WHERE["output_index"], item=OUTPUT_ITEM),
        _event(
            "response.content_part.added",
            **_PART,
            part=Schema(one_of=[_OUTPUT_TEXT, _REASONING_TEXT]),
        ),
        _event("response.reasoning_text.delta", **_PART, delta=STRING),
        _event("response.reasoning_text.done", **_PART, text=STRING),
        _event("response.output_text.delta", **_PART, delta=STRING, logprobs=_EMPTY),
        _event("response.output_text.done", **_PART, text=STRING, logprobs=_EMPTY),
        _event(
            "response.content_part.done",
            **_PART,
            part=Schema(one_of=[_OUTPUT_TEXT, _REASONING_TEXT]),
        ),
        _event("response.function_call_arguments.delta", **_WHERE, delta=STRING),
        _event("response.function_call_arguments.done", **_WHERE, name=STRING, arguments=STRING),
        _event("response.output_item.done", output_index=_WHERE["output_index"], item=OUTPUT_ITEM),
        _event("response.completed", response=_response(only("completed"), finished=True)),
        _event(
            "response.incomplete",
            response=_response(
                only("incomplete"),
                finished=True,
                completed_at=NULL,
                incomplete_details=closed(["reason"], reason=only("max_output_tokens")),
            ),
        ),
        _event("response.failed", response=FAILED),
        _event("error", code=nullable(STRING), message=STRING, param=nullable(STRING)),
    ]
)
"""The data of one streamed event (its `event:` line names the same type)."""

EVENT_NAMES = [
    "response.created",
    "response.queued",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "error",
]
SSE_EVENT = named_event(EVENT_NAMES, EVENT)
"""One server-sent event (its `event` and `data` fields), the JSON in its data an `EVENT`."""

# --- the operations -------------------------------------------------------------------------

SERVER_ERROR = "The runner failed, or cancelled the response before it finished."
BY_ID = {
    "400": "A query parameter this operation does not take (the error names it).",
    "401": "Missing or wrong API key.",
    "403": "Origin not allowed.",
    "404": "No stored response has this id.",
}
_DELETED = closed(
    ["id", "object", "deleted"], id=STRING, object=only("response"), deleted=Schema(const=True)
)


@dataclass
class CreateResponseOperation(Operation):
    """Operation for `POST /v1/responses`, with its body and every status it answers."""

    def __post_init__(self) -> None:
        self.request_body = json_body(REQUEST)
        reasons = {
            **with_server_error(SERVER_ERROR),
            "400": GENERATION_ERRORS["400"] + " An unknown previous_response_id is a 400 too.",
        }
        self.responses = {
            "200": streamed_response(
                "A response, or with stream=true a text/event-stream of OpenAI's Responses "
                "events, each an `event: <type>` line and a `data:` JSON object of that type "
                "(x-itemSchema): response.created and response.in_progress, each output item's "
                "added, content and delta events and done, then response.completed or "
                "response.incomplete; or response.failed (or an error event) that ends the "
                "stream. No [DONE]. With background=true the response queued (streamed: "
                "response.created and response.queued first, both queued).",
                Schema(one_of=[RESPONSE, QUEUED]),
                SSE_EVENT,
                EVENT,
            ),
            **{status: error(why) for status, why in reasons.items()},
        }


@dataclass
class DeleteResponseOperation(Operation):
    """Operation for `DELETE /v1/responses/{response_id}`."""

    def __post_init__(self) -> None:
        self.responses = {
            "200": json_response("The response was deleted.", _DELETED),
            **{status: error(why) for status, why in BY_ID.items()},
        }
