"""A stored response's input items (`GET /v1/responses/{id}/input_items`): the conversation
it was generated from, as OpenAI's items, paged.

The items are the messages the response ran on, earlier turns (a `previous_response_id`
chain) and this turn's input, without the instructions (OpenAI keeps those apart): a user,
system or developer message is a `message` item with `input_text` parts; an assistant turn is
its `reasoning` item, its `message` with `output_text` and its `function_call`s; a tool result
is a `function_call_output`. Each gets its id when the response is stored, so that pages
(`after`) stay put. The list is newest first unless `order=asc`, as at OpenAI.

Also the query of retrieving a response (`parse_retrieve_query`): its events streamed again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from protocol.core.errors import invalid_request
from protocol.core.fields import fail_unknown, fail_unsupported_value, show
from protocol.frames import Message
from protocol.openai.pages import PageQuery, page_query, single_values
from protocol.openai.responses.events import function_call_item, message_item, reasoning_item

NewId = Callable[[str], str]


def input_items(messages: Sequence[Message], new_id: NewId) -> list[dict[str, Any]]:
    """The items of `messages`, oldest first, each with a new id (see the module docstring)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "assistant":
            if message.reasoning:
                items.append(reasoning_item(new_id("rs"), message.reasoning, "completed"))
            if message.content or not message.tool_calls:
                items.append(message_item(new_id("msg"), message.content, "completed"))
            items.extend(
                function_call_item(new_id("fc"), call.id, call.name, call.arguments, "completed")
                for call in message.tool_calls
            )
        elif message.role == "tool":
            items.append(
                {
                    "id": new_id("fco"),
                    "type": "function_call_output",
                    "call_id": message.tool_call_id,
                    "output": message.content,
                    "status": "completed",
                }
            )
        else:
            items.append(
                {
                    "id": new_id("msg"),
                    "type": "message",
                    "role": message.role,
                    "content": [{"type": "input_text", "text": message.content}],
                    "status": "completed",
                }
            )
    return items


def parse_input_items_query(params: Iterable[tuple[str, str]]) -> PageQuery:
    """The query of `GET /v1/responses/{id}/input_items` (`after`, `limit`, `order`, newest
    first by default); `include` is refused unless empty (nothing extra can be included)."""
    fields = single_values(params)
    for key, value in fields.items():
        if key in ("include", "include[]"):
            if value:
                fail_unsupported_value("include", value, "[]")
        elif key not in ("after", "limit", "order"):
            fail_unknown(key)
    return page_query(fields, default_order="desc")


@attrs.frozen
class RetrieveQuery:
    """The query of `GET /v1/responses/{id}`."""

    stream: bool = False
    """Send the response's events (a background response's) instead of the object."""
    starting_after: int = -1
    """Only the events after this sequence number (-1: all)."""


def _query_bool(key: str, text: str) -> bool:
    if text not in ("true", "false"):
        raise invalid_request(
            f"Invalid type for '{key}': expected a boolean (true or false), but got "
            f"{show(text)} instead.",
            key,
            "invalid_type",
        )
    return text == "true"


def parse_retrieve_query(params: Iterable[tuple[str, str]]) -> RetrieveQuery:
    """`stream`, `starting_after` (a sequence number, only with `stream=true`),
    `include_obfuscation` (taken; nothing is obfuscated) and `include` (refused unless
    empty)."""
    fields = single_values(params)
    stream = False
    after = -1
    for key, value in fields.items():
        if key in ("include", "include[]"):
            if value:
                fail_unsupported_value("include", value, "[]")
        elif key in ("stream", "include_obfuscation"):
            flag = _query_bool(key, value)
            stream = flag if key == "stream" else stream
        elif key == "starting_after":
            if not (value.isascii() and value.isdigit()) or len(value) > 18:
                raise invalid_request(
                    "Invalid type for 'starting_after': expected a sequence number (an integer "
                    f"from 0), but got {show(value)} instead.",
                    "starting_after",
                    "invalid_type",
                )
            after = int(value)
        else:
            fail_unknown(key)
    if "starting_after" in fields and not stream:
        raise invalid_request(
            "The 'starting_after' parameter is only allowed with 'stream=true'.",
            "starting_after",
            "invalid_parameter_combination",
        )
    return RetrieveQuery(stream, after)
