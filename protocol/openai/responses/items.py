"""A stored response's input items (`GET /v1/responses/{id}/input_items`): the conversation
it was generated from, as OpenAI's items, paged.

The items are the messages the response ran on, earlier turns (a `previous_response_id`
chain) and this turn's input, without the instructions (OpenAI keeps those apart): a user,
system or developer message is a `message` item with `input_text` parts; an assistant turn is
its `reasoning` item, its `message` with `output_text` and its `function_call`s; a tool result
is a `function_call_output`. Each gets its id when the response is stored, so that pages
(`after`) stay put. The list is newest first unless `order=asc`, as at OpenAI.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from protocol.core.fields import fail_unknown, fail_unsupported_value
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
