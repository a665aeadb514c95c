"""Parse the tool-calling and output-format parts of a Chat Completions request.

`tools`, `tool_choice`, `parallel_tool_calls`, `response_format`, and the `tool_calls` of an
assistant message in the history, validated as openapi.yaml describes them (ChatCompletionTool,
ChatCompletionToolChoiceOption, ResponseFormatJsonSchema, ChatCompletionMessageToolCall) with
OpenAI's wording. JSON Schemas travel on as JSON text; whether the grammar library can enforce
one is the runner's to say (it answers a 400 naming the feature it cannot).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from protocol.frames import ResponseFormat, Tool, ToolCall, ToolChoice
from protocol.openai._fields import (
    _array,
    _bool,
    _check_keys,
    _fail_type,
    _fail_unsupported_value,
    _fail_value,
    _one_of,
    _required,
    _required_str,
    _show,
    _str,
)
from protocol.openai.errors import invalid_request

MAX_TOOLS = 128
"""OpenAI's limit on `tools`."""
MAX_NAME_CHARS = 64
MAX_TOOL_CALLS = 128
"""Tool calls in one assistant message of the history."""
_NAME = re.compile(r"[a-zA-Z0-9_-]+")
NAME_PATTERN = "^[a-zA-Z0-9_-]+$"
"""What a function (and a json_schema response format) may be named."""
_CHOICES: dict[str, ToolChoice] = {"none": "none", "auto": "auto", "required": "required"}


def parse_tools(value: Any) -> tuple[Tool, ...]:
    """`tools`: function tools only (custom tools are refused)."""
    items = _array(value, "tools", MAX_TOOLS)
    tools = tuple(_tool(item, f"tools[{i}]") for i, item in enumerate(items))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise invalid_request(
                f"Invalid 'tools[{i}].function.name': duplicate function name {_show(tool.name)}.",
                f"tools[{i}].function.name",
                "invalid_value",
            )
        seen.add(tool.name)
    return tools


def _tool(value: Any, path: str) -> Tool:
    if type(value) is not dict:
        _fail_type(path, "an object", value)
    kind = _one_of(value, "type", path, ("function", "custom"))
    if kind == "custom":
        _fail_unsupported_value(f"{path}.type", kind, "function")
    _check_keys(value, path, ("type", "function"))
    function = _required(value, "function", path)
    path = f"{path}.function"
    if type(function) is not dict:
        _fail_type(path, "an object", function)
    _check_keys(function, path, ("name", "description", "parameters", "strict"))
    name = _function_name(_required(function, "name", path), f"{path}.name")
    description = _str(function, "description", path)
    parameters = function.get("parameters")
    if parameters is not None and type(parameters) is not dict:
        _fail_type(f"{path}.parameters", "an object", parameters)
    strict = _bool(function, "strict", path) or False
    return Tool(
        name=name,
        description=description,
        parameters=None if parameters is None else orjson.dumps(parameters).decode(),
        strict=strict,
    )


def _function_name(value: Any, param: str) -> str:
    if type(value) is not str:
        _fail_type(param, "a string", value)
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


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None]:
    """`tool_choice` as (choice, function name); OpenAI's default is "auto" with tools."""
    if value is None:
        return "auto", None
    if type(value) is str:
        if value not in ("none", "auto", "required"):
            _fail_value("tool_choice", value, ("none", "auto", "required"))
        if not tools and value != "none":
            _only_with_tools("tool_choice")
        return _CHOICES[value], None
    if type(value) is not dict:
        _fail_type("tool_choice", "one of a string or object", value)
    kind = _one_of(value, "type", "tool_choice", ("function", "allowed_tools", "custom"))
    if kind != "function":
        _fail_unsupported_value("tool_choice.type", kind, "function")
    _check_keys(value, "tool_choice", ("type", "function"))
    function = _required(value, "function", "tool_choice")
    if type(function) is not dict:
        _fail_type("tool_choice.function", "an object", function)
    _check_keys(function, "tool_choice.function", ("name",))
    name = _function_name(
        _required(function, "name", "tool_choice.function"), "tool_choice.function.name"
    )
    if not tools:
        _only_with_tools("tool_choice")
    if all(tool.name != name for tool in tools):
        raise invalid_request(
            f"Invalid value for 'tool_choice': function {_show(name)} is not among the "
            "functions in 'tools'.",
            "tool_choice",
            "invalid_value",
        )
    return "function", name


def check_parallel_tool_calls(value: Any, tools: tuple[Tool, ...]) -> bool:
    """`parallel_tool_calls` (default true); OpenAI allows it only with tools."""
    if value is not None and type(value) is not bool:
        _fail_type("parallel_tool_calls", "a boolean", value)
    if value is not None and not tools:
        _only_with_tools("parallel_tool_calls")
    return True if value is None else value


def _only_with_tools(param: str) -> None:
    raise invalid_request(
        f"Invalid value for '{param}': '{param}' is only allowed when 'tools' are specified.",
        param,
        "invalid_parameter_combination",
    )


def parse_response_format(value: Any) -> ResponseFormat | None:
    """`response_format`; None for free text."""
    if value is None:
        return None
    if type(value) is not dict:
        _fail_type("response_format", "an object", value)
    kind = _one_of(value, "type", "response_format", ("text", "json_object", "json_schema"))
    allowed = ("type", "json_schema") if kind == "json_schema" else ("type",)
    _check_keys(value, "response_format", allowed)
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = _required(value, "json_schema", "response_format")
    path = "response_format.json_schema"
    if type(spec) is not dict:
        _fail_type(path, "an object", spec)
    _check_keys(spec, path, ("name", "description", "schema", "strict"))
    name = _function_name(_required(spec, "name", path), f"{path}.name")
    _str(spec, "description", path)
    schema = spec.get("schema")
    if schema is not None and type(schema) is not dict:
        _fail_type(f"{path}.schema", "an object", schema)
    strict = _bool(spec, "strict", path) or False
    return ResponseFormat(
        "json_schema",
        schema=orjson.dumps({} if schema is None else schema).decode(),
        name=name,
        strict=strict,
    )


def parse_tool_calls(value: Any, path: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` in the history."""
    items = _array(value, path, MAX_TOOL_CALLS)
    return tuple(_tool_call(item, f"{path}[{i}]") for i, item in enumerate(items))


def _tool_call(value: Any, path: str) -> ToolCall:
    if type(value) is not dict:
        _fail_type(path, "an object", value)
    _check_keys(value, path, ("id", "type", "function"))
    call_id = _required_str(value, "id", path)
    _one_of(value, "type", path, ("function",))
    function = _required(value, "function", path)
    if type(function) is not dict:
        _fail_type(f"{path}.function", "an object", function)
    _check_keys(function, f"{path}.function", ("name", "arguments"))
    name = _required_str(function, "name", f"{path}.function")
    arguments = _required_str(function, "arguments", f"{path}.function")
    return ToolCall(id=call_id, name=name, arguments=arguments)
