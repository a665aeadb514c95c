"""Parse an OpenAI Chat Completions request body into a validated `ChatRequest`.

Validation is as strict as OpenAI's (openapi.yaml's CreateChatCompletionRequest): wrong types,
out-of-range values, unknown fields and missing required fields are 400s whose `param` names
the field the way OpenAI does ("temperature", "messages[0].role", "stop[1]"), and whose `code`
is OpenAI's ("invalid_type", "decimal_above_max_value", "missing_required_parameter", ...).
A JSON null means "not given" for every optional field.

Parameters we do not implement are refused with a 400 naming them (code
"unsupported_parameter" or "unsupported_value"), never silently dropped; their default values
are accepted (n=1, modalities ["text"], ...). Fields with no effect on the output are
accepted: user, service_tier auto/default, safety_identifier, the prompt-cache hints, and
`audio` when `modalities` does not ask for audio (OpenAI ignores it there too). Tools and
response formats are parsed in `protocol.openai.tools`.

`store: true` is accepted where the server keeps stored completions (`store=True`; the
request then carries a `StoreRequest`, protocol.openai.chat.stored), refused otherwise; `metadata`
only with it, as at OpenAI.

The model is examined first: a missing or mistyped `model`, then (with a `check_model`) an
unknown one, are answered before anything else in the body, as OpenAI does.

Extensions beyond OpenAI (vLLM's names): `top_k` (-1 or 0: off), `min_p`,
`chat_template_kwargs` (extra chat-template variables) and
`stream_options.continuous_usage_stats` (requires include_usage).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import orjson

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    check_keys,
    fail_array_too_long,
    fail_empty_array,
    fail_type,
    fail_unsupported,
    fail_unsupported_kind,
    fail_unsupported_value,
    fail_value,
    read_bool,
    read_int,
    read_json,
    read_one_of,
    read_required,
    read_required_str,
    read_str,
)
from protocol.core.limits import (
    INT64_MAX,
    MAX_MESSAGES,
    CheckModel,
    check_ceiling,
    check_messages_chars,
    read_model_first,
)
from protocol.core.tools import parse_tools
from protocol.frames import (
    Generate,
    Message,
    ReasoningEffort,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
)
from protocol.openai.chat.stored import StoreRequest, store_request
from protocol.openai.params import (
    MAX_N,
    check_accepted,
    parse_metadata,
    parse_reasoning_effort,
    parse_sampling,
    parse_stop,
    parse_stream_options,
)
from protocol.openai.tools import (
    check_parallel_tool_calls,
    parse_response_format,
    parse_tool_calls,
    parse_tool_choice,
)

MAX_CONTENT_PARTS = 256
"""Content parts in one message."""

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_ALL_ROLES = ("system", "assistant", "user", "function", "tool", "developer")
_MESSAGE_KEYS: dict[str, frozenset[str]] = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    # What the OpenAI SDK sends back when a client appends a response's message to its history
    # (reasoning_content is ours, from the response, and vLLM's older name; `reasoning` its
    # newer one: either goes back to the chat template).
    "assistant": frozenset(
        {"role", "content", "name", "refusal", "audio", "tool_calls", "function_call"}
        | {"annotations", "reasoning_content", "reasoning"}
    ),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
_PART_TYPES: dict[str, tuple[str, ...]] = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
}
# fmt: off
_KNOWN = frozenset((
    # Honoured (top_k, min_p and chat_template_kwargs are vLLM's extensions).
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed",
    "stop", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "reasoning_effort", "chat_template_kwargs", "n",
    # Refused unless default (_check_unimplemented).
    "functions", "function_call", "modalities", "prediction", "web_search_options",
    "verbosity", "moderation", "service_tier",
    # Refused where the server stores nothing (_check_unimplemented); metadata needs it.
    "store", "metadata",
    # Accepted, no effect on the output (check_accepted).
    "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "audio",
))
# fmt: on
_NOT_IMPLEMENTED = {
    # Any non-null value is refused; the reason goes into the message.
    "functions": "the deprecated functions parameter is not implemented; use tools",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "web search is not implemented",
    "verbosity": "verbosity cannot be controlled",
    "moderation": "moderation is not implemented",
}
MAX_TOP_LOGPROBS = 20
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024


@attrs.frozen
class ChatRequest:
    """A validated chat completion request."""

    model: str
    messages: tuple[Message, ...]
    stream: bool = False
    include_usage: bool = False
    """Streaming only: send a final chunk with the whole request's usage."""
    continuous_usage_stats: bool = False
    """Streaming only (implies include_usage): every chunk carries the usage so far."""
    max_tokens: int | None = None
    """The effective completion bound: max_completion_tokens or its older name max_tokens."""
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    chat_template_kwargs: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    n: int = 1
    store: StoreRequest | None = None
    """`store: true`: what the stored completion keeps of the request."""

    def check_ceilings(self, max_tokens: int, choices: int) -> None:
        """The gateway's own ceilings (`--max-tokens-limit`, `--max-choices`), on top of the
        API's validation."""
        check_ceiling(self.max_tokens, max_tokens, "max_tokens")
        check_ceiling(self.n, choices, "n", " choices per request")

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
            response_format=self.response_format,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            chat_template_kwargs=self.chat_template_kwargs,
            reasoning_effort=self.reasoning_effort,
            n=self.n,
        )


def parse_chat_request(
    body: bytes, check_model: CheckModel | None = None, *, store: bool = False
) -> ChatRequest:
    """Validate a `POST /v1/chat/completions` body; raise `ApiError` (400) on any problem.
    `store`: the server keeps stored completions (else `store: true` is refused)."""
    return parse_chat_object(read_json(body), check_model, store=store)


def parse_chat_object(
    data: Any, check_model: CheckModel | None = None, *, store: bool = False
) -> ChatRequest:
    """Validate an already-decoded request body (the WebSocket API's `body`)."""
    model = read_model_first(data, _KNOWN, check_model)

    messages = _messages(read_required(data, "messages", ""))

    stream = read_bool(data, "stream") or False
    include_usage, continuous = parse_stream_options(data.get("stream_options"), stream)

    max_tokens = read_int(data, "max_tokens", 1, INT64_MAX)
    max_completion_tokens = read_int(data, "max_completion_tokens", 1, INT64_MAX)
    if max_tokens is not None and max_completion_tokens is not None:
        raise invalid_request(
            "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported.",
            "max_tokens",
            "invalid_parameter_combination",
        )

    sampling = parse_sampling(data)
    stop = parse_stop(data.get("stop"))
    tools = parse_tools(data.get("tools"))
    tool_choice, tool_name = parse_tool_choice(data.get("tool_choice"), tools)
    parallel_tool_calls = check_parallel_tool_calls(data.get("parallel_tool_calls"), tools)
    response_format = parse_response_format(data.get("response_format"))
    logprobs, top_logprobs = _logprobs(data)
    _check_unimplemented(data, store)
    check_accepted(data)
    metadata = parse_metadata(data.get("metadata"))
    stored = data.get("store") is True
    if metadata is not None and not stored:
        raise invalid_request(
            "Invalid value for 'metadata': 'metadata' is only allowed when 'store' is enabled.",
            "metadata",
            "invalid_parameter_combination",
        )
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        stop=stop,
        sampling=sampling,
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=parallel_tool_calls,
        response_format=response_format,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        chat_template_kwargs=_template_kwargs(data.get("chat_template_kwargs")),
        reasoning_effort=parse_reasoning_effort(data.get("reasoning_effort")),
        n=read_int(data, "n", 1, MAX_N) or 1,
        store=store_request(data, messages, sampling, metadata) if stored else None,
    )


def _logprobs(data: dict[str, Any]) -> tuple[bool, int]:
    logprobs = read_bool(data, "logprobs") or False
    top = read_int(data, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid_request(
            "Invalid value for 'top_logprobs': 'logprobs' must be set to true when "
            "'top_logprobs' is given.",
            "top_logprobs",
            "invalid_parameter_combination",
        )
    return logprobs, top or 0


def _template_kwargs(value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not dict:
        fail_type("chat_template_kwargs", "an object", value)
    text = orjson.dumps(value)
    if len(text) > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid_request(
            f"Invalid 'chat_template_kwargs': too large ({len(text)} bytes of JSON; at most "
            f"{MAX_TEMPLATE_KWARGS_BYTES}).",
            "chat_template_kwargs",
            "string_above_max_length",
        )
    return text.decode()


# --- messages -------------------------------------------------------------------------------


def _messages(value: Any) -> tuple[Message, ...]:
    if type(value) is not list:
        fail_type("messages", "an array", value)
    if not value:
        fail_empty_array("messages")
    if len(value) > MAX_MESSAGES:
        fail_array_too_long("messages", MAX_MESSAGES, len(value))
    messages = tuple(_message(item, f"messages[{i}]") for i, item in enumerate(value))
    check_messages_chars(
        sum(len(m.content) + len(m.name or "") + len(m.reasoning or "") for m in messages)
    )
    return messages


def _message(value: Any, path: str) -> Message:
    if type(value) is not dict:
        fail_type(path, "an object", value)
    role_name = read_one_of(value, "role", path, _ALL_ROLES)
    if role_name == "function":
        fail_unsupported_kind(
            f"{path}.role",
            role_name,
            "the deprecated function role is not implemented; use tool messages",
        )
    role = ROLES[role_name]
    allowed = _MESSAGE_KEYS[role]
    check_keys(value, path, allowed)
    name = read_str(value, "name", path)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id = reasoning = None
    if role == "assistant":
        tool_calls, reasoning = _assistant_extras(value, path)
        if value.get("content") is None:
            if tool_calls:
                return Message(
                    role=role, content="", name=name, tool_calls=tool_calls, reasoning=reasoning
                )
            raise invalid_request(
                f"Missing required parameter: '{path}.content'.",
                f"{path}.content",
                "missing_required_parameter",
            )
    elif role == "tool":
        tool_call_id = read_required_str(value, "tool_call_id", path)
    content = _content(read_required(value, "content", path), f"{path}.content", role)
    return Message(
        role=role,
        content=content,
        name=name,
        tool_calls=tool_calls,
        tool_call_id=tool_call_id,
        reasoning=reasoning,
    )


def _assistant_extras(value: dict[str, Any], path: str) -> tuple[tuple[ToolCall, ...], str | None]:
    """An assistant message's calls and reasoning (`reasoning_content`, else `reasoning`)."""
    tool_calls = parse_tool_calls(value.get("tool_calls"), f"{path}.tool_calls")
    for key, reason in (
        ("function_call", "function calling is not implemented"),
        ("audio", "audio is not implemented"),
    ):
        if value.get(key) is not None:
            fail_unsupported(f"{path}.{key}", reason)
    if read_str(value, "refusal", path) is not None:
        fail_unsupported(f"{path}.refusal", "refusals cannot be given back to the model")
    reasoning = read_str(value, "reasoning_content", path)
    other = read_str(value, "reasoning", path)
    if reasoning is not None and other is not None and other != reasoning:
        raise invalid_request(
            f"Invalid '{path}': reasoning_content and reasoning differ; send one of them.",
            f"{path}.reasoning",
            "invalid_value",
        )
    annotations = value.get("annotations")
    if annotations is not None and type(annotations) is not list:
        fail_type(f"{path}.annotations", "an array", annotations)
    return tool_calls, reasoning if reasoning is not None else other


def _content(value: Any, path: str, role: Role) -> str:
    if type(value) is str:
        return value
    if type(value) is not list:
        fail_type(path, "one of a string or array of objects", value)
    if not value:
        fail_empty_array(path)
    if len(value) > MAX_CONTENT_PARTS:
        fail_array_too_long(path, MAX_CONTENT_PARTS, len(value))
    # Text parts are joined with a newline, as vLLM does.
    return "\n".join(_text_part(part, f"{path}[{j}]", role) for j, part in enumerate(value))


def _text_part(part: Any, path: str, role: Role) -> str:
    if type(part) is not dict:
        fail_type(path, "an object", part)
    kind = read_one_of(part, "type", path, _PART_TYPES[role])
    if kind != "text":
        fail_unsupported_kind(f"{path}.type", kind, "only text content parts are supported")
    check_keys(part, path, ("type", "text", "prompt_cache_breakpoint"))
    text = read_required_str(part, "text", path)
    breakpoint_ = part.get("prompt_cache_breakpoint")
    if breakpoint_ is not None and breakpoint_ != {"mode": "explicit"}:
        fail_value(f"{path}.prompt_cache_breakpoint", breakpoint_, ('{"mode": "explicit"}',))
    return text


# --- generation parameters ------------------------------------------------------------------


def _check_unimplemented(data: dict[str, Any], store: bool) -> None:
    """Refuse every parameter we do not implement unless it has its default value (`store`
    where the server keeps no stored completions)."""
    for key, reason in _NOT_IMPLEMENTED.items():
        if data.get(key) is not None:
            fail_unsupported(key, reason)
    if data.get("function_call") not in (None, "none"):
        fail_unsupported("function_call", "the deprecated function_call is not implemented")
    modalities = data.get("modalities")
    if modalities is not None and modalities != ["text"]:
        if type(modalities) is not list:
            fail_type("modalities", "an array", modalities)
        fail_unsupported_value("modalities", modalities, '["text"]')
    if read_bool(data, "store") and not store:
        fail_unsupported_value("store", True, "false")

    tier = read_str(data, "service_tier")
    if tier is not None and tier not in ("auto", "default"):
        if tier not in ("flex", "scale", "priority", "fast"):
            fail_value(
                "service_tier", tier, ("auto", "default", "flex", "scale", "priority", "fast")
            )
        fail_unsupported_value("service_tier", tier, "auto")
