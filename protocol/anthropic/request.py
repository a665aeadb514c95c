"""Parse an Anthropic Messages request body (`POST /v1/messages`) into `Generate`.

The body is checked as strictly as the chat's, with the same field readers and opening checks
(protocol.core.fields, protocol.core.limits: the model first, then unknown fields): a wrong
type, a missing required field (`max_tokens` included, as at Anthropic) or a field this server
does not implement is a 400 whose message names the field. Mapping onto the one internal request:

    system                 string or text blocks → a system message (blocks joined by "\\n")
    messages               user text blocks → a user message; tool_result blocks → tool
                           messages (before the user's text of the same turn); assistant text
                           and tool_use blocks → an assistant message with its tool calls;
                           its thinking blocks → its reasoning (as the chat's
                           reasoning_content: the chat template decides where it goes);
                           redacted_thinking blocks are checked and left out
    max_tokens             the completion bound (0 allowed: no token is generated)
    temperature, top_p, top_k   sampling (Anthropic's ranges: temperature 0..1)
    tools, tool_choice     function tools; auto / any (= required) / tool (= one function) /
                           none; disable_parallel_tool_use → parallel_tool_calls false
    thinking               enabled / disabled: the chat template's enable_thinking, as the
                           chat's reasoning_effort; absent: the model's default
    output_config          format (json_schema): the answer's text follows the schema, as
                           the chat's response_format; effort: the chat's reasoning_effort
                           (ignored when thinking is disabled)
    metadata               user_id accepted (no effect)
    cache_control          accepted on blocks and tools (the prefix cache is automatic)

    stop_sequences         the request's stop strings; the runner says which one ended the
                           answer (`stop_reason: "stop_sequence"`, `stop_sequence`)

Refused (400 naming the field): a final assistant turn (prefill: the chat template opens a
new turn instead of continuing it), images and documents, server tools, `adaptive` thinking,
and every other field.
"""

from __future__ import annotations

import re
from typing import Any, Literal, NoReturn

import attrs
import orjson

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    fail_array_too_long,
    fail_type,
    fail_unsupported,
    fail_value,
    read_array,
    read_bool,
    read_int,
    read_json,
    read_number,
    read_one_of,
    read_required,
    read_required_str,
    read_str,
    show,
)
from protocol.core.limits import (
    INT64_MAX,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    CheckModel,
    check_ceiling,
    read_model_first,
    read_stop_strings,
)
from protocol.frames import (
    Generate,
    Message,
    ReasoningEffort,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    unset_of,
)
from protocol.frames import ToolChoice as InternalToolChoice

MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 16
"""Orchard's bound (Anthropic documents none); each one as the chat's stop strings: not
empty, at most `MAX_STOP_CHARS` characters."""
MAX_BLOCKS = 256
"""Content blocks in one message (or the system prompt)."""
MIN_THINKING_BUDGET = 1024
"""Anthropic's least `thinking.budget_tokens`."""
_ROLES: tuple[Literal["user", "assistant"], ...] = ("user", "assistant")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
_THINKING_ON: ReasoningEffort = "medium"
"""Any effort but none/minimal: the template's enable_thinking=True."""

# fmt: off
_COMMON = frozenset((
    "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
))
# fmt: on
_KNOWN = _COMMON | {
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "metadata",
}  # fmt: skip
_COUNT_KNOWN = _COMMON


@attrs.frozen
class MessagesRequest:
    """A validated Messages request (or a count_tokens one: max_tokens 0, not streamed)."""

    model: str
    messages: tuple[Message, ...]
    max_tokens: int
    stream: bool = False
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    tools: tuple[Tool, ...] = ()
    tool_choice: InternalToolChoice = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: ReasoningEffort | None = None
    stop: tuple[str, ...] = ()
    response_format: ResponseFormat | None = None

    def check_ceilings(self, max_tokens: int, choices: int) -> None:
        """The gateway's own ceiling on the answer's length (`--max-tokens-limit`); one
        choice only, so `--max-choices` never binds."""
        check_ceiling(self.max_tokens, max_tokens, "max_tokens")

    def to_generate(self, request_id: str) -> Generate:
        """The internal request a runner executes."""
        return Generate(
            request_id=request_id,
            model=self.model,
            messages=self.messages,
            max_tokens=self.max_tokens,
            stop=self.stop,
            sampling=self.sampling,
            tools=self.tools,
            tool_choice=self.tool_choice,
            tool_name=self.tool_name,
            parallel_tool_calls=self.parallel_tool_calls,
            reasoning_effort=self.reasoning_effort,
            response_format=self.response_format,
        )


def parse_messages_request(body: bytes, check_model: CheckModel | None = None) -> MessagesRequest:
    """Validate a `POST /v1/messages` body; raise `ApiError` (400) on any problem."""
    data = read_json(body)
    model = read_model_first(data, _KNOWN, check_model)
    max_tokens = read_int(data, "max_tokens", 0, INT64_MAX)
    if max_tokens is None:
        _missing("max_tokens")
    stream = read_bool(data, "stream") or False
    stop = read_stop_strings(
        data.get("stop_sequences"), "stop_sequences", MAX_STOP_SEQUENCES, "an array of strings"
    )
    temperature = read_number(data, "temperature", 0, 1)
    top_p = read_number(data, "top_p", 0, 1)
    top_k = read_int(data, "top_k", 0, INT64_MAX)
    _metadata(data.get("metadata"))
    common = _common(data, model, max_tokens)
    return attrs.evolve(
        common,
        stream=stream,
        stop=stop,
        sampling=SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            unset=unset_of(temperature=temperature, top_p=top_p, top_k=top_k),
        ),
    )


def parse_count_request(body: bytes, check_model: CheckModel | None = None) -> MessagesRequest:
    """Validate a `POST /v1/messages/count_tokens` body (no max_tokens, sampling or stream):
    the request to count has `max_tokens` 0, so a runner reads its prompt and generates
    nothing."""
    data = read_json(body)
    model = read_model_first(data, _COUNT_KNOWN, check_model)
    return _common(data, model, 0)


def _common(data: dict[str, Any], model: str, max_tokens: int) -> MessagesRequest:
    """The fields both endpoints take: system, messages, tools, tool_choice, thinking."""
    system = _system(data.get("system"))
    messages = _messages(read_required(data, "messages", ""))
    chars = sum(len(m.content) + len(m.reasoning or "") for m in (*system, *messages))
    if chars > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"messages: too long ({chars} characters; at most {MAX_PROMPT_CHARS}).", "messages"
        )
    tools = _tools(data.get("tools"))
    tool_choice, tool_name, parallel = _tool_choice(data.get("tool_choice"), tools)
    effort = _thinking(data.get("thinking"), max_tokens)
    response_format, level = _output_config(data.get("output_config"))
    if level is not None and effort != "none":
        effort = level
    return MessagesRequest(
        model=model,
        messages=(*system, *messages),
        max_tokens=max_tokens,
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=parallel,
        reasoning_effort=effort,
        response_format=response_format,
    )


_EFFORTS: dict[str, ReasoningEffort] = {
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}


def _output_config(value: Any) -> tuple[ResponseFormat | None, ReasoningEffort | None]:
    """`output_config`: `format` (a JSON Schema the answer's text follows, as the chat's
    response_format json_schema) and `effort` (the chat's reasoning_effort, unless thinking
    is disabled)."""
    if value is None:
        return None, None
    if type(value) is not dict:
        fail_type("output_config", "an object", value)
    _keys(value, ("format", "effort"), "output_config")
    given = value.get("effort")
    effort = None if given is None else _EFFORTS.get(given) if type(given) is str else None
    if given is not None and effort is None:
        if type(given) is not str:
            fail_type("output_config.effort", "a string", given)
        fail_value("output_config.effort", given, tuple(_EFFORTS))
    spec = value.get("format")
    if spec is None:
        return None, effort
    path = "output_config.format"
    if type(spec) is not dict:
        fail_type(path, "an object", spec)
    kind = read_required(spec, "type", path)
    if kind != "json_schema":
        if type(kind) is not str:
            fail_type(f"{path}.type", "a string", kind)
        fail_value(f"{path}.type", kind, ("json_schema",))
    _keys(spec, ("type", "schema"), path)
    schema = read_required(spec, "schema", path)
    if type(schema) is not dict:
        fail_type(f"{path}.schema", "an object", schema)
    text = orjson.dumps(schema).decode()
    return ResponseFormat("json_schema", schema=text, strict=True), effort


def _missing(param: str) -> NoReturn:
    raise invalid_request(f"{param}: Field required", param, "missing_required_parameter")


def _unknown(param: str) -> NoReturn:
    raise invalid_request(f"{param}: Extra inputs are not permitted", param, "unknown_parameter")


def _keys(value: dict[str, Any], allowed: frozenset[str] | tuple[str, ...], path: str) -> None:
    for key in value:
        if key not in allowed:
            _unknown(f"{path}.{key}")


def _metadata(value: Any) -> None:
    if value is None:
        return
    if type(value) is not dict:
        fail_type("metadata", "an object", value)
    _keys(value, ("user_id",), "metadata")
    read_str(value, "user_id", "metadata")


def _cache_control(block: dict[str, Any], path: str) -> None:
    """Accepted and checked: our prefix cache is automatic, a breakpoint changes nothing."""
    value = block.get("cache_control")
    if value is None:
        return
    if type(value) is not dict:
        fail_type(f"{path}.cache_control", "an object", value)
    _keys(value, ("type", "ttl"), f"{path}.cache_control")
    if value.get("type") != "ephemeral":
        fail_value(f"{path}.cache_control.type", value.get("type"), ("ephemeral",))
    ttl = value.get("ttl")
    if ttl is not None and ttl not in ("5m", "1h"):
        fail_value(f"{path}.cache_control.ttl", ttl, ("5m", "1h"))


# --- system and messages --------------------------------------------------------------------


def _system(value: Any) -> tuple[Message, ...]:
    if type(value) is str:
        return (Message(role="system", content=value),)
    blocks = read_array(value, "system", MAX_BLOCKS, "a string or an array of text blocks")
    texts = [_text_block(block, f"system[{i}]") for i, block in enumerate(blocks)]
    return (Message(role="system", content="\n".join(texts)),) if texts else ()


def _block(value: Any, path: str) -> tuple[dict[str, Any], str]:
    if type(value) is not dict:
        fail_type(path, "an object", value)
    kind = read_required_str(value, "type", path)
    return value, kind


def _text_block(value: Any, path: str) -> str:
    block, kind = _block(value, path)
    if kind != "text":
        fail_value(f"{path}.type", kind, ("text",))
    _keys(block, ("type", "text", "cache_control", "citations"), path)
    if block.get("citations") is not None:
        fail_unsupported(f"{path}.citations", "citations are not implemented")
    _cache_control(block, path)
    return read_required_str(block, "text", path)


def _messages(value: Any) -> tuple[Message, ...]:
    if type(value) is not list:
        fail_type("messages", "an array", value)
    if not value:
        raise invalid_request("messages: at least one message is required", "messages")
    if len(value) > MAX_MESSAGES:
        fail_array_too_long("messages", MAX_MESSAGES, len(value))
    out: list[Message] = []
    for i, item in enumerate(value):
        out.extend(_message(item, f"messages[{i}]"))
    if value[-1].get("role") == "assistant":
        raise invalid_request(
            f"messages[{len(value) - 1}]: a final assistant message (prefill) is not supported "
            "with this server: the chat template opens a new assistant turn rather than "
            "continuing the last one.",
            f"messages[{len(value) - 1}]",
            "unsupported_value",
        )
    return tuple(out)


def _message(value: Any, path: str) -> list[Message]:
    if type(value) is not dict:
        fail_type(path, "an object", value)
    _keys(value, ("role", "content"), path)
    role = read_one_of(value, "role", path, _ROLES)
    content = read_required(value, "content", path)
    if type(content) is str:
        return [Message(role=role, content=content)]
    if type(content) is not list:
        fail_type(f"{path}.content", "a string or an array of content blocks", content)
    if len(content) > MAX_BLOCKS:
        fail_array_too_long(f"{path}.content", MAX_BLOCKS, len(content))
    if role == "user":
        return _user_blocks(content, f"{path}.content")
    return [_assistant_blocks(content, f"{path}.content")]


_REFUSED_BLOCKS = {
    "image": "images are not supported",
    "document": "documents are not supported",
    "search_result": "search results are not supported",
    "container_upload": "container uploads are not supported",
}


def _refuse_block(kind: str, path: str, supported: tuple[str, ...]) -> NoReturn:
    reason = _REFUSED_BLOCKS.get(kind)
    if reason is not None:
        fail_unsupported(f"{path}.type", f"{reason}; only {', '.join(supported)} blocks are")
    fail_value(f"{path}.type", kind, supported)


def _user_blocks(blocks: list[Any], path: str) -> list[Message]:
    results: list[Message] = []
    texts: list[str] = []
    for j, value in enumerate(blocks):
        block_path = f"{path}[{j}]"
        block, kind = _block(value, block_path)
        if kind == "text":
            texts.append(_text_block(block, block_path))
        elif kind == "tool_result":
            results.append(_tool_result(block, block_path))
        else:
            _refuse_block(kind, block_path, ("text", "tool_result"))
    if texts or not results:
        results.append(Message(role="user", content="\n".join(texts)))
    return results


def _tool_result(block: dict[str, Any], path: str) -> Message:
    _keys(block, ("type", "tool_use_id", "content", "is_error", "cache_control"), path)
    _cache_control(block, path)
    call_id = read_required_str(block, "tool_use_id", path)
    # The chat template has no error flag: the model reads the error in the content.
    read_bool(block, "is_error", path)
    content = block.get("content")
    if content is None:
        text = ""
    elif type(content) is str:
        text = content
    elif type(content) is list:
        text = "\n".join(
            _text_block(part, f"{path}.content[{k}]") for k, part in enumerate(content)
        )
    else:
        fail_type(f"{path}.content", "a string or an array of text blocks", content)
    return Message(role="tool", content=text, tool_call_id=call_id)


def _assistant_blocks(blocks: list[Any], path: str) -> Message:
    """An assistant turn: its text blocks joined, its tool_use blocks as calls and its
    thinking blocks as the reasoning (redacted thinking, which only Anthropic can read, is
    checked and left out)."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, value in enumerate(blocks):
        block_path = f"{path}[{j}]"
        block, kind = _block(value, block_path)
        if kind == "text":
            texts.append(_text_block(block, block_path))
        elif kind == "tool_use":
            calls.append(_tool_use(block, block_path))
        elif kind == "thinking":
            _keys(block, ("type", "thinking", "signature"), block_path)
            thoughts.append(read_required_str(block, "thinking", block_path))
            read_str(block, "signature", block_path)
        elif kind == "redacted_thinking":
            _keys(block, ("type", "data"), block_path)
            read_str(block, "data", block_path)
        else:
            _refuse_block(kind, block_path, ("text", "tool_use", "thinking", "redacted_thinking"))
    return Message(
        role="assistant",
        content="".join(texts),
        tool_calls=tuple(calls),
        reasoning="\n".join(thoughts) if thoughts else None,
    )


def _tool_use(block: dict[str, Any], path: str) -> ToolCall:
    _keys(block, ("type", "id", "name", "input", "cache_control"), path)
    _cache_control(block, path)
    call_id = read_required_str(block, "id", path)
    name = read_required_str(block, "name", path)
    arguments = read_required(block, "input", path)
    if type(arguments) is not dict:
        fail_type(f"{path}.input", "an object", arguments)
    return ToolCall(id=call_id, name=name, arguments=orjson.dumps(arguments).decode())


# --- tools and thinking ---------------------------------------------------------------------


def _tools(value: Any) -> tuple[Tool, ...]:
    tools: list[Tool] = []
    for i, item in enumerate(read_array(value, "tools", MAX_TOOLS)):
        path = f"tools[{i}]"
        if type(item) is not dict:
            fail_type(path, "an object", item)
        kind = item.get("type")
        if kind not in (None, "custom"):
            if type(kind) is not str:
                fail_type(f"{path}.type", "a string", kind)
            fail_unsupported(f"{path}.type", f"server tools ({show(kind)}) are not implemented")
        _keys(
            item, ("type", "name", "description", "input_schema", "cache_control", "strict"), path
        )
        _cache_control(item, path)
        name = read_required_str(item, "name", path)
        if not _TOOL_NAME.fullmatch(name):
            raise invalid_request(
                f"{path}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'",
                f"{path}.name",
            )
        if any(tool.name == name for tool in tools):
            raise invalid_request(f"{path}.name: tool names must be unique", f"{path}.name")
        description = read_str(item, "description", path)
        schema = read_required(item, "input_schema", path)
        if type(schema) is not dict:
            fail_type(f"{path}.input_schema", "an object", schema)
        if schema.get("type") != "object":
            fail_value(f"{path}.input_schema.type", schema.get("type"), ("object",))
        strict = read_bool(item, "strict", path) or False
        tools.append(
            Tool(name, description, parameters=orjson.dumps(schema).decode(), strict=strict)
        )
    return tuple(tools)


_CHOICES: dict[str, InternalToolChoice] = {
    "auto": "auto",
    "any": "required",
    "tool": "function",
    "none": "none",
}


def _tool_choice(
    value: Any, tools: tuple[Tool, ...]
) -> tuple[InternalToolChoice, str | None, bool]:
    """(choice, the tool's name for type "tool", parallel tool calls allowed)."""
    if value is None:
        return "auto", None, True
    if type(value) is not dict:
        fail_type("tool_choice", "an object", value)
    kind = read_one_of(value, "type", "tool_choice", tuple(_CHOICES))
    choice = _CHOICES[kind]
    allowed = ("type",) if kind == "none" else ("type", "disable_parallel_tool_use")
    _keys(value, ("name", *allowed) if kind == "tool" else allowed, "tool_choice")
    serial = read_bool(value, "disable_parallel_tool_use", "tool_choice") or False
    name = None
    if kind == "tool":
        name = read_required_str(value, "name", "tool_choice")
        if all(tool.name != name for tool in tools):
            raise invalid_request(
                f"tool_choice.name: no tool named {show(name)} in 'tools'", "tool_choice.name"
            )
    elif kind == "any" and not tools:
        raise invalid_request(
            "tool_choice: type 'any' needs at least one tool in 'tools'", "tool_choice"
        )
    return choice, name, not serial


def _thinking(value: Any, max_tokens: int) -> ReasoningEffort | None:
    if value is None:
        return None
    if type(value) is not dict:
        fail_type("thinking", "an object", value)
    kind: Literal["enabled", "disabled"] | Any = read_required(value, "type", "thinking")
    if kind == "disabled":
        _keys(value, ("type",), "thinking")
        return "none"
    if kind == "adaptive":
        fail_unsupported("thinking.type", "adaptive thinking is not implemented")
    if kind != "enabled":
        if type(kind) is not str:
            fail_type("thinking.type", "a string", kind)
        fail_value("thinking.type", kind, ("enabled", "disabled"))
    _keys(value, ("type", "budget_tokens", "display"), "thinking")
    budget = read_int(value, "budget_tokens", MIN_THINKING_BUDGET, INT64_MAX, "thinking")
    if budget is None:
        _missing("thinking.budget_tokens")
    if max_tokens and budget >= max_tokens:
        raise invalid_request(
            "thinking.budget_tokens: must be less than max_tokens", "thinking.budget_tokens"
        )
    display = value.get("display")
    if display not in (None, "summarized"):
        # Thinking is sent whole; "omitted" would have to leave it out.
        fail_value("thinking.display", display, ("summarized",))
    return _THINKING_ON
