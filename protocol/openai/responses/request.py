"""Parse an OpenAI Responses request (`POST /v1/responses`) into a validated `ResponsesRequest`.

As strict as the chat parser (protocol.openai.chat.request), with its readers and 400s; fields are
openapi.yaml's CreateResponse:

- `input`: a string or a list of message, function_call, function_call_output and
  reasoning items (protocol.openai.responses.input).
- `instructions` (a system message first), `max_output_tokens` (at least 16, as at
  OpenAI), `temperature`, `top_p`, `presence_penalty` and `frequency_penalty` (the open
  Responses specification's, which the response object echoes), function `tools` (Responses' flat
  shape), `tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
  `reasoning.effort`, `stream`.
- `store` (OpenAI's default is true) and `previous_response_id`: the gateway keeps
  responses where its store has room (`store=True` here); otherwise an explicit
  `store: true` and any `previous_response_id` are refused with a 400 that says so.
- `background` (the response runs without its client: gateway.openai.responses.background);
  as at OpenAI it needs the response stored, so `background: true` with `store: false` (or
  a server that keeps nothing) is a 400.
- Accepted with no effect on the output: `metadata`, `user`, `safety_identifier`, the
  prompt-cache hints, `max_tool_calls` (it bounds built-in tools: there are none),
  `truncation: "disabled"`, `service_tier` auto/default, `include: []`.
- Refused unless default: `conversation`, `prompt`, `include`,
  `top_logprobs`, `reasoning.summary`, `text.verbosity` other than "medium",
  `context_management`, `moderation`, `stream_options` (only with `stream`).

The model is examined first, then unknown fields, as for chat (`read_model_first`).
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson

from protocol.core.errors import ApiError, invalid_request
from protocol.core.fields import (
    check_keys,
    fail_array_too_long,
    fail_type,
    fail_unsupported,
    fail_unsupported_value,
    fail_value,
    read_bool,
    read_int,
    read_json,
    read_number,
    read_required,
    read_str,
    show,
)
from protocol.core.limits import (
    INT64_MAX,
    MAX_PROMPT_CHARS,
    SAMPLING_RANGES,
    CheckModel,
    check_ceiling,
    read_model_first,
)
from protocol.core.tools import check_function_name
from protocol.frames import (
    Generate,
    Message,
    ReasoningEffort,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolChoice,
    unset_of,
)
from protocol.openai.params import check_accepted, parse_metadata, parse_reasoning_effort
from protocol.openai.responses.compaction import MAX_SUMMARY_TOKENS, compaction_messages
from protocol.openai.responses.input import parse_input
from protocol.openai.tools import (
    parse_response_format,
    parse_tool_choice,
)

MAX_TOOLS = 128
MIN_OUTPUT_TOKENS = 16
"""OpenAI's least `max_output_tokens`."""
MAX_INSTRUCTIONS_CHARS = MAX_PROMPT_CHARS
# fmt: off
_KNOWN = frozenset((
    # Honoured.
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "tools",
    "tool_choice", "parallel_tool_calls", "text", "reasoning", "stream", "store",
    "previous_response_id", "background",
    # Accepted, no effect on the output.
    "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "max_tool_calls", "truncation", "service_tier", "stream_options",
    # Refused unless default (_check_unimplemented).
    "conversation", "prompt", "include", "top_logprobs", "context_management",
    "moderation",
))
# fmt: on
_NOT_IMPLEMENTED = {
    "conversation": "conversations are not implemented; use previous_response_id",
    "prompt": "prompt templates are not implemented",
    "context_management": "context management (compaction) is not implemented",
    "moderation": "moderation is not implemented",
}


@attrs.frozen
class ResponsesRequest:
    """A validated Responses request."""

    model: str
    input: tuple[Message, ...]
    """The new turn's messages (the instructions and any earlier turns are not in it)."""
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: int | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    temperature: float | None = None
    """As given (the response object echoes it; None: OpenAI's default, 1)."""
    top_p: float | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    text_format: dict[str, Any] = attrs.field(factory=lambda: {"type": "text"})
    """`text.format` as the response object shows it."""
    reasoning_effort: ReasoningEffort | None = None
    store: bool = False
    """Keep the response (GET /v1/responses/{id}, previous_response_id)."""
    background: bool = False
    """Run without the client (queued first; retrieved, cancelled, its events resumed)."""
    previous_response_id: str | None = None
    metadata: dict[str, str] = attrs.field(factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, str] | None = None
    """As given (checked by `check_accepted`): the response object echoes both."""
    max_tool_calls: int | None = None

    def check_ceilings(self, max_tokens: int, choices: int) -> None:
        """The gateway's own ceiling on the answer's length (`--max-tokens-limit`); one
        choice only, so `--max-choices` never binds."""
        check_ceiling(self.max_output_tokens, max_tokens, "max_output_tokens")

    def to_generate(self, request_id: str, history: tuple[Message, ...] = ()) -> Generate:
        """The internal request: the instructions, the earlier turns (`history`, from the
        previous response), then this turn's input."""
        system = () if self.instructions is None else (Message("system", self.instructions),)
        return Generate(
            request_id=request_id,
            model=self.model,
            messages=(*system, *history, *self.input),
            max_tokens=self.max_output_tokens,
            sampling=self.sampling,
            tools=self.tools,
            tool_choice=self.tool_choice,
            tool_name=self.tool_name,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format,
            reasoning_effort=self.reasoning_effort,
        )


def parse_responses_request(
    body: bytes, check_model: CheckModel | None = None, *, store: bool = False
) -> ResponsesRequest:
    """Validate a `POST /v1/responses` body; raise `ApiError` (400) on any problem.
    `store`: the server keeps responses (else `store: true` and `previous_response_id` are
    refused, and a request that leaves `store` out is not stored)."""
    return parse_responses_object(read_json(body), check_model, store=store)


_COUNT_KNOWN = frozenset(
    (
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "truncation",
        "conversation",
        "personality",
    )
)
"""The fields of `POST /v1/responses/input_tokens` (openapi.yaml's TokenCountsBody)."""


def parse_input_tokens_request(
    body: bytes, check_model: CheckModel | None = None, *, store: bool = False
) -> ResponsesRequest:
    """Validate a `POST /v1/responses/input_tokens` body: the create's fields that make the
    prompt, read as the create reads them. The request to count generates nothing
    (`max_output_tokens` 0): a runner templates and tokenizes the prompt and answers with its
    usage. `model` and `input` are required (the count is the model's tokenizer's)."""
    data = read_json(body)
    read_model_first(data, _COUNT_KNOWN, check_model)
    if data.get("personality") is not None:
        fail_unsupported("personality", "personality presets are not implemented")
    create = {key: value for key, value in data.items() if key != "personality"}
    return attrs.evolve(
        parse_responses_object(create, store=store), max_output_tokens=0, stream=False
    )


_COMPACT_KNOWN = frozenset(
    (
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "service_tier",
    )
)
"""The fields of `POST /v1/responses/compact` (openapi.yaml's
CompactResponseMethodPublicBody)."""


def parse_compact_request(
    body: bytes, check_model: CheckModel | None = None, *, store: bool = False
) -> ResponsesRequest:
    """Validate a `POST /v1/responses/compact` body: the conversation to compact, read as
    the create reads it; `input` may be left out when `previous_response_id` gives the
    conversation. The request asks for the summary (protocol.openai.responses.compaction):
    up to MAX_SUMMARY_TOKENS tokens, at the model's defaults."""
    data = read_json(body)
    read_model_first(data, _COMPACT_KNOWN, check_model)
    given = data.get("input") is not None
    if not given and data.get("previous_response_id") is None:
        read_required(data, "input", "")  # the 400 for a conversation that is not there
    create = data if given else {**data, "input": "-"}
    parsed = parse_responses_object(create, store=store)
    messages = parsed.input if given else ()
    return attrs.evolve(
        parsed,
        input=compaction_messages(messages),
        max_output_tokens=MAX_SUMMARY_TOKENS,
        stream=False,
    )


def parse_responses_object(
    data: Any, check_model: CheckModel | None = None, *, store: bool = False
) -> ResponsesRequest:
    """Validate an already-decoded body. The model is examined first, as for chat."""
    model = read_model_first(data, _KNOWN, check_model)
    messages = parse_input(read_required(data, "input", ""))
    instructions = read_str(data, "instructions")
    if instructions is not None and len(instructions) > MAX_INSTRUCTIONS_CHARS:
        raise invalid_request(
            f"Invalid 'instructions': too long ({len(instructions)} characters; at most "
            f"{MAX_INSTRUCTIONS_CHARS}).",
            "instructions",
            "string_above_max_length",
        )
    stream = read_bool(data, "stream") or False
    _stream_options(data.get("stream_options"), stream)
    max_output_tokens = read_int(data, "max_output_tokens", MIN_OUTPUT_TOKENS, INT64_MAX)
    temperature = read_number(data, "temperature", *SAMPLING_RANGES["temperature"])
    top_p = read_number(data, "top_p", *SAMPLING_RANGES["top_p"])
    presence = read_number(data, "presence_penalty", *SAMPLING_RANGES["presence_penalty"])
    frequency = read_number(data, "frequency_penalty", *SAMPLING_RANGES["frequency_penalty"])
    sampling = SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        presence_penalty=0.0 if presence is None else presence,
        frequency_penalty=0.0 if frequency is None else frequency,
        unset=unset_of(temperature=temperature, top_p=top_p),
    )
    tools = _tools(data.get("tools"))
    tool_choice, tool_name = _tool_choice(data.get("tool_choice"), tools)
    # Unlike chat's, Responses' parallel_tool_calls and tool_choice "auto" need no tools.
    parallel = read_bool(data, "parallel_tool_calls")
    response_format, text_format = _text(data.get("text"))
    effort = _reasoning(data.get("reasoning"))
    _check_unimplemented(data)
    check_accepted(data)
    max_tool_calls = read_int(data, "max_tool_calls", 1, INT64_MAX)
    truncation = read_str(data, "truncation")
    if truncation is not None and truncation != "disabled":
        if truncation != "auto":
            fail_value("truncation", truncation, ("auto", "disabled"))
        fail_unsupported_value("truncation", truncation, '"disabled"')
    stored = read_bool(data, "store")
    if stored and not store:
        raise invalid_request(
            "Unsupported value: 'store' does not support true with this server: it keeps no "
            "responses (its store's limits are zero); send store: false.",
            "store",
            "unsupported_value",
        )
    background = read_bool(data, "background") or False
    if background and not (store if stored is None else stored):
        raise invalid_request(
            "Background responses must be stored: send 'store': true (or leave it out)"
            + ("." if store else "; this server keeps no responses (its store's limits are zero)."),
            "background",
            "invalid_parameter_combination",
        )
    previous = read_str(data, "previous_response_id")
    if previous is not None and not store:
        raise invalid_request(
            "Unsupported parameter: 'previous_response_id' is not supported with this "
            "server: it keeps no responses (its store's limits are zero).",
            "previous_response_id",
            "unsupported_parameter",
        )
    metadata = parse_metadata(data.get("metadata"))
    return ResponsesRequest(
        model=model,
        input=messages,
        instructions=instructions,
        stream=stream,
        max_output_tokens=max_output_tokens,
        sampling=sampling,
        temperature=temperature,
        top_p=top_p,
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=True if parallel is None else parallel,
        response_format=response_format,
        text_format=text_format,
        reasoning_effort=effort,
        store=store if stored is None else stored,
        background=background,
        previous_response_id=previous,
        metadata=metadata or {},
        user=read_str(data, "user"),
        safety_identifier=read_str(data, "safety_identifier"),
        prompt_cache_key=read_str(data, "prompt_cache_key"),
        prompt_cache_retention=read_str(data, "prompt_cache_retention"),
        prompt_cache_options=_given(data.get("prompt_cache_options")),
        max_tool_calls=max_tool_calls,
    )


# --- tools and formats ----------------------------------------------------------------------


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if type(value) is not list:
        fail_type("tools", "an array", value)
    if len(value) > MAX_TOOLS:
        fail_array_too_long("tools", MAX_TOOLS, len(value))
    tools: list[Tool] = []
    for i, item in enumerate(value):
        tool = _tool(item, f"tools[{i}]")
        if any(t.name == tool.name for t in tools):
            raise invalid_request(
                f"Invalid 'tools[{i}].name': duplicate function name {show(tool.name)}.",
                f"tools[{i}].name",
                "invalid_value",
            )
        tools.append(tool)
    return tuple(tools)


def _tool(value: Any, path: str) -> Tool:
    if type(value) is not dict:
        fail_type(path, "an object", value)
    kind = read_required(value, "type", path)
    if type(kind) is not str:
        fail_type(f"{path}.type", "a string", kind)
    if kind != "function":
        raise invalid_request(
            f"Unsupported value: '{path}.type' does not support {show(kind)} with this "
            "server: only function tools are supported (built-in tools run at OpenAI).",
            f"{path}.type",
            "unsupported_value",
        )
    check_keys(value, path, ("type", "name", "description", "parameters", "strict"))
    name = check_function_name(read_required(value, "name", path), f"{path}.name")
    description = read_str(value, "description", path)
    parameters = value.get("parameters")
    if parameters is not None and type(parameters) is not dict:
        fail_type(f"{path}.parameters", "an object", parameters)
    strict = read_bool(value, "strict", path)
    return Tool(
        name=name,
        description=description,
        parameters=None if parameters is None else orjson.dumps(parameters).decode(),
        strict=True if strict is None else strict,  # Responses' default
    )


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None]:
    """Responses' tool_choice: "none" / "auto" / "required", or `{type: "function", name}`
    (as the chat's, whose parser checks it)."""
    if type(value) is not dict:
        return parse_tool_choice(None if value == "auto" else value, tools)
    kind = read_required(value, "type", "tool_choice")
    if type(kind) is not str:
        fail_type("tool_choice.type", "a string", kind)
    if kind != "function":
        fail_unsupported_value("tool_choice.type", kind, '"function"')
    check_keys(value, "tool_choice", ("type", "name"))
    name = read_required(value, "name", "tool_choice")
    return parse_tool_choice({"type": "function", "function": {"name": name}}, tools)


def _text(value: Any) -> tuple[ResponseFormat | None, dict[str, Any]]:
    """`text`: its `format` as the internal response format and as the response shows it."""
    if value is None:
        return None, {"type": "text"}
    if type(value) is not dict:
        fail_type("text", "an object", value)
    check_keys(value, "text", ("format", "verbosity"))
    verbosity = read_str(value, "verbosity", "text")
    if verbosity is not None and verbosity != "medium":
        if verbosity not in ("low", "high"):
            fail_value("text.verbosity", verbosity, ("low", "medium", "high"))
        fail_unsupported_value("text.verbosity", verbosity, '"medium"')
    fmt = value.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if type(fmt) is not dict:
        fail_type("text.format", "an object", fmt)
    kind = read_required(fmt, "type", "text.format")
    if kind != "json_schema":
        # text and json_object have no other field: the chat's reader checks them.
        try:
            parsed = parse_response_format(fmt)
        except Exception as exc:
            _rename(exc, "response_format", "text.format")
            raise
        return parsed, {"type": kind}
    check_keys(fmt, "text.format", ("type", "name", "schema", "description", "strict"))
    spec = {key: fmt[key] for key in ("name", "schema", "description", "strict") if key in fmt}
    try:
        parsed = parse_response_format({"type": "json_schema", "json_schema": spec})
    except Exception as exc:
        _rename(exc, "response_format.json_schema", "text.format")
        raise
    assert parsed is not None
    shown: dict[str, Any] = {"type": "json_schema", "name": parsed.name}
    if fmt.get("description") is not None:  # a string, not nullable
        shown["description"] = fmt["description"]
    shown["schema"] = fmt.get("schema") or {}
    shown["strict"] = parsed.strict
    return parsed, shown


def _given(options: dict[str, str | None] | None) -> dict[str, str] | None:
    """An object of options (already checked) without the ones given as null."""
    if options is None:
        return None
    return {key: value for key, value in options.items() if value is not None}


def _rename(exc: Exception, old: str, new: str) -> None:
    """An error of the chat's reader, renamed to the Responses field it came from."""
    if isinstance(exc, ApiError):
        exc.message = exc.message.replace(old, new)
        if exc.param is not None:
            exc.param = exc.param.replace(old, new)


def _reasoning(value: Any) -> ReasoningEffort | None:
    if value is None:
        return None
    if type(value) is not dict:
        fail_type("reasoning", "an object", value)
    check_keys(value, "reasoning", ("effort", "summary", "generate_summary"))
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None:
            read_str(value, key, "reasoning")
            fail_unsupported(
                f"reasoning.{key}",
                "reasoning summaries are not written; the reasoning text itself is sent",
            )
    try:
        return parse_reasoning_effort(value.get("effort"))
    except Exception as exc:
        _rename(exc, "reasoning_effort", "reasoning.effort")
        raise


def _stream_options(value: Any, stream: bool) -> None:
    if value is None:
        return
    if not stream:
        raise invalid_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
            "invalid_parameter_combination",
        )
    if type(value) is not dict:
        fail_type("stream_options", "an object", value)
    check_keys(value, "stream_options", ("include_obfuscation",))
    # We never obfuscate; false only saves bandwidth at OpenAI.
    read_bool(value, "include_obfuscation", "stream_options")


def _check_unimplemented(data: dict[str, Any]) -> None:
    for key, reason in _NOT_IMPLEMENTED.items():
        if data.get(key) is not None:
            fail_unsupported(key, reason)
    include = data.get("include")
    if include is not None:
        if type(include) is not list:
            fail_type("include", "an array", include)
        if include:
            fail_unsupported_value("include", include, "[]")
    top_logprobs = read_int(data, "top_logprobs", 0, 20)
    if top_logprobs:
        fail_unsupported("top_logprobs", "log probabilities are not sent in this dialect")
    tier = read_str(data, "service_tier")
    if tier is not None and tier not in ("auto", "default"):
        if tier not in ("flex", "scale", "priority"):
            fail_value("service_tier", tier, ("auto", "default", "flex", "scale", "priority"))
        fail_unsupported_value("service_tier", tier, "auto")
