"""Parse the tool-calling and output-format parts of a Chat Completions request.

`tool_choice`, `parallel_tool_calls`, `response_format`, and the `tool_calls` of an assistant
message in the history, validated as openapi.yaml describes them
(ChatCompletionToolChoiceOption, ResponseFormatJsonSchema, ChatCompletionMessageToolCall) with
OpenAI's wording; `tools` themselves are `protocol.core.tools`' (Ollama takes them too). JSON
Schemas travel on as JSON text; whether the grammar library can enforce one is the runner's to
say (it answers a 400 naming the feature it cannot).
"""

from __future__ import annotations

from typing import Any

import orjson

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    check_keys,
    fail_type,
    fail_unsupported_value,
    fail_value,
    read_array,
    read_bool,
    read_one_of,
    read_required,
    read_required_str,
    read_str,
    show,
)
from protocol.core.tools import check_function_name
from protocol.frames import ResponseFormat, Tool, ToolCall, ToolChoice

MAX_TOOL_CALLS = 128
"""Tool calls in one assistant message of the history."""
_CHOICES: dict[str, ToolChoice] = {"none": "none", "auto": "auto", "required": "required"}


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None]:
    """`tool_choice` as (choice, function name); OpenAI's default is "auto" with tools."""
    if value is None:
        return "auto", None
    if type(value) is str:
        if value not in ("none", "auto", "required"):
            fail_value("tool_choice", value, ("none", "auto", "required"))
        if not tools and value != "none":
            _only_with_tools("tool_choice")
        return _CHOICES[value], None
    if type(value) is not dict:
        fail_type("tool_choice", "one of a string or object", value)
    kind = read_one_of(value, "type", "tool_choice", ("function", "allowed_tools", "custom"))
    if kind != "function":
        fail_unsupported_value("tool_choice.type", kind, "function")
    check_keys(value, "tool_choice", ("type", "function"))
    function = read_required(value, "function", "tool_choice")
    if type(function) is not dict:
        fail_type("tool_choice.function", "an object", function)
    check_keys(function, "tool_choice.function", ("name",))
    name = check_function_name(
        read_required(function, "name", "tool_choice.function"), "tool_choice.function.name"
    )
    if not tools:
        _only_with_tools("tool_choice")
    if all(tool.name != name for tool in tools):
        raise invalid_request(
            f"Invalid value for 'tool_choice': function {show(name)} is not among the "
            "functions in 'tools'.",
            "tool_choice",
            "invalid_value",
        )
    return "function", name


def check_parallel_tool_calls(value: Any, tools: tuple[Tool, ...]) -> bool:
    """`parallel_tool_calls` (default true); OpenAI allows it only with tools."""
    if value is not None and type(value) is not bool:
        fail_type("parallel_tool_calls", "a boolean", value)
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
        fail_type("response_format", "an object", value)
    kind = read_one_of(value, "type", "response_format", ("text", "json_object", "json_schema"))
    allowed = ("type", "json_schema") if kind == "json_schema" else ("type",)
    check_keys(value, "response_format", allowed)
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = read_required(value, "json_schema", "response_format")
    path = "response_format.json_schema"
    if type(spec) is not dict:
        fail_type(path, "an object", spec)
    check_keys(spec, path, ("name", "description", "schema", "strict"))
    name = check_function_name(read_required(spec, "name", path), f"{path}.name")
    read_str(spec, "description", path)
    schema = spec.get("schema")
    if schema is not None and type(schema) is not dict:
        fail_type(f"{path}.schema", "an object", schema)
    strict = read_bool(spec, "strict", path) or False
    return ResponseFormat(
        "json_schema",
        schema=orjson.dumps({} if schema is None else schema).decode(),
        name=name,
        strict=strict,
    )


def parse_tool_calls(value: Any, path: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` in the history."""
    items = read_array(value, path, MAX_TOOL_CALLS)
    return tuple(_tool_call(item, f"{path}[{i}]") for i, item in enumerate(items))


def _tool_call(value: Any, path: str) -> ToolCall:
    if type(value) is not dict:
        fail_type(path, "an object", value)
    check_keys(value, path, ("id", "type", "function"))
    call_id = read_required_str(value, "id", path)
    read_one_of(value, "type", path, ("function",))
    function = read_required(value, "function", path)
    if type(function) is not dict:
        fail_type(f"{path}.function", "an object", function)
    check_keys(function, f"{path}.function", ("name", "arguments"))
    name = read_required_str(function, "name", f"{path}.function")
    arguments = read_required_str(function, "arguments", f"{path}.function")
    return ToolCall(id=call_id, name=name, arguments=arguments)
