"""Stored chat completions (`store: true`) as OpenAI serves them: the objects, the query
parameters and the pagination, decided here. No I/O; the gateway's store is gateway.stores.chat.

What a stored completion keeps of its request is a `StoreRequest`, made by the request parser
(protocol.openai.chat.request) for a request with `store: true`. The stored object
(`GET /v1/chat/completions/{id}`, openapi.yaml's example there) is the `chat.completion` body
the client was answered, plus:

    request_id          the request's id (the `x-request-id` header of its HTTP response)
    metadata            the request's metadata (an object, empty when none was given)
    seed, temperature, top_p, presence_penalty, frequency_penalty
                        the sampling parameters in effect (seed null when none was given)
    tools, tool_choice, response_format
                        as the request sent them (null when it did not)
    input_user          the request's `user` (null when not given)
    service_tier        "default"

Its messages (`GET /v1/chat/completions/{id}/messages`) are the request's, in order, each
`{id, role, content, name, content_parts}`: id `<completion id>-<index>`; content the text
the model was given (text parts joined with newlines; null for an assistant message with
only tool calls); content_parts the parts as sent (null for string content). An assistant
message with tool calls also has `tool_calls`, a tool message `tool_call_id`.

The list endpoints take `after` (the last id of the previous page), `limit` (1 to 100,
default 20) and `order` (`asc` or `desc` by creation, default `asc`); the completion list
also `model` and `metadata[key]=value` filters (all must match). A bad value, an unknown
parameter, a parameter given twice, or an `after` that names nothing (deleted or expired) is
a 400 naming the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    fail_unknown,
    read_json,
    read_object,
    show,
)
from protocol.frames import Message, SamplingParams
from protocol.openai.pages import PageQuery, page_query, single_values
from protocol.openai.params import parse_metadata

# --- what is stored ---------------------------------------------------------------------------


@attrs.frozen
class StoreRequest:
    """What a stored completion keeps of its request (see the module docstring)."""

    metadata: dict[str, str]
    messages: tuple[dict[str, Any], ...]
    """The message items, without their ids (those need the completion's id)."""
    settings: dict[str, Any]
    """The request's parameters the stored object shows."""


def store_request(
    data: dict[str, Any],
    messages: Sequence[Message],
    sampling: SamplingParams,
    metadata: dict[str, str] | None,
) -> StoreRequest:
    """The `StoreRequest` of a validated request body (`data`) and what it was parsed into."""
    items = []
    for raw, message in zip(data["messages"], messages, strict=True):
        parts = raw.get("content")
        item: dict[str, Any] = {
            "role": message.role,
            "content": None if raw.get("content") is None else message.content,
            "name": message.name,
            "content_parts": parts if type(parts) is list else None,
        }
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        items.append(item)
    settings = {
        "seed": sampling.seed,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "tools": data.get("tools"),
        "tool_choice": data.get("tool_choice"),
        "response_format": data.get("response_format"),
        "input_user": data.get("user"),
        "service_tier": "default",
    }
    return StoreRequest(metadata=metadata or {}, messages=tuple(items), settings=settings)


def stored_completion(
    body: dict[str, Any], request: StoreRequest, request_id: str, metadata: dict[str, str]
) -> dict[str, Any]:
    """The stored object of a completion: its `chat.completion` body and what the request
    adds (see the module docstring), with `metadata` (the request's, or as updated since)."""
    return {**body, "request_id": request_id, "metadata": metadata, **request.settings}


def stored_messages(completion_id: str, request: StoreRequest) -> list[dict[str, Any]]:
    """The message list items of a stored completion, with their ids."""
    return [
        {"id": f"{completion_id}-{index}", **item} for index, item in enumerate(request.messages)
    ]


def completion_deleted(completion_id: str) -> dict[str, Any]:
    """The answer to `DELETE /v1/chat/completions/{id}` (ChatCompletionDeleted)."""
    return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}


# --- query parameters ---------------------------------------------------------------------


@attrs.frozen
class ListQuery:
    """`GET /v1/chat/completions`: a page of the stored completions that match the filters."""

    page: PageQuery = attrs.Factory(PageQuery)
    model: str | None = None
    metadata: dict[str, str] = attrs.Factory(dict)
    """Every key must have this value."""

    def matches(self, model: str, metadata: dict[str, str]) -> bool:
        """True when a completion of `model` with `metadata` passes the filters."""
        if self.model is not None and model != self.model:
            return False
        return all(metadata.get(key) == value for key, value in self.metadata.items())


def parse_list_query(params: Iterable[tuple[str, str]]) -> ListQuery:
    """The query of `GET /v1/chat/completions`; raises `ApiError` (400) for a bad one."""
    fields = single_values(params)
    metadata: dict[str, str] = {}
    for key, value in fields.items():
        if key.startswith("metadata[") and key.endswith("]") and len(key) > len("metadata[]"):
            metadata[key[len("metadata[") : -1]] = value
        elif key == "metadata" or key.startswith("metadata["):
            raise invalid_request(
                f"Invalid query parameter {show(key)}: filter on metadata with "
                "'metadata[key]=value'.",
                "metadata",
                "invalid_type",
            )
        elif key not in ("after", "limit", "order", "model"):
            fail_unknown(key)
    return ListQuery(page=page_query(fields), model=fields.get("model"), metadata=metadata)


def parse_messages_query(params: Iterable[tuple[str, str]]) -> PageQuery:
    """The query of `GET /v1/chat/completions/{id}/messages`; raises `ApiError` (400)."""
    fields = single_values(params)
    for key in fields:
        if key not in ("after", "limit", "order"):
            fail_unknown(key)
    return page_query(fields)


def parse_update(body: bytes) -> dict[str, str]:
    """The body of `POST /v1/chat/completions/{id}`: `{"metadata": {...}}`, the new metadata
    (it replaces the old; null clears it). Raises `ApiError` (400)."""
    data = read_object(read_json(body))
    for key in data:
        if key != "metadata":
            fail_unknown(key)
    if "metadata" not in data:
        raise invalid_request(
            "Missing required parameter: 'metadata'.", "metadata", "missing_required_parameter"
        )
    return parse_metadata(data["metadata"]) or {}


# --- pages ----------------------------------------------------------------------------------
