"""The OpenAPI description of the Responses API's other resources, as
gateway.openai.responses.openapi describes the create: `POST /v1/responses/input_tokens` (the
count of a create's prompt) and `GET /v1/responses/{response_id}/input_items` (a stored
response's input items, paged), `POST /v1/responses/compact` (a conversation compacted by
the model: protocol.openai.responses.compaction), and retrieving and cancelling one
(`GET /v1/responses/{response_id}`, with a background response's events streamed again, and
`POST /v1/responses/{response_id}/cancel`)."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.enums import ParamType
from litestar.openapi.spec import Operation, Parameter, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openai.responses.openapi import (
    BY_ID,
    CANCELLED,
    EVENT,
    FAILED,
    IN_PROGRESS,
    INPUT_TEXT,
    OUTPUT_ITEM,
    QUEUED,
    REQUEST,
    RESPONSE,
    SERVER_ERROR,
    SSE_EVENT,
    USAGE,
    array,
    nullable,
)
from gateway.openapi import (
    BOOLEAN,
    COUNT,
    GENERATION_ERRORS,
    INTEGER,
    NULL,
    STRING,
    closed,
    error,
    json_body,
    json_response,
    only,
    streamed_response,
    with_server_error,
)
from protocol.openai.pages import MAX_LIMIT

_COUNTED = (
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "truncation",
    "conversation",
)


_COUNT_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "input"],
    properties={
        **{name: (REQUEST.properties or {})[name] for name in _COUNTED},
        "personality": NULL,
    },
    additional_properties=False,
    dependent_schemas={"tool_choice": (REQUEST.dependent_schemas or {})["tool_choice"]},
    description="OpenAI's TokenCountsBody: the create's fields that make the prompt, read as "
    "the create reads them (model and input required: the count is the model's tokenizer's).",
)


_TOKEN_COUNTS = closed(
    ["object", "input_tokens"], object=only("response.input_tokens"), input_tokens=COUNT
)


@dataclass
class InputTokensOperation(Operation):
    """Operation for `POST /v1/responses/input_tokens`."""

    def __post_init__(self) -> None:
        self.request_body = json_body(_COUNT_REQUEST)
        reasons = {
            **with_server_error(SERVER_ERROR),
            "400": GENERATION_ERRORS["400"] + " An unknown previous_response_id is a 400 too.",
        }
        self.responses = {
            "200": json_response(
                "The request's input tokens: its prompt through the model's chat template, "
                "tokenized by a runner that serves it.",
                _TOKEN_COUNTS,
            ),
            **{status: error(why) for status, why in reasons.items()},
        }


_LISTED_ITEM = Schema(
    one_of=[
        *(OUTPUT_ITEM.one_of or []),
        closed(
            ["id", "type", "role", "content", "status"],
            type=only("message"),
            id=STRING,
            role=only("user", "system", "developer"),
            content=array(INPUT_TEXT, max_items=1),
            status=only("completed"),
        ),
        closed(
            ["id", "type", "call_id", "output", "status"],
            type=only("function_call_output"),
            id=STRING,
            call_id=nullable(STRING),
            output=STRING,
            status=only("completed"),
        ),
    ]
)


_ITEM_LIST = closed(
    ["object", "data", "first_id", "last_id", "has_more"],
    object=only("list"),
    data=array(_LISTED_ITEM),
    first_id=nullable(STRING),
    last_id=nullable(STRING),
    has_more=BOOLEAN,
)


_ITEM_PAGE = [
    Parameter(
        name="after",
        param_in=ParamType.QUERY,
        schema=STRING,
        description="The last item id of the previous page.",
    ),
    Parameter(
        name="limit",
        param_in=ParamType.QUERY,
        schema=Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=MAX_LIMIT),
        description="How many to return (default 20).",
    ),
    Parameter(
        name="order",
        param_in=ParamType.QUERY,
        schema=only("asc", "desc"),
        description="desc (the default): newest first; asc: oldest first.",
    ),
]


@dataclass
class InputItemsOperation(Operation):
    """Operation for `GET /v1/responses/{response_id}/input_items`."""

    def __post_init__(self) -> None:
        self.parameters = [*(self.parameters or []), *_ITEM_PAGE]
        self.responses = {
            "200": json_response(
                "A page of the items the response was generated from: earlier turns and this "
                "turn's input, without the instructions.",
                _ITEM_LIST,
            ),
            **{status: error(why) for status, why in BY_ID.items()},
            "400": error("A bad query parameter, or an after that is none of the items."),
        }


_COMPACTED = (
    "model", "input", "instructions", "previous_response_id", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "service_tier",
)  # fmt: skip
_COMPACT_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model"],
    properties={name: (REQUEST.properties or {})[name] for name in _COMPACTED},
    additional_properties=False,
    description="OpenAI's CompactResponseMethodPublicBody: the conversation to compact, read "
    "as the create reads it; input may be left out when previous_response_id gives it.",
)
_COMPACTED_ITEM = Schema(
    one_of=[
        closed(
            ["id", "type", "role", "content", "status"],
            type=only("message"),
            id=STRING,
            role=only("user"),
            content=array(INPUT_TEXT, max_items=1),
            status=only("completed"),
        ),
        closed(
            ["id", "type", "encrypted_content"],
            type=only("compaction"),
            id=STRING,
            encrypted_content=STRING,
        ),
    ]
)
_COMPACTION = closed(
    ["id", "object", "output", "created_at", "usage"],
    id=STRING,
    object=only("response.compaction"),
    output=array(_COMPACTED_ITEM, min_items=1),
    created_at=INTEGER,
    usage=USAGE,
)


@dataclass
class CompactOperation(Operation):
    """Operation for `POST /v1/responses/compact`."""

    def __post_init__(self) -> None:
        self.request_body = json_body(_COMPACT_REQUEST)
        reasons = {
            **with_server_error(SERVER_ERROR),
            "400": GENERATION_ERRORS["400"] + " An unknown previous_response_id is a 400 too.",
        }
        self.responses = {
            "200": json_response(
                "The conversation's user messages, then a compaction item with the model's "
                "summary of the rest (opaque: give it back unchanged in a later input).",
                _COMPACTION,
            ),
            **{status: error(why) for status, why in reasons.items()},
        }


ANY_RESPONSE = Schema(one_of=[RESPONSE, QUEUED, IN_PROGRESS, FAILED, CANCELLED])
"""A response whatever its status: finished, or a background one queued, running, failed or
cancelled."""

_RETRIEVE = [
    Parameter(
        name="stream",
        param_in=ParamType.QUERY,
        schema=BOOLEAN,
        description="true: a background response's events as a text/event-stream (the live "
        "ones too while it runs) instead of the object.",
    ),
    Parameter(
        name="starting_after",
        param_in=ParamType.QUERY,
        schema=Schema(type=OpenAPIType.INTEGER, minimum=0),
        description="With stream=true: only the events after this sequence number.",
    ),
    Parameter(
        name="include_obfuscation",
        param_in=ParamType.QUERY,
        schema=BOOLEAN,
        description="Taken; nothing is obfuscated.",
    ),
]


@dataclass
class GetResponseOperation(Operation):
    """Operation for `GET /v1/responses/{response_id}`."""

    def __post_init__(self) -> None:
        self.parameters = [*(self.parameters or []), *_RETRIEVE]
        self.responses = {
            "200": streamed_response(
                "The stored response, or a background one as it stands; with stream=true a "
                "background response's events after starting_after (sequence numbers as "
                "first sent), live ones included until its last.",
                ANY_RESPONSE,
                SSE_EVENT,
                EVENT,
            ),
            **{status: error(why) for status, why in BY_ID.items()},
            "400": error(
                "A bad query parameter, or stream=true for a response that did not run in "
                "the background."
            ),
        }


@dataclass
class CancelOperation(Operation):
    """Operation for `POST /v1/responses/{response_id}/cancel`."""

    def __post_init__(self) -> None:
        self.responses = {
            "200": json_response(
                "The background response once cancelled (a finished one as it ended).",
                ANY_RESPONSE,
            ),
            **{status: error(why) for status, why in BY_ID.items()},
            "400": error("The response did not run in the background."),
        }
