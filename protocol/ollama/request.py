"""Parse Ollama's `/api/chat` and `/api/generate` bodies into a validated `OllamaRequest`.

The fields are Ollama's (api/types.go, and the `ollama` library's ChatRequest and
GenerateRequest). Honoured: `messages` (roles system, user, assistant, tool; an assistant's
`tool_calls` with arguments as an object; a tool message's `tool_name`), `prompt`, `system`,
`raw`, `stream` (true unless false), `format` ("json" or a JSON Schema), `tools`, `think`,
and the `options` temperature, top_p, top_k, min_p, num_predict, stop, seed,
presence_penalty and frequency_penalty. `keep_alive` is accepted and type-checked: runners
keep their models loaded, so it changes nothing.

Everything else is refused with a 400 naming the field, never dropped: unknown fields and
options, images, a generate `suffix`, `template` or `context`, logprobs, image generation.
Field readers and the wording of the messages are the chat's (protocol.core.fields), the model
is checked first as there (protocol.core.limits); the gateway writes the errors in Ollama's
shape (`{"error": ...}`).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import orjson

from protocol.core.errors import ApiError, invalid_request
from protocol.core.fields import (
    check_keys,
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
)
from protocol.core.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    SAMPLING_RANGES,
    CheckModel,
    check_ceiling,
    check_messages_chars,
    read_model_first,
    read_stop_strings,
)
from protocol.core.tools import parse_tools
from protocol.frames import (
    DEFAULTABLE,
    Generate,
    Message,
    ReasoningEffort,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    unset_of,
)

Endpoint = Literal["chat", "generate"]

OLLAMA_DEFAULTS = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, unset=DEFAULTABLE)
"""Ollama's sampling defaults where neither the request nor a Modelfile sets them (a
request without `options` sets none: a runner's defaults replace them all)."""

_COMMON = frozenset(
    {"model", "stream", "format", "options", "keep_alive", "think", "logprobs", "top_logprobs"}
)
_CHAT_KNOWN = _COMMON | {"messages", "tools"}
_GENERATE_KNOWN = _COMMON | {
    "prompt",
    "suffix",
    "system",
    "template",
    "context",
    "raw",
    "images",
    "width",
    "height",
    "steps",
}
_GENERATE_REFUSED = {
    # Refused when given a non-empty value; the reason goes into the message.
    "suffix": "fill-in-the-middle is not implemented",
    "template": "prompt templates are the model's own chat template",
    "context": "no token context is returned or taken back; send the conversation to /api/chat",
    "images": "images are not supported",
    "width": "image generation is not supported",
    "height": "image generation is not supported",
    "steps": "image generation is not supported",
}
_OPTIONS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "num_predict",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
    }
)
_ROLES: dict[str, Literal["system", "user", "assistant", "tool"]] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_MESSAGE_KEYS = {
    "system": frozenset({"role", "content", "images"}),
    "user": frozenset({"role", "content", "images"}),
    # `thinking` is what a response's message carries back: it goes back to the chat
    # template (as Chat Completions' reasoning_content).
    "assistant": frozenset({"role", "content", "images", "thinking", "tool_calls"}),
    "tool": frozenset({"role", "content", "images", "tool_name", "tool_call_id"}),
}
_THINK: dict[object, ReasoningEffort | None] = {
    # false turns thinking off through the chat template (`enable_thinking`), which any
    # model's template takes; the others ask for thinking, which a model without think
    # markers refuses (as Ollama does: see `in_ollama_terms`).
    False: None,
    True: "medium",
    "low": "low",
    "medium": "medium",
    "high": "high",
}
_NO_THINKING = '{"enable_thinking":false}'


def in_ollama_terms(err: ApiError, model: str) -> ApiError:
    """An error in the terms of this API: an unknown model worded as Ollama does, and the
    thinking the runner calls `reasoning_effort` is Ollama's `think`."""
    if err.code == "model_not_found":
        err.message = f'model "{model}" not found'
    elif err.param == "reasoning_effort":
        err.message = f'"{model}" does not support thinking'
        err.param = "think"
    return err


@attrs.frozen
class OllamaRequest:
    """A validated `/api/chat` or `/api/generate` request."""

    endpoint: Endpoint
    model: str
    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    """`/api/generate` with `raw: true`: the prompt as given, with no chat template."""
    stream: bool = True
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = OLLAMA_DEFAULTS
    tools: tuple[Tool, ...] = ()
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    thinking_off: bool = False
    """`think: false`: the chat template's `enable_thinking` is false."""

    @property
    def load_only(self) -> bool:
        """Nothing to generate (no messages, or an empty prompt): Ollama answers such a request
        by loading the model, `done_reason` "load"; Orchard's models are always loaded."""
        return not self.messages and not self.prompt

    def check_ceilings(self, max_tokens: int, choices: int) -> None:
        """The gateway's own ceiling on the answer's length (`--max-tokens-limit`); one
        choice only, so `--max-choices` never binds."""
        check_ceiling(self.max_tokens, max_tokens, "options.num_predict")

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
            response_format=self.response_format,
            reasoning_effort=self.reasoning_effort,
            chat_template_kwargs=_NO_THINKING if self.thinking_off else None,
            prompt=self.prompt,
        )


def parse_chat(body: bytes, check_model: CheckModel | None = None) -> OllamaRequest:
    """Validate a `POST /api/chat` body; raise `ApiError` (400) on any problem."""
    data = read_json(body)
    model = read_model_first(data, _CHAT_KNOWN, check_model)
    messages = _messages(data.get("messages"))
    return _request(data, "chat", model, messages=messages, tools=parse_tools(data.get("tools")))


def parse_generate(body: bytes, check_model: CheckModel | None = None) -> OllamaRequest:
    """Validate a `POST /api/generate` body; raise `ApiError` (400) on any problem."""
    data = read_json(body)
    model = read_model_first(data, _GENERATE_KNOWN, check_model)
    for key, reason in _GENERATE_REFUSED.items():
        value = data.get(key)
        if value not in (None, "", [], 0):
            fail_unsupported(key, reason)
    prompt = read_str(data, "prompt") or ""
    system = read_str(data, "system")
    raw = read_bool(data, "raw") or False
    if len(prompt) + len(system or "") > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"Invalid 'prompt': too long (at most {MAX_PROMPT_CHARS} characters).",
            "prompt",
            "string_above_max_length",
        )
    if raw:
        if system:
            raise invalid_request(
                "Invalid 'system': a raw prompt takes no system prompt.",
                "system",
                "invalid_parameter_combination",
            )
        return _request(data, "generate", model, prompt=prompt or None)
    messages: tuple[Message, ...] = ()
    if prompt:
        messages = ((Message("system", system),) if system else ()) + (Message("user", prompt),)
    return _request(data, "generate", model, messages=messages)


def _request(
    data: dict[str, Any],
    endpoint: Endpoint,
    model: str,
    *,
    messages: tuple[Message, ...] = (),
    prompt: str | None = None,
    tools: tuple[Tool, ...] = (),
) -> OllamaRequest:
    stream = read_bool(data, "stream")
    max_tokens, stop, sampling = _options(data.get("options"))
    _keep_alive(data.get("keep_alive"))
    if read_bool(data, "logprobs"):
        fail_unsupported("logprobs", "log-probabilities are not implemented for this API")
    if data.get("top_logprobs") not in (None, 0):
        fail_unsupported("top_logprobs", "log-probabilities are not implemented for this API")
    return OllamaRequest(
        endpoint=endpoint,
        model=model,
        messages=messages,
        prompt=prompt,
        stream=stream is not False,
        max_tokens=max_tokens,
        stop=stop,
        sampling=sampling,
        tools=tools,
        response_format=_format(data.get("format")),
        reasoning_effort=_think(data.get("think")),
        thinking_off=data.get("think") is False,
    )


def _format(value: Any) -> ResponseFormat | None:
    """`format`: "json" (any JSON object), a JSON Schema (an object), or ""/absent (text)."""
    if value is None or value == "":
        return None
    if value == "json":
        return ResponseFormat("json_object")
    if type(value) is str:
        fail_value("format", value, ("json",))
    if type(value) is not dict:
        fail_type("format", 'the string "json" or a JSON Schema object', value)
    return ResponseFormat("json_schema", schema=orjson.dumps(value).decode(), name="format")


def _think(value: Any) -> ReasoningEffort | None:
    if value is None:
        return None
    if type(value) not in (bool, str):
        fail_type("think", "a boolean or a string", value)
    if value not in _THINK:
        fail_value("think", value, ("true", "false", "low", "medium", "high"))
    return _THINK[value]


def _keep_alive(value: Any) -> None:
    """Accepted (a duration string like "5m", or seconds); models stay loaded on runners."""
    if value is not None and type(value) not in (int, float, str):
        fail_type("keep_alive", "a duration string or a number of seconds", value)


def _options(value: Any) -> tuple[int | None, tuple[str, ...], SamplingParams]:
    if value is None:
        return None, (), OLLAMA_DEFAULTS
    if type(value) is not dict:
        fail_type("options", "an object", value)
    for key in value:
        if key not in _OPTIONS:
            raise invalid_request(
                f"Unsupported option: 'options.{key}' is not supported with this server; "
                f"the supported options are {', '.join(sorted(_OPTIONS))}.",
                f"options.{key}",
                "unsupported_parameter",
            )
    path = "options"
    num_predict = read_int(value, "num_predict", -2, INT64_MAX, path)
    if num_predict == 0:
        raise invalid_request(
            "Invalid 'options.num_predict': 0. Expected a positive number of tokens, or -1 "
            "(no limit) or -2 (up to the context).",
            "options.num_predict",
            "invalid_value",
        )
    defaults = OLLAMA_DEFAULTS
    temperature = read_number(value, "temperature", *SAMPLING_RANGES["temperature"], path)
    top_p = read_number(value, "top_p", *SAMPLING_RANGES["top_p"], path)
    min_p = read_number(value, "min_p", *SAMPLING_RANGES["min_p"], path)
    presence = read_number(value, "presence_penalty", *SAMPLING_RANGES["presence_penalty"], path)
    frequency = read_number(value, "frequency_penalty", *SAMPLING_RANGES["frequency_penalty"], path)
    top_k = read_int(value, "top_k", 0, INT64_MAX, path)
    seed = read_int(value, "seed", INT64_MIN, INT64_MAX, path)
    sampling = SamplingParams(
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        min_p=defaults.min_p if min_p is None else min_p,
        # Ollama's seed -1 (or any negative) means a random one.
        seed=None if seed is None or seed < 0 else seed,
        presence_penalty=defaults.presence_penalty if presence is None else presence,
        frequency_penalty=defaults.frequency_penalty if frequency is None else frequency,
        unset=unset_of(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p),
    )
    return (
        num_predict if num_predict is not None and num_predict > 0 else None,
        read_stop_strings(value.get("stop"), "options.stop", MAX_STOP, "an array of strings"),
        sampling,
    )


# --- messages -------------------------------------------------------------------------------


def _messages(value: Any) -> tuple[Message, ...]:
    """`messages`; absent or empty is Ollama's way to load a model (see `load_only`)."""
    items = read_array(value, "messages", MAX_MESSAGES)
    messages = tuple(_message(item, f"messages[{i}]") for i, item in enumerate(items))
    check_messages_chars(sum(len(m.content) + len(m.reasoning or "") for m in messages))
    return messages


def _message(value: Any, path: str) -> Message:
    if type(value) is not dict:
        fail_type(path, "an object", value)
    role = _ROLES[read_one_of(value, "role", path, tuple(_ROLES))]
    check_keys(value, path, _MESSAGE_KEYS[role])
    if value.get("images"):
        fail_unsupported(f"{path}.images", "images are not supported")
    content = read_str(value, "content", path) or ""
    if role == "assistant":
        thinking = read_str(value, "thinking", path)
        calls = _tool_calls(value.get("tool_calls"), f"{path}.tool_calls")
        return Message(role, content, tool_calls=calls, reasoning=thinking)
    if role == "tool":
        name = read_str(value, "tool_name", path)
        call_id = read_str(value, "tool_call_id", path)
        return Message(role, content, name=name, tool_call_id=call_id)
    return Message(role, content)


def _tool_calls(value: Any, path: str) -> tuple[ToolCall, ...]:
    """An assistant's calls in the history: `[{"function": {"name", "arguments": {...}}}]`;
    a call without Ollama's optional `id` gets `call_<n>`, its position."""
    if value is None:
        return ()
    if type(value) is not list:
        fail_type(path, "an array", value)
    calls = []
    for i, item in enumerate(value):
        item_path = f"{path}[{i}]"
        if type(item) is not dict:
            fail_type(item_path, "an object", item)
        check_keys(item, item_path, ("id", "type", "function"))
        call_id = read_str(item, "id", item_path)
        kind = read_str(item, "type", item_path)
        if kind not in (None, "function"):
            fail_value(f"{item_path}.type", kind, ("function",))
        function = read_required(item, "function", item_path)
        if type(function) is not dict:
            fail_type(f"{item_path}.function", "an object", function)
        check_keys(function, f"{item_path}.function", ("index", "name", "arguments"))
        read_int(function, "index", 0, INT64_MAX, f"{item_path}.function")
        name = read_required_str(function, "name", f"{item_path}.function")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if type(arguments) is not dict:
            fail_type(f"{item_path}.function.arguments", "an object", arguments)
        calls.append(ToolCall(call_id or f"call_{i}", name, orjson.dumps(arguments).decode()))
    return tuple(calls)
