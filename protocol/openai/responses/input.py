"""The `input` of a Responses request (protocol.openai.responses) as chat messages.

A string is one user message. A list holds items: messages (`type` "message", or the SDK's
easy form with only `role` and `content`), `function_call` items (the model's earlier calls:
they join the assistant message before them, so that one turn's calls are one message, as in
chat) and `function_call_output` items (tool messages). A `reasoning` item given back is the
reasoning of the assistant message or calls after it (chat's `reasoning_content`): the chat
template decides whether it is rendered. A `compaction` item (POST /v1/responses/compact's)
is its summary, given as a user message (protocol.openai.responses.compaction). Images,
files, audio, the built-in tools' items and item references are refused, naming the item's
`type`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    check_keys,
    fail_array_too_long,
    fail_empty_array,
    fail_type,
    fail_unsupported,
    fail_unsupported_kind,
    fail_value,
    read_one_of,
    read_required,
    read_required_str,
    read_str,
)
from protocol.core.limits import MAX_MESSAGES, MAX_PROMPT_CHARS
from protocol.frames import Message, ToolCall
from protocol.openai.responses.compaction import decode_summary, summary_message

MAX_CONTENT_PARTS = 256
_MESSAGE_ROLES: tuple[Literal["user", "system", "developer", "assistant"], ...] = (
    "user",
    "system",
    "developer",
    "assistant",
)
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "compaction")
_OTHER_ITEM_TYPES = (
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "web_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "custom_tool_call",
    "custom_tool_call_output",
    "item_reference",
)
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


def parse_input(value: Any) -> tuple[Message, ...]:
    """`input`: a string (one user message) or a list of items, as messages."""
    if type(value) is str:
        return _bounded((Message("user", value),))
    if type(value) is not list:
        fail_type("input", "one of a string or array of objects", value)
    if not value:
        fail_empty_array("input")
    if len(value) > MAX_MESSAGES:
        fail_array_too_long("input", MAX_MESSAGES, len(value))
    found: list[Message] = []
    for i, item in enumerate(value):
        _item(item, f"input[{i}]", found)
    # A reasoning item that no assistant message or call followed has nothing to go with.
    messages = [m for m in found if not _reasoning_only(m)]
    if not messages:
        raise invalid_request(
            "Invalid 'input': no message, function_call or function_call_output item (a "
            "reasoning item goes with the assistant message or call after it).",
            "input",
            "empty_array",
        )
    return _bounded(tuple(messages))


def _bounded(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """The input's messages, at most MAX_PROMPT_CHARS in all (a plain string too)."""
    chars = sum(
        len(m.content) + len(m.reasoning or "") + sum(len(c.arguments) for c in m.tool_calls)
        for m in messages
    )
    if chars > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"Invalid 'input': too long ({chars} characters; at most {MAX_PROMPT_CHARS}).",
            "input",
            "string_above_max_length",
        )
    return messages


def _item(value: Any, path: str, out: list[Message]) -> None:
    """Append what one input item says to `out`: a function call joins the assistant
    message before it (several calls of one turn are one assistant message)."""
    if type(value) is not dict:
        fail_type(path, "an object", value)
    kind = value.get("type")
    if kind is None and "role" in value:
        kind = "message"  # EasyInputMessage
    if kind is None:
        read_required(value, "type", path)
    if type(kind) is not str:
        fail_type(f"{path}.type", "a string", kind)
    last = out[-1] if out else None
    if kind == "message":
        message = _message(value, path)
        if message.role == "assistant" and last is not None and _reasoning_only(last):
            out[-1] = attrs.evolve(last, content=message.content)
        else:
            out.append(message)
    elif kind == "function_call":
        call = _function_call(value, path)
        if last is not None and last.role == "assistant":
            out[-1] = attrs.evolve(last, tool_calls=(*last.tool_calls, call))
        else:
            out.append(Message("assistant", "", tool_calls=(call,)))
    elif kind == "function_call_output":
        out.append(_function_call_output(value, path))
    elif kind == "reasoning":
        text = _reasoning_item(value, path)
        if last is not None and _reasoning_only(last):
            out[-1] = attrs.evolve(last, reasoning=f"{last.reasoning}\n{text}")
        else:
            out.append(Message("assistant", "", reasoning=text))
    elif kind == "compaction":
        out.append(_compaction(value, path))
    elif kind in _OTHER_ITEM_TYPES:
        fail_unsupported_kind(
            f"{path}.type",
            kind,
            "only message, function_call, function_call_output, reasoning and compaction items are "
            "supported (built-in tools run at OpenAI, not here)",
        )
    else:
        fail_value(f"{path}.type", kind, _ITEM_TYPES)


def _message(value: dict[str, Any], path: str) -> Message:
    check_keys(value, path, ("type", "role", "content", "id", "status", "phase"))
    role = read_one_of(value, "role", path, _MESSAGE_ROLES)
    read_str(value, "id", path)
    _status(value, path)
    phase = read_str(value, "phase", path)
    if phase is not None and phase not in ("commentary", "final_answer"):
        fail_value(f"{path}.phase", phase, ("commentary", "final_answer"))
    content = read_required(value, "content", path)
    text = _content(content, f"{path}.content", role)
    return Message(role=role, content=text)


def _status(value: dict[str, Any], path: str) -> None:
    status = read_str(value, "status", path)
    if status is not None and status not in ("in_progress", "completed", "incomplete"):
        fail_value(f"{path}.status", status, ("in_progress", "completed", "incomplete"))


def _content(value: Any, path: str, role: str) -> str:
    if type(value) is str:
        return value
    if type(value) is not list:
        fail_type(path, "one of a string or array of objects", value)
    if len(value) > MAX_CONTENT_PARTS:
        fail_array_too_long(path, MAX_CONTENT_PARTS, len(value))
    # Text parts are joined with a newline, as the chat parser does.
    return "\n".join(_part(part, f"{path}[{j}]", role) for j, part in enumerate(value))


def _part(part: Any, path: str, role: str) -> str:
    if type(part) is not dict:
        fail_type(path, "an object", part)
    kind = read_required_str(part, "type", path)
    expected = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    if kind in _UNSUPPORTED_PARTS and role != "assistant":
        fail_unsupported_kind(f"{path}.type", kind, "only text content parts are supported")
    if kind == "refusal" and role == "assistant":
        fail_unsupported(f"{path}.type", "refusals cannot be given back to the model")
    if kind not in expected:
        fail_value(f"{path}.type", kind, expected)
    if kind == "output_text":
        check_keys(part, path, ("type", "text", "annotations", "logprobs"))
        for key in ("annotations", "logprobs"):
            if part.get(key) is not None and type(part[key]) is not list:
                fail_type(f"{path}.{key}", "an array", part[key])
    else:
        check_keys(part, path, ("type", "text"))
    return read_required_str(part, "text", path)


def _function_call(value: dict[str, Any], path: str) -> ToolCall:
    check_keys(value, path, ("type", "call_id", "name", "arguments", "id", "status"))
    call_id = read_required_str(value, "call_id", path)
    name = read_required_str(value, "name", path)
    arguments = read_required_str(value, "arguments", path)
    read_str(value, "id", path)
    _status(value, path)
    return ToolCall(id=call_id, name=name, arguments=arguments)


def _function_call_output(value: dict[str, Any], path: str) -> Message:
    check_keys(value, path, ("type", "call_id", "output", "id", "status"))
    call_id = read_required_str(value, "call_id", path)
    output = read_required(value, "output", path)
    text = _content(output, f"{path}.output", "tool")
    read_str(value, "id", path)
    _status(value, path)
    return Message("tool", text, tool_call_id=call_id)


def _compaction(value: dict[str, Any], path: str) -> Message:
    """A compaction item (POST /v1/responses/compact's): its summary, as a user message."""
    check_keys(value, path, ("type", "id", "encrypted_content", "created_by"))
    read_str(value, "id", path)
    read_str(value, "created_by", path)
    content = read_required_str(value, "encrypted_content", path)
    return summary_message(decode_summary(content, f"{path}.encrypted_content"))


def _reasoning_only(message: Message) -> bool:
    """An assistant message made by a reasoning item, before what the reasoning led to."""
    return (
        message.role == "assistant"
        and message.reasoning is not None
        and not message.content
        and not message.tool_calls
    )


_REASONING_PARTS = {"content": "reasoning_text", "summary": "summary_text"}


def _reasoning_item(value: dict[str, Any], path: str) -> str:
    """A reasoning item given back: its text (the `reasoning_text` parts this server writes,
    else the `summary_text` parts another server wrote), each part on a line."""
    check_keys(value, path, ("type", "id", "summary", "content", "encrypted_content", "status"))
    texts: dict[str, list[str]] = {}
    for key, kind in _REASONING_PARTS.items():
        parts = value.get(key)
        if parts is None:
            continue
        if type(parts) is not list:
            fail_type(f"{path}.{key}", "an array", parts)
        if len(parts) > MAX_CONTENT_PARTS:
            fail_array_too_long(f"{path}.{key}", MAX_CONTENT_PARTS, len(parts))
        texts[key] = []
        for j, part in enumerate(parts):
            part_path = f"{path}.{key}[{j}]"
            if type(part) is not dict:
                fail_type(part_path, "an object", part)
            check_keys(part, part_path, ("type", "text"))
            if read_required_str(part, "type", part_path) != kind:
                fail_value(f"{part_path}.type", part["type"], (kind,))
            texts[key].append(read_required_str(part, "text", part_path))
    if value.get("encrypted_content") is not None:
        fail_unsupported(
            f"{path}.encrypted_content", "this server neither writes nor reads encrypted reasoning"
        )
    _status(value, path)
    return "\n".join(texts.get("content") or texts.get("summary") or [])
