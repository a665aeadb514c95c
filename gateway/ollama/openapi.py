"""The OpenAPI description of the Ollama API: `POST /api/chat`, `POST /api/generate`,
`POST /api/show`, `GET /api/tags`, `GET /api/ps` and `GET /api/version`, as
gateway.openai.chat.openapi describes the chat endpoint.

The request bodies are what protocol.ollama.request (and gateway.ollama.models' show)
accept, with their own limits (closed objects: unknown fields are refused); the answers are
what protocol.ollama.stream and protocol.ollama.models write, exactly: a whole answer as
application/json, a streamed one as application/x-ndjson lines; errors are Ollama's
`{"error": message}`. The model-management calls (pull, push, create, copy, delete, blobs),
which always answer 501, are not described.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar.openapi.spec import OpenAPIResponse, Operation, Reference, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIFormat, OpenAPIType

from gateway.openai.chat.openapi import TOOLS
from gateway.openapi import (
    BOOLEAN,
    COUNT,
    DECODING,
    EMPTY_STRING,
    GENERATION_ERRORS,
    INT64_COUNT,
    JSON_SCHEMA,
    MODEL,
    NULL,
    OBJECT,
    PROMPT_TEXT,
    STOP_STRING,
    STRING,
    closed,
    json_body,
    json_response,
    limit,
    only,
    streamed_response,
    with_server_error,
)
from protocol.core.limits import INT64_MAX, INT64_MIN, MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_STOP
from protocol.ollama.models import CAPABILITIES

NDJSON_TYPE = "application/x-ndjson"

# --- errors ---------------------------------------------------------------------------------

ERROR = closed(["error"], error=STRING)
"""Ollama's error: a body, or the last line of a stream that failed."""


def _error(description: str) -> OpenAPIResponse:
    return json_response(description, ERROR)


_AUTH_ERRORS = {status: _error(GENERATION_ERRORS[status]) for status in ("401", "403")}
_GENERATION_ERRORS = {
    status: _error(why) for status, why in with_server_error("The runner failed.").items()
}

# --- the requests (protocol.ollama.request) -------------------------------------------------

_NO_IMAGES = Schema(
    type=OpenAPIType.ARRAY, max_items=0, description="Images are not supported: only empty."
)
_CALL = closed(
    ["function"],
    id=STRING,
    type=only("function"),
    function=closed(
        ["name"],
        index=INT64_COUNT,
        name=STRING,
        arguments=OBJECT,
    ),
)
_MESSAGE = Schema(
    one_of=[
        closed(["role"], role=only("system", "user"), content=PROMPT_TEXT, images=_NO_IMAGES),
        closed(
            ["role"],
            role=only("assistant"),
            content=PROMPT_TEXT,
            images=_NO_IMAGES,
            thinking=STRING,
            tool_calls=Schema(type=OpenAPIType.ARRAY, items=_CALL),
        ),
        closed(
            ["role"],
            role=only("tool"),
            content=PROMPT_TEXT,
            images=_NO_IMAGES,
            tool_name=STRING,
            tool_call_id=STRING,
        ),
    ]
)


_OPTIONS = closed(
    [],
    temperature=DECODING["temperature"],
    top_p=DECODING["top_p"],
    top_k=INT64_COUNT,
    min_p=DECODING["min_p"],
    num_predict=Schema(
        type=OpenAPIType.INTEGER,
        minimum=-2,
        maximum=limit("max_tokens_limit"),
        schema_not=Schema(const=0),
        description="The most tokens to generate; -1: no limit, -2: up to the context. The "
        "gateway's ceiling (default shown) bounds it.",
    ),
    stop=Schema(type=OpenAPIType.ARRAY, items=STOP_STRING, max_items=MAX_STOP),
    seed=Schema(
        type=OpenAPIType.INTEGER,
        minimum=INT64_MIN,
        maximum=INT64_MAX,
        description="A negative seed: a random one.",
    ),
    presence_penalty=DECODING["presence_penalty"],
    frequency_penalty=DECODING["frequency_penalty"],
)
_COMMON: dict[str, Schema] = {
    "model": MODEL,
    "stream": Schema(type=OpenAPIType.BOOLEAN, description="True unless false: NDJSON lines."),
    "format": Schema(
        one_of=[only("", "json"), JSON_SCHEMA],
        description='"json": any JSON object; a JSON Schema: an object of that schema.',
    ),
    "options": _OPTIONS,
    "keep_alive": Schema(
        type=[OpenAPIType.STRING, OpenAPIType.NUMBER],
        description="Accepted; runners keep their models loaded.",
    ),
    "think": Schema(
        one_of=[BOOLEAN, only("low", "medium", "high")],
        description="false turns thinking off through the chat template; the others ask for "
        "it, which a model without think markers refuses.",
    ),
    "logprobs": Schema(const=False, description="Not implemented: only false."),
    "top_logprobs": Schema(const=0, description="Not implemented: only 0."),
}

_CHAT = Schema(
    type=OpenAPIType.OBJECT,
    required=["model"],
    properties={
        **_COMMON,
        "messages": Schema(
            type=OpenAPIType.ARRAY,
            items=_MESSAGE,
            max_items=MAX_MESSAGES,
            description=f"At most {MAX_PROMPT_CHARS} characters of content in all; none: the "
            'model is loaded (done_reason "load").',
        ),
        "tools": TOOLS,
    },
    additional_properties=False,
    description="Ollama's chat request, the subset Orchard implements (see docs/dialects.md).",
)


def _refused(schema: Schema, reason: str) -> Schema:
    schema.description = f"Not implemented ({reason}): only empty."
    return schema


_GENERATE = Schema(
    type=OpenAPIType.OBJECT,
    required=["model"],
    properties={
        **_COMMON,
        "prompt": Schema(
            type=OpenAPIType.STRING,
            max_length=MAX_PROMPT_CHARS,
            description=f"With `system`, at most {MAX_PROMPT_CHARS} characters; empty: the "
            'model is loaded (done_reason "load").',
        ),
        "system": STRING,
        "raw": Schema(
            type=OpenAPIType.BOOLEAN,
            description="The prompt as given, with no chat template (and no `system`).",
        ),
        "suffix": _refused(Schema(const=""), "fill-in-the-middle"),
        "template": _refused(Schema(const=""), "the model's own chat template is used"),
        "context": _refused(Schema(type=OpenAPIType.ARRAY, max_items=0), "send /api/chat"),
        "images": _refused(Schema(type=OpenAPIType.ARRAY, max_items=0), "images"),
        **{
            name: _refused(Schema(const=0), "image generation")
            for name in ("width", "height", "steps")
        },
    },
    additional_properties=False,
    # A raw prompt takes no system prompt.
    dependent_schemas={
        "raw": Schema(
            any_of=[
                Schema(properties={"raw": Schema(const=False)}),
                Schema(schema_not=Schema(required=["system"])),
                Schema(properties={"system": Schema(max_length=0)}),
            ]
        )
    },
    description="Ollama's generate request, the subset Orchard implements (see docs/dialects.md).",
)

_SHOW = Schema(
    type=OpenAPIType.OBJECT,
    properties={"model": STRING, "name": STRING, "verbose": BOOLEAN},
    additional_properties=False,
    any_of=[Schema(required=["model"]), Schema(required=["name"])],
    description="`name` is the older spelling of `model`.",
)

# --- the answers (protocol.ollama.stream and .models) ---------------------------------------

_STAMP = Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.DATE_TIME)
_METRICS = dict.fromkeys(
    (
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    ),
    COUNT,
)
"""The counts and the durations (in nanoseconds) of an answer's last object."""
_ANSWER_CALL = closed(
    ["function"],
    id=STRING,
    function=closed(
        ["index", "name", "arguments"],
        index=COUNT,
        name=STRING,
        arguments=OBJECT,
    ),
)


def _chat_message(content: Schema, *, more: bool) -> Schema:
    if not more:
        return closed(["role", "content"], role=only("assistant"), content=content)
    return closed(
        ["role", "content"],
        role=only("assistant"),
        content=content,
        thinking=STRING,
        tool_calls=Schema(type=OpenAPIType.ARRAY, items=_ANSWER_CALL, min_items=1),
    )


def _answers(text: str, *, chat: bool) -> tuple[Schema, Schema]:
    """(the whole answer's schema, one NDJSON line's), for /api/chat or /api/generate."""

    def answer(content: Schema, done: str, *, more: bool = True, metrics: bool = False) -> Schema:
        body: dict[str, Any] = {"model": STRING, "created_at": _STAMP}
        if chat:
            body["message"] = _chat_message(content, more=more)
        else:
            body[text] = content
            if more:
                body["thinking"] = STRING
        body["done"] = Schema(const=done != "")
        if done:
            body["done_reason"] = only(*done.split())
        if metrics:
            body.update(_METRICS)
        required = [name for name in body if name != "thinking"]
        return closed(required, **body)

    whole = answer(STRING, "stop length", metrics=True)
    load = answer(EMPTY_STRING, "load", more=False)
    chunk = answer(STRING, "")
    last = answer(EMPTY_STRING, "stop length", more=False, metrics=True)
    return Schema(one_of=[whole, load]), Schema(one_of=[chunk, last, load, ERROR])


CHAT_ANSWER, CHAT_LINE = _answers("message", chat=True)
GENERATE_ANSWER, GENERATE_LINE = _answers("response", chat=False)

_DETAILS = closed(
    ["parent_model", "format", "family", "families", "parameter_size", "quantization_level"],
    parent_model=STRING,
    format=STRING,
    family=STRING,
    families=NULL,
    parameter_size=STRING,
    quantization_level=STRING,
)
TAGS = closed(
    ["models"],
    models=Schema(
        type=OpenAPIType.ARRAY,
        items=closed(
            ["name", "model", "modified_at", "details"],
            name=STRING,
            model=STRING,
            modified_at=_STAMP,
            details=_DETAILS,
        ),
    ),
)
PS = closed(
    ["models"],
    models=Schema(
        type=OpenAPIType.ARRAY,
        items=closed(
            ["name", "model", "details", "context_length"],
            name=STRING,
            model=STRING,
            details=_DETAILS,
            context_length=COUNT,
        ),
        description="Every served model: runners keep their models loaded.",
    ),
)
SHOW = closed(
    ["details", "model_info", "capabilities", "modified_at"],
    details=_DETAILS,
    model_info=closed(
        ["general.architecture", "general.basename", "orchard.context_length"],
        **{
            "general.architecture": only("orchard"),
            "general.basename": STRING,
            "orchard.context_length": COUNT,
            "orchard.engine": STRING,
        },
    ),
    capabilities=Schema(type=OpenAPIType.ARRAY, items=only(*CAPABILITIES)),
    modified_at=_STAMP,
)
VERSION = closed(["version"], version=STRING)


def _generation(
    body: str, request: Schema, answer: Schema, line: Schema
) -> tuple[RequestBody, dict[str, OpenAPIResponse | Reference]]:
    """(the request body, the responses) of /api/chat or /api/generate."""
    return (
        json_body(request),
        {
            "200": streamed_response(
                f"With stream false, the whole {body} as one object; otherwise "
                "application/x-ndjson, one JSON object a line (x-itemSchema): the answer as "
                'it comes ("done": false), then the last one with done_reason, the counts '
                'and the durations in nanoseconds, or {"error"} ending a stream that failed. '
                'A request with nothing to generate answers done_reason "load".',
                answer,
                STRING,
                line,
                NDJSON_TYPE,
            ),
            **_GENERATION_ERRORS,
        },
    )


@dataclass
class ChatOperation(Operation):
    """Operation for `POST /api/chat`."""

    def __post_init__(self) -> None:
        self.request_body, self.responses = _generation(
            "chat answer", _CHAT, CHAT_ANSWER, CHAT_LINE
        )


@dataclass
class GenerateOperation(Operation):
    """Operation for `POST /api/generate`."""

    def __post_init__(self) -> None:
        self.request_body, self.responses = _generation(
            "completion", _GENERATE, GENERATE_ANSWER, GENERATE_LINE
        )


@dataclass
class ShowOperation(Operation):
    """Operation for `POST /api/show`."""

    def __post_init__(self) -> None:
        self.request_body = json_body(_SHOW)
        self.responses = {
            "200": json_response("What is known of the model (its runners' registration).", SHOW),
            "400": _error(GENERATION_ERRORS["400"]),
            **_AUTH_ERRORS,
            "404": _error(GENERATION_ERRORS["404"]),
            "413": _error(GENERATION_ERRORS["413"]),
            "503": _error("The model's runners are reconnecting."),
        }


def _listing(description: str, schema: Schema) -> type[Operation]:
    @dataclass
    class ListingOperation(Operation):
        def __post_init__(self) -> None:
            self.responses = {"200": json_response(description, schema), **_AUTH_ERRORS}

    return ListingOperation


TagsOperation = _listing("The models the pool serves.", TAGS)
PsOperation = _listing("The loaded models: every served one.", PS)
VersionOperation = _listing("The Ollama version whose API this follows.", VERSION)
