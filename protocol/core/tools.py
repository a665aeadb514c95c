"""Function tools as the chat's `tools` and Ollama's `tools` give them:
`{"type": "function", "function": {name, description?, parameters?, strict?}}`, validated as
openapi.yaml describes them (ChatCompletionTool) with OpenAI's wording. The parameters' JSON
Schema travels on as JSON text.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    check_keys,
    fail_type,
    fail_unsupported_value,
    read_array,
    read_bool,
    read_one_of,
    read_required,
    read_str,
    show,
)
from protocol.frames import Tool

MAX_TOOLS = 128
"""OpenAI's limit on `tools`."""
MAX_NAME_CHARS = 64
_NAME = re.compile(r"[a-zA-Z0-9_-]+")
NAME_PATTERN = "^[a-zA-Z0-9_-]+$"
"""What a function (and a json_schema response format) may be named."""


def parse_tools(value: Any) -> tuple[Tool, ...]:
    """`tools`: function tools only (custom tools are refused)."""
    items = read_array(value, "tools", MAX_TOOLS)
    tools = tuple(_tool(item, f"tools[{i}]") for i, item in enumerate(items))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise invalid_request(
                f"Invalid 'tools[{i}].function.name': duplicate function name {show(tool.name)}.",
                f"tools[{i}].function.name",
                "invalid_value",
            )
        seen.add(tool.name)
    return tools


def _tool(value: Any, path: str) -> Tool:
    if type(value) is not dict:
        fail_type(path, "an object", value)
    kind = read_one_of(value, "type", path, ("function", "custom"))
    if kind == "custom":
        fail_unsupported_value(f"{path}.type", kind, "function")
    check_keys(value, path, ("type", "function"))
    function = read_required(value, "function", path)
    path = f"{path}.function"
    if type(function) is not dict:
        fail_type(path, "an object", function)
    check_keys(function, path, ("name", "description", "parameters", "strict"))
    name = check_function_name(read_required(function, "name", path), f"{path}.name")
    description = read_str(function, "description", path)
    parameters = function.get("parameters")
    if parameters is not None and type(parameters) is not dict:
        fail_type(f"{path}.parameters", "an object", parameters)
    strict = read_bool(function, "strict", path) or False
    return Tool(
        name=name,
        description=description,
        parameters=None if parameters is None else orjson.dumps(parameters).decode(),
        strict=strict,
    )


def check_function_name(value: Any, param: str) -> str:
    """A function's name: a string of at most MAX_NAME_CHARS, matching NAME_PATTERN."""
    if type(value) is not str:
        fail_type(param, "a string", value)
    if len(value) > MAX_NAME_CHARS:
        raise invalid_request(
            f"Invalid '{param}': string too long. Expected a string with maximum length "
            f"{MAX_NAME_CHARS}, but got a string with length {len(value)} instead.",
            param,
            "string_above_max_length",
        )
    if not _NAME.fullmatch(value):
        raise invalid_request(
            f"Invalid '{param}': string does not match pattern. Expected a string that "
            f"matches the pattern '{NAME_PATTERN}'.",
            param,
            "invalid_value",
        )
    return value
