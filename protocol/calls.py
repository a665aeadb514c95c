"""What the dialects that take a tool call's input as a JSON object do with one whose
arguments are not an object (a call cut short by the token limit, say): its text, as the
model wrote it, goes out as content instead. Nothing is dropped or made up.

An object goes out as the model wrote it, too: `call_input` hands back the arguments' own text
(an `orjson.Fragment`, which `orjson.dumps` embeds as it is), so that an integer past 64 bits
or a decimal such as `1.10` reaches the client digit for digit, never through a float.
"""

from __future__ import annotations

import json

import orjson


def call_input(arguments: str) -> orjson.Fragment | None:
    """A call's arguments as a JSON object to embed, or None when they are not one."""
    try:
        # The standard library's parser: orjson's turns an integer past 64 bits into a float
        # (or refuses it), and this only checks the text, which goes out unchanged.
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return None
    if type(parsed) is not dict:
        return None
    return orjson.Fragment(arguments.strip())


def call_text(name: str, arguments: str) -> str:
    """A call that cannot be a structured one, as text: `{"name": ..., "arguments": ...}`
    with the arguments as the model wrote them."""
    return f'{{"name": {orjson.dumps(name).decode()}, "arguments": {arguments}}}'
