"""What the dialects that take a tool call's input as a JSON object do with one whose
arguments are not an object (a call cut short by the token limit, say): its text, as the
model wrote it, goes out as content instead. Nothing is dropped or made up."""

from __future__ import annotations

from typing import Any

import orjson


def call_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as an object, or None when they are not a JSON object."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return parsed if type(parsed) is dict else None


def call_text(name: str, arguments: str) -> str:
    """A call that cannot be a structured one, as text: `{"name": ..., "arguments": ...}`
    with the arguments as the model wrote them."""
    return f'{{"name": {orjson.dumps(name).decode()}, "arguments": {arguments}}}'
