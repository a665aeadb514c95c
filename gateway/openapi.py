"""What the hand-written OpenAPI descriptions share: the basic schemas and the shapes several
dialects write alike (counts, prompt text, tool names, JSON Schemas, output formats, a field
that needs a non-empty array), the error object and its responses, a JSON answer, a streamed
answer (a text/event-stream or NDJSON of JSON events) and its named events, the request fields
chat (gateway.openai.chat.openapi) and legacy completions (gateway.openai.completions.openapi) read
alike, and the statuses a generating endpoint answers (`GENERATION_ERRORS`, which the Anthropic and
Ollama descriptions write in their own error shapes). The answers' own schemas are
gateway.openai.chat.openapi_answers' and gateway.openai.completions.openapi'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import attrs
from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, Reference, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.config import GatewayConfig
from protocol.core.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_MODEL_CHARS,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    SAMPLING_RANGES,
    TOP_K_MIN,
)
from protocol.core.tools import MAX_NAME_CHARS, NAME_PATTERN

STRING = Schema(type=OpenAPIType.STRING)
BOOLEAN = Schema(type=OpenAPIType.BOOLEAN)
INTEGER = Schema(type=OpenAPIType.INTEGER)
NULL = Schema(type=OpenAPIType.NULL)
OBJECT = Schema(type=OpenAPIType.OBJECT)
COUNT = Schema(type=OpenAPIType.INTEGER, minimum=0)
"""A count, an index or a duration: any integer from 0."""
INT64_COUNT = Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=INT64_MAX)
EMPTY_STRING = Schema(type=OpenAPIType.STRING, max_length=0)
PROMPT_TEXT = Schema(type=OpenAPIType.STRING, max_length=MAX_PROMPT_CHARS)
"""A text of the prompt (each within the parser's limit on the whole prompt)."""
JSON_SCHEMA = Schema(type=OpenAPIType.OBJECT, description="A JSON Schema.")
TOOL_NAME = Schema(type=OpenAPIType.STRING, pattern=NAME_PATTERN, max_length=MAX_NAME_CHARS)
UNIMPLEMENTED_NULL = Schema(type=OpenAPIType.NULL, description="Not implemented: only null.")


def only(*values: str) -> Schema:
    return Schema(type=OpenAPIType.STRING, enum=list(values))


def only_or_null(*values: str) -> Schema:
    """One of `values`, or null."""
    return Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], enum=[*values, None])


def closed(required: list[str], **properties: Schema | Reference) -> Schema:
    """An object with exactly these keys allowed (the parser refuses unknown ones)."""
    return Schema(
        type=OpenAPIType.OBJECT,
        required=required,
        properties=properties,
        additional_properties=False,
    )


def counts(*names: str) -> Schema:
    """An object of these counts, every one present."""
    return closed(list(names), **dict.fromkeys(names, COUNT))


def non_empty(name: str) -> Schema:
    """The object has `name`, a non-empty array (what a field that needs it depends on)."""
    return Schema(required=[name], properties={name: Schema(type=OpenAPIType.ARRAY, min_items=1)})


def output_format(json_schema: Schema) -> Schema:
    """An output format: plain text, any JSON object, or `json_schema` (its dialect's)."""
    return Schema(
        one_of=[
            closed(["type"], type=only("text")),
            closed(["type"], type=only("json_object")),
            json_schema,
        ]
    )


def limit(name: str) -> int:
    """A gateway setting's default (a gateway may be started with another)."""
    value: int = getattr(attrs.fields(GatewayConfig), name).default
    return value


# --- the request fields chat and legacy completions read alike (protocol.openai.chat.request) ----

MODEL = Schema(type=OpenAPIType.STRING, max_length=MAX_MODEL_CHARS)
STOP_STRING = Schema(type=OpenAPIType.STRING, min_length=1, max_length=MAX_STOP_CHARS)


def _number(name: str) -> Schema:
    minimum, maximum = SAMPLING_RANGES[name]
    return Schema(type=OpenAPIType.NUMBER, minimum=minimum, maximum=maximum)


DECODING: dict[str, Schema] = {
    **{name: _number(name) for name in SAMPLING_RANGES},
    "top_k": Schema(type=OpenAPIType.INTEGER, minimum=TOP_K_MIN, maximum=INT64_MAX),
    "seed": Schema(type=OpenAPIType.INTEGER, minimum=INT64_MIN, maximum=INT64_MAX),
    "stop": Schema(
        one_of=[
            STOP_STRING,
            Schema(type=OpenAPIType.ARRAY, items=STOP_STRING, min_items=0, max_items=MAX_STOP),
        ]
    ),
}
"""The sampling parameters, `seed` and `stop`, in the order both requests list them."""

# --- errors and answers ---------------------------------------------------------------------

_ERROR = Schema(
    type=OpenAPIType.OBJECT,
    required=["error"],
    properties={
        "error": Schema(
            type=OpenAPIType.OBJECT,
            required=["message", "type", "param", "code"],
            properties={
                "message": STRING,
                "type": STRING,
                "param": Schema(one_of=[STRING, NULL]),
                "code": Schema(one_of=[STRING, NULL]),
            },
        )
    },
)


def json_response(description: str, schema: Schema) -> OpenAPIResponse:
    return OpenAPIResponse(
        description=description, content={"application/json": MediaType(schema=schema)}
    )


def error(description: str) -> OpenAPIResponse:
    return json_response(description, _ERROR)


@dataclass
class _EventStream(MediaType):
    """A text/event-stream whose `data:` events (or an application/x-ndjson body whose lines)
    are JSON objects of one schema: OpenAPI 3.2's `itemSchema`, written as an extension
    because Litestar writes OpenAPI 3.1 (whose components.schemas Litestar also overwrites
    with its own)."""

    item_schema: Schema | None = field(default=None, metadata={"alias": "x-itemSchema"})


def json_body(schema: Schema) -> RequestBody:
    return RequestBody(required=True, content={"application/json": MediaType(schema=schema)})


def streamed_response(
    description: str,
    body: Schema,
    stream: Schema,
    item: Schema,
    media_type: str = "text/event-stream",
) -> OpenAPIResponse:
    """A generating endpoint's 200: `body` as JSON, or with streaming a `media_type` whose
    schema is `stream` and whose events (or lines) are each an `item`."""
    return OpenAPIResponse(
        description=description,
        content={
            "application/json": MediaType(schema=body),
            media_type: _EventStream(schema=stream, item_schema=item),
        },
    )


def _json_text(schema: Schema) -> Schema:
    """A string holding JSON of `schema` (an event's data)."""
    return Schema(
        type=OpenAPIType.STRING, content_media_type="application/json", content_schema=schema
    )


def named_event(names: list[str], data: Schema) -> Schema:
    """One server-sent event as OpenAPI 3.1 describes an event stream (the media type's schema
    is each event's: its `event` and `data` fields), its `event:` line one of `names`, the JSON
    in its data a `data`."""
    return closed(
        ["event", "data"],
        event=Schema(
            type=OpenAPIType.STRING, enum=names, description="The type of the data's object."
        ),
        data=_json_text(data),
    )


GENERATION_ERRORS: dict[str, str] = {
    "400": "Invalid request (the error names the parameter).",
    "401": "Missing or wrong API key.",
    "403": "Origin not allowed.",
    "404": "No runner serves the model.",
    "413": "Body too large.",
    "429": "Every runner is busy and the model's queue is full or timed out.",
    "502": "The runner was lost.",
    "503": "The model's runners are reconnecting, or the gateway is stopping.",
    "504": "The runner sent nothing for the stream timeout.",
}
"""Every error status a generating endpoint answers, and why (in any API's error shape)."""


def with_server_error(why: str) -> dict[str, str]:
    """GENERATION_ERRORS and a 500 (`why`: what a dialect cannot write), in status order."""
    reasons = {**GENERATION_ERRORS, "500": why}
    return {status: reasons[status] for status in sorted(reasons)}


_DONE = Schema(type=OpenAPIType.STRING, const="[DONE]")


def _data_event(data: Schema) -> Schema:
    """One server-sent event of an OpenAI stream as OpenAPI 3.1 describes an event stream (the
    media type's schema is each event's: no `event:` line, so the name is "message", and its
    `data`), the JSON in its data a `data`, or the final `[DONE]`."""
    return closed(
        ["event", "data"],
        event=Schema(
            type=OpenAPIType.STRING, const="message", description="No `event:` line is sent."
        ),
        data=Schema(
            any_of=[
                _DONE,
                _json_text(data),
            ]
        ),
    )


def generation_responses(
    body: Schema, body_name: str, event: Schema, event_name: str
) -> dict[str, Any]:
    """What an endpoint that generates answers: `body` (a `body_name`), or with stream=true
    `event`s (each an `event_name`), and every error status the gateway sends."""
    item = Schema(one_of=[event, _ERROR])
    return {
        "200": streamed_response(
            f"A {body_name}, or with stream=true a text/event-stream of `data:` events "
            f"(x-itemSchema: a {event_name}, or an error that ends the stream), the last of "
            "them data: [DONE].",
            body,
            _data_event(item),
            item,
        ),
        **{status: error(why) for status, why in GENERATION_ERRORS.items()},
    }
