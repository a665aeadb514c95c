"""The stored chat completions endpoints, as OpenAI serves them:

    GET    /v1/chat/completions                      list (model, metadata[k]=v, after, limit,
                                                     order)
    GET    /v1/chat/completions/{completion_id}      the stored object
    POST   /v1/chat/completions/{completion_id}      replace its metadata
    DELETE /v1/chat/completions/{completion_id}      delete it
    GET    /v1/chat/completions/{completion_id}/messages   its request's messages (after,
                                                     limit, order)

Only I/O here: the queries and bodies are parsed, and the objects written, by
protocol.openai.chat.stored; the store is gateway.stores.chat (`app.state.store`). The API-key and
origin checks are the app's, as for every /v1/ path. Each operation describes its query
parameters and responses in the OpenAPI schema by hand, since the handlers read the raw
query (so that every bad parameter is a 400 in OpenAI's shape, naming it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from litestar import Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.enums import ParamType
from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, Operation, Parameter, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import FromPath

from gateway.openapi import error
from gateway.stores.chat import CompletionStore
from protocol.openai.chat.stored import parse_list_query, parse_messages_query, parse_update
from protocol.openai.pages import MAX_LIMIT
from protocol.openai.params import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
)

COMPLETION_PATH = "/v1/chat/completions/{completion_id:str}"

# --- the OpenAPI description ------------------------------------------------------------------

_STRING = Schema(type=OpenAPIType.STRING)
_NULLABLE_STRING = Schema(one_of=[_STRING, Schema(type=OpenAPIType.NULL)])
_COMPLETION = Schema(
    type=OpenAPIType.OBJECT,
    required=["id", "object", "created", "model", "choices", "request_id", "metadata"],
    properties={
        "id": _STRING,
        "object": Schema(type=OpenAPIType.STRING, enum=["chat.completion"]),
        "created": Schema(type=OpenAPIType.INTEGER),
        "model": _STRING,
        "choices": Schema(type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.OBJECT)),
        "request_id": _STRING,
        "metadata": Schema(type=OpenAPIType.OBJECT, additional_properties=_STRING),
    },
    description="OpenAI's stored chat completion: the CreateChatCompletionResponse answered, "
    "with the request's metadata, request_id and sampling parameters.",
)
_MESSAGE = Schema(
    type=OpenAPIType.OBJECT,
    required=["id", "role", "content", "name", "content_parts"],
    properties={
        "id": _STRING,
        "role": _STRING,
        "content": _NULLABLE_STRING,
        "name": _NULLABLE_STRING,
        "content_parts": Schema(
            one_of=[
                Schema(type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.OBJECT)),
                Schema(type=OpenAPIType.NULL),
            ]
        ),
    },
)


def _list_of(item: Schema) -> Schema:
    return Schema(
        type=OpenAPIType.OBJECT,
        required=["object", "data", "first_id", "last_id", "has_more"],
        properties={
            "object": Schema(type=OpenAPIType.STRING, enum=["list"]),
            "data": Schema(type=OpenAPIType.ARRAY, items=item),
            "first_id": _NULLABLE_STRING,
            "last_id": _NULLABLE_STRING,
            "has_more": Schema(type=OpenAPIType.BOOLEAN),
        },
    )


_DELETED = Schema(
    type=OpenAPIType.OBJECT,
    required=["object", "id", "deleted"],
    properties={
        "object": Schema(type=OpenAPIType.STRING, enum=["chat.completion.deleted"]),
        "id": _STRING,
        "deleted": Schema(type=OpenAPIType.BOOLEAN),
    },
)
_METADATA = Schema(
    type=OpenAPIType.OBJECT,
    property_names=Schema(type=OpenAPIType.STRING, max_length=MAX_METADATA_KEY_CHARS),
    additional_properties=Schema(type=OpenAPIType.STRING, max_length=MAX_METADATA_VALUE_CHARS),
    max_properties=MAX_METADATA_KEYS,
)


def _param(name: str, schema: Schema, description: str, **extra: Any) -> Parameter:
    return Parameter(
        name=name, param_in=ParamType.QUERY, schema=schema, description=description, **extra
    )


_PAGE = [
    _param("after", _STRING, "The last id of the previous page."),
    _param(
        "limit",
        Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=MAX_LIMIT),
        "How many to return (default 20).",
    ),
    _param(
        "order",
        Schema(type=OpenAPIType.STRING, enum=["asc", "desc"]),
        "By creation time (default asc).",
    ),
]
_FILTERS = [
    _param("model", _STRING, "Only completions of this model."),
    _param(
        "metadata",
        Schema(type=OpenAPIType.OBJECT, additional_properties=_STRING),
        "Only completions whose metadata has these values: metadata[key]=value.",
        style="deepObject",
        explode=True,
    ),
]


def _operation(
    ok: Schema,
    description: str,
    *,
    query: Sequence[Parameter] = (),
    body: Schema | None = None,
    by_id: bool = True,
) -> type[Operation]:
    """An operation class that describes one endpoint's query, body and responses."""

    @dataclass
    class StoredOperation(Operation):
        def __post_init__(self) -> None:
            self.parameters = [*(self.parameters or []), *query] or None
            if body is not None:
                self.request_body = RequestBody(
                    required=True, content={"application/json": MediaType(schema=body)}
                )
            responses: dict[str, Any] = {
                "200": OpenAPIResponse(
                    description=description, content={"application/json": MediaType(schema=ok)}
                ),
                "400": error("Invalid query or body (the error names the parameter)."),
                "401": error("Missing or wrong API key."),
                "403": error("Origin not allowed."),
            }
            if by_id:
                responses["404"] = error("No stored chat completion has this id.")
            if body is not None:
                responses["413"] = error("Body too large.")
            self.responses = responses

    return StoredOperation


_LIST_OPERATION = _operation(
    _list_of(_COMPLETION), "A page of stored chat completions.", query=[*_FILTERS, *_PAGE]
)
_GET_OPERATION = _operation(_COMPLETION, "The stored chat completion.")
_UPDATE_OPERATION = _operation(
    _COMPLETION,
    "The stored chat completion, with its new metadata.",
    body=Schema(
        type=OpenAPIType.OBJECT,
        required=["metadata"],
        properties={"metadata": Schema(one_of=[_METADATA, Schema(type=OpenAPIType.NULL)])},
    ),
)
_DELETE_OPERATION = _operation(_DELETED, "The chat completion was deleted.")
_MESSAGES_OPERATION = _operation(
    _list_of(_MESSAGE), "A page of the request's messages.", query=_PAGE
)


# --- the endpoints --------------------------------------------------------------------------


def _query(request: Request[Any, Any, Any]) -> list[tuple[str, str]]:
    query: bytes = request.scope.get("query_string", b"")
    return parse_qsl(query.decode("latin-1"), keep_blank_values=True)


def _json(body: bytes) -> Response[bytes]:
    return Response(content=body, media_type="application/json")


@get("/v1/chat/completions", operation_class=_LIST_OPERATION)
async def list_stored(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    """List stored chat completions (`store: true`), oldest first unless `order=desc`."""
    store: CompletionStore = state.store
    return _json(store.list(parse_list_query(_query(request))))


@get(COMPLETION_PATH, operation_class=_GET_OPERATION)
async def get_stored(completion_id: FromPath[str], state: State) -> Response[bytes]:
    """A stored chat completion."""
    store: CompletionStore = state.store
    return _json(store.get(completion_id))


@post(COMPLETION_PATH, status_code=200, operation_class=_UPDATE_OPERATION)
async def update_stored(
    completion_id: FromPath[str], request: Request[Any, Any, Any], state: State
) -> Response[bytes]:
    """Replace a stored chat completion's metadata (the only change OpenAI allows)."""
    store: CompletionStore = state.store
    metadata = parse_update(await request.body())
    return _json(store.update(completion_id, metadata))


@delete(COMPLETION_PATH, status_code=200, operation_class=_DELETE_OPERATION)
async def delete_stored(completion_id: FromPath[str], state: State) -> Response[bytes]:
    """Delete a stored chat completion."""
    store: CompletionStore = state.store
    return _json(store.delete(completion_id))


@get(COMPLETION_PATH + "/messages", operation_class=_MESSAGES_OPERATION)
async def list_stored_messages(
    completion_id: FromPath[str], request: Request[Any, Any, Any], state: State
) -> Response[bytes]:
    """The messages of a stored chat completion's request, in order."""
    store: CompletionStore = state.store
    return _json(store.messages(completion_id, parse_messages_query(_query(request))))


ROUTES: list[Any] = [list_stored, get_stored, update_stored, delete_stored, list_stored_messages]
"""The stored completions' route handlers, mounted with the chat's (gateway.openai.router)."""
