"""OpenAI Chat Completions request parsing, refusals: bodies that are not a request, every
refused field with its param and code, messages that say why, and the model checked first."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.core.errors import ApiError
from protocol.core.limits import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_STOP_CHARS
from protocol.openai.chat.request import MAX_CONTENT_PARTS, parse_chat_object
from protocol.openai.params import MAX_LOGIT_BIAS
from tests.protocol.bad_input import METADATA_REFUSALS
from tests.protocol.openai.chat.requests import FN, USER, fn, refusal, request


def test_malformed_json() -> None:
    err = refusal(b'{"model": "m",')
    assert err.param is None
    assert err.code == "invalid_json"
    assert err.message.startswith("We could not parse the JSON body of your request")


@pytest.mark.parametrize("body", [b"", b"\xff", b"NaN", b"[" * 2000, b'{"a": 1e400}'])
def test_undecodable_bodies(body: bytes) -> None:
    assert refusal(body).message.startswith("We could not parse the JSON body")


@pytest.mark.parametrize(
    ("body", "kind"),
    [([], "an array"), ("s", "a string"), (1, "an integer"), (None, "null"), (True, "a boolean")],
)
def test_body_must_be_an_object(body: Any, kind: str) -> None:
    err = refusal(body)
    assert err.message == (
        f"Invalid type for the request body: expected an object, but got {kind} instead."
    )
    assert (err.param, err.code) == (None, "invalid_type")


def test_unknown_field() -> None:
    err = refusal(request(repetition_penalty=1.1))
    assert err.message == "Unrecognized request argument supplied: repetition_penalty"
    assert (err.param, err.code) == ("repetition_penalty", "unknown_parameter")


def test_unknown_fields() -> None:
    err = refusal(request(foo=1, bar=2))
    assert err.message == "Unrecognized request arguments supplied: foo, bar"


@pytest.mark.parametrize("field", ["model", "messages"])
def test_missing_required(field: str) -> None:
    err = refusal(request(**{field: ...}))
    assert err.message == f"Missing required parameter: '{field}'."
    assert (err.param, err.code) == (field, "missing_required_parameter")


def test_type_error_message() -> None:
    err = refusal(request(temperature="hot"))
    assert err.message == (
        "Invalid type for 'temperature': expected a decimal, but got a string instead."
    )
    assert (err.param, err.code) == ("temperature", "invalid_type")


def test_range_error_messages() -> None:
    err = refusal(request(temperature=2.5))
    assert err.message == (
        "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, "
        "but got 2.5 instead."
    )
    assert (err.param, err.code) == ("temperature", "decimal_above_max_value")
    err = refusal(request(max_tokens=0))
    assert err.message == (
        "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, "
        "but got 0 instead."
    )
    assert (err.param, err.code) == ("max_tokens", "integer_below_min_value")


def test_invalid_role_message() -> None:
    err = refusal(request(messages=[{"role": "bot", "content": "x"}]))
    assert err.message == (
        "Invalid value for 'messages[0].role': 'bot'. Supported values are: 'system', "
        "'assistant', 'user', 'function', 'tool', and 'developer'."
    )
    assert (err.param, err.code) == ("messages[0].role", "invalid_value")


def test_both_max_tokens() -> None:
    err = refusal(request(max_tokens=5, max_completion_tokens=5))
    assert err.message == (
        "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported."
    )
    assert (err.param, err.code) == ("max_tokens", "invalid_parameter_combination")


def test_stream_options_without_stream() -> None:
    for stream in (..., False, None):
        err = refusal(request(stream=stream, stream_options={"include_usage": True}))
        assert err.message == (
            "The 'stream_options' parameter is only allowed when 'stream' is enabled."
        )
        assert (err.param, err.code) == ("stream_options", "invalid_parameter_combination")


M = "messages[0]"


ASSISTANT = {"role": "assistant", "content": "x"}


def msg(**fields: Any) -> dict[str, Any]:
    """A request whose only message is USER with `fields` set (... removes one)."""
    message = {key: value for key, value in {**USER, **fields}.items() if value is not ...}
    return request(messages=[message])


def amsg(**fields: Any) -> dict[str, Any]:
    message = {key: value for key, value in {**ASSISTANT, **fields}.items() if value is not ...}
    return request(messages=[USER, message])


A = "messages[1]"

REFUSALS: list[tuple[dict[str, Any], str | None, str]] = [
    # model
    (request(model=None), "model", "invalid_type"),
    (request(model=1), "model", "invalid_type"),
    (request(model="m" * 257), "model", "string_above_max_length"),
    # messages
    (request(messages=None), "messages", "invalid_type"),
    (request(messages={"role": "user"}), "messages", "invalid_type"),
    (request(messages=[]), "messages", "empty_array"),
    (request(messages=[USER] * (MAX_MESSAGES + 1)), "messages", "array_above_max_length"),
    (
        request(messages=[{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]),
        "messages",
        "string_above_max_length",
    ),
    (request(messages=["hi"]), M, "invalid_type"),
    (request(messages=[USER, None]), "messages[1]", "invalid_type"),
    (msg(role=...), f"{M}.role", "missing_required_parameter"),
    (msg(role=None), f"{M}.role", "invalid_type"),
    (msg(role="bot"), f"{M}.role", "invalid_value"),
    (msg(role="tool"), f"{M}.tool_call_id", "missing_required_parameter"),
    (msg(role="tool", tool_call_id=1), f"{M}.tool_call_id", "invalid_type"),
    (msg(role="tool", tool_call_id="1", name="n"), f"{M}.name", "unknown_parameter"),
    (msg(role="tool", tool_call_id="1", content=...), f"{M}.content", "missing_required_parameter"),
    (msg(role="function", name="f"), f"{M}.role", "unsupported_value"),
    (msg(content=...), f"{M}.content", "missing_required_parameter"),
    (msg(content=None), f"{M}.content", "invalid_type"),
    (msg(content=5), f"{M}.content", "invalid_type"),
    (msg(content={"type": "text", "text": "x"}), f"{M}.content", "invalid_type"),
    (msg(content=[]), f"{M}.content", "empty_array"),
    (
        msg(content=[{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)),
        f"{M}.content",
        "array_above_max_length",
    ),
    (msg(content=["hi"]), f"{M}.content[0]", "invalid_type"),
    (msg(content=[{"text": "hi"}]), f"{M}.content[0].type", "missing_required_parameter"),
    (msg(content=[{"type": 1, "text": "hi"}]), f"{M}.content[0].type", "invalid_type"),
    (msg(content=[{"type": "txt", "text": "hi"}]), f"{M}.content[0].type", "invalid_value"),
    (
        msg(content=[{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]),
        f"{M}.content[1].type",
        "unsupported_value",
    ),
    (msg(content=[{"type": "input_audio"}]), f"{M}.content[0].type", "unsupported_value"),
    (msg(content=[{"type": "file"}]), f"{M}.content[0].type", "unsupported_value"),
    (
        msg(role="system", content=[{"type": "image_url"}]),
        f"{M}.content[0].type",
        "invalid_value",
    ),
    (msg(content=[{"type": "text"}]), f"{M}.content[0].text", "missing_required_parameter"),
    (msg(content=[{"type": "text", "text": None}]), f"{M}.content[0].text", "invalid_type"),
    (
        msg(content=[{"type": "text", "text": "a", "x": 1}]),
        f"{M}.content[0].x",
        "unknown_parameter",
    ),
    (
        msg(content=[{"type": "text", "text": "a", "prompt_cache_breakpoint": {}}]),
        f"{M}.content[0].prompt_cache_breakpoint",
        "invalid_value",
    ),
    (msg(name=1), f"{M}.name", "invalid_type"),
    (msg(foo=1), f"{M}.foo", "unknown_parameter"),
    (msg(reasoning_content="x"), f"{M}.reasoning_content", "unknown_parameter"),
    (msg(tool_calls=[]), f"{M}.tool_calls", "unknown_parameter"),
    # assistant messages
    (amsg(content=...), f"{A}.content", "missing_required_parameter"),
    (amsg(content=None), f"{A}.content", "missing_required_parameter"),
    (
        amsg(content=[{"type": "refusal", "refusal": "no"}]),
        f"{A}.content[0].type",
        "unsupported_value",
    ),
    (
        amsg(tool_calls=[{"id": "1", "type": "function"}]),
        f"{A}.tool_calls[0].function",
        "missing_required_parameter",
    ),
    (
        amsg(content=None, tool_calls=[{"id": "1"}]),
        f"{A}.tool_calls[0].type",
        "missing_required_parameter",
    ),
    (amsg(tool_calls=[{"id": 1}]), f"{A}.tool_calls[0].id", "invalid_type"),
    (amsg(tool_calls=[{"id": "1", "type": "custom"}]), f"{A}.tool_calls[0].type", "invalid_value"),
    (
        amsg(
            tool_calls=[{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]
        ),
        f"{A}.tool_calls[0].function.arguments",
        "invalid_type",
    ),
    (
        amsg(tool_calls=[{"id": "1", "type": "function", "function": {"name": "f"}, "x": 1}]),
        f"{A}.tool_calls[0].x",
        "unknown_parameter",
    ),
    (amsg(tool_calls={}), f"{A}.tool_calls", "invalid_type"),
    (
        amsg(function_call={"name": "f", "arguments": "{}"}),
        f"{A}.function_call",
        "unsupported_parameter",
    ),
    (amsg(audio={"id": "a"}), f"{A}.audio", "unsupported_parameter"),
    (amsg(refusal="I can't"), f"{A}.refusal", "unsupported_parameter"),
    (amsg(refusal=1), f"{A}.refusal", "invalid_type"),
    (amsg(reasoning_content=1), f"{A}.reasoning_content", "invalid_type"),
    (amsg(annotations={}), f"{A}.annotations", "invalid_type"),
    # stream
    (request(stream="true"), "stream", "invalid_type"),
    (request(stream=1), "stream", "invalid_type"),
    (request(stream=True, stream_options=[]), "stream_options", "invalid_type"),
    (request(stream=True, stream_options={"x": 1}), "stream_options.x", "unknown_parameter"),
    (
        request(stream=True, stream_options={"include_usage": 1}),
        "stream_options.include_usage",
        "invalid_type",
    ),
    (
        request(stream=True, stream_options={"include_obfuscation": "no"}),
        "stream_options.include_obfuscation",
        "invalid_type",
    ),
    (
        request(stream=True, stream_options={"continuous_usage_stats": True}),
        "stream_options.continuous_usage_stats",
        "invalid_parameter_combination",
    ),
    (
        request(
            stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True}
        ),
        "stream_options.continuous_usage_stats",
        "invalid_parameter_combination",
    ),
    (
        request(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": 1}),
        "stream_options.continuous_usage_stats",
        "invalid_type",
    ),
    # lengths
    (request(max_tokens=0), "max_tokens", "integer_below_min_value"),
    (request(max_tokens=-1), "max_tokens", "integer_below_min_value"),
    (request(max_tokens=1.0), "max_tokens", "invalid_type"),
    (request(max_tokens="10"), "max_tokens", "invalid_type"),
    (request(max_tokens=True), "max_tokens", "invalid_type"),
    (request(max_tokens=2**63), "max_tokens", "integer_above_max_value"),
    (request(max_completion_tokens=0), "max_completion_tokens", "integer_below_min_value"),
    (request(max_completion_tokens=1.5), "max_completion_tokens", "invalid_type"),
    # sampling
    (request(temperature=True), "temperature", "invalid_type"),
    (request(temperature=[1]), "temperature", "invalid_type"),
    (request(temperature=-0.01), "temperature", "decimal_below_min_value"),
    (request(temperature=2.000001), "temperature", "decimal_above_max_value"),
    (request(temperature=3), "temperature", "decimal_above_max_value"),
    (request(top_p=-1), "top_p", "decimal_below_min_value"),
    (request(top_p=1.01), "top_p", "decimal_above_max_value"),
    (request(top_p="1"), "top_p", "invalid_type"),
    (request(top_k=-2), "top_k", "integer_below_min_value"),
    (request(top_k=1.0), "top_k", "invalid_type"),
    (request(top_k=False), "top_k", "invalid_type"),
    (request(min_p=-0.1), "min_p", "decimal_below_min_value"),
    (request(min_p=1.1), "min_p", "decimal_above_max_value"),
    (request(presence_penalty=-2.5), "presence_penalty", "decimal_below_min_value"),
    (request(presence_penalty=2.5), "presence_penalty", "decimal_above_max_value"),
    (request(frequency_penalty=-3), "frequency_penalty", "decimal_below_min_value"),
    (request(frequency_penalty=3), "frequency_penalty", "decimal_above_max_value"),
    (request(frequency_penalty=False), "frequency_penalty", "invalid_type"),
    (request(seed=1.5), "seed", "invalid_type"),
    (request(seed="1"), "seed", "invalid_type"),
    (request(seed=2**63), "seed", "integer_above_max_value"),
    (request(seed=2**64 - 1), "seed", "integer_above_max_value"),
    # stop
    (request(stop=1), "stop", "invalid_type"),
    (request(stop={"a": 1}), "stop", "invalid_type"),
    (request(stop=["a", "b", "c", "d", "e"]), "stop", "array_above_max_length"),
    (request(stop=["a", 1]), "stop[1]", "invalid_type"),
    (request(stop=["a", None]), "stop[1]", "invalid_type"),
    (request(stop=""), "stop", "empty_string"),
    (request(stop=["a", ""]), "stop[1]", "empty_string"),
    (request(stop="s" * (MAX_STOP_CHARS + 1)), "stop", "string_above_max_length"),
    (request(stop=["s" * (MAX_STOP_CHARS + 1)]), "stop[0]", "string_above_max_length"),
    # logit_bias
    (request(logit_bias=[]), "logit_bias", "invalid_type"),
    (request(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
    (request(logit_bias={"-1": 1}), "logit_bias", "invalid_value"),
    (request(logit_bias={"1.0": 1}), "logit_bias", "invalid_value"),
    (request(logit_bias={" 1": 1}), "logit_bias", "invalid_value"),
    (request(logit_bias={"": 1}), "logit_bias", "invalid_value"),
    (request(logit_bias={"\u0661": 1}), "logit_bias", "invalid_value"),  # Arabic-Indic 1
    (request(logit_bias={"2147483648": 1}), "logit_bias", "invalid_value"),
    (request(logit_bias={"1" * 5000: 1}), "logit_bias", "invalid_value"),
    (request(logit_bias={"5": "1"}), "logit_bias.5", "invalid_type"),
    (request(logit_bias={"5": None}), "logit_bias.5", "invalid_type"),
    (request(logit_bias={"5": True}), "logit_bias.5", "invalid_type"),
    (request(logit_bias={"5": 101}), "logit_bias.5", "decimal_above_max_value"),
    (request(logit_bias={"5": -100.5}), "logit_bias.5", "decimal_below_min_value"),
    (
        request(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
        "logit_bias",
        "object_above_max_properties",
    ),
    # not implemented
    (request(n=0), "n", "integer_below_min_value"),
    (request(n=129), "n", "integer_above_max_value"),
    (request(n="1"), "n", "invalid_type"),
    (request(logprobs=1), "logprobs", "invalid_type"),
    (request(top_logprobs=0), "top_logprobs", "invalid_parameter_combination"),
    (request(top_logprobs=5, logprobs=False), "top_logprobs", "invalid_parameter_combination"),
    (request(top_logprobs=21, logprobs=True), "top_logprobs", "integer_above_max_value"),
    (request(top_logprobs=-1, logprobs=True), "top_logprobs", "integer_below_min_value"),
    (request(top_logprobs="5"), "top_logprobs", "invalid_type"),
    # tools
    (request(tools={}), "tools", "invalid_type"),
    (request(tools=[FN] * 129), "tools", "array_above_max_length"),
    (request(tools=[1]), "tools[0]", "invalid_type"),
    (request(tools=[{"function": {"name": "f"}}]), "tools[0].type", "missing_required_parameter"),
    (request(tools=[{**FN, "type": "custom"}]), "tools[0].type", "unsupported_value"),
    (request(tools=[{**FN, "type": "fn"}]), "tools[0].type", "invalid_value"),
    (request(tools=[{"type": "function"}]), "tools[0].function", "missing_required_parameter"),
    (request(tools=[{**FN, "x": 1}]), "tools[0].x", "unknown_parameter"),
    (request(tools=[fn(name="a b")]), "tools[0].function.name", "invalid_value"),
    (request(tools=[fn(name="")]), "tools[0].function.name", "invalid_value"),
    (request(tools=[fn(name="f" * 65)]), "tools[0].function.name", "string_above_max_length"),
    (request(tools=[fn(name=1)]), "tools[0].function.name", "invalid_type"),
    (request(tools=[fn(name=...)]), "tools[0].function.name", "missing_required_parameter"),
    (request(tools=[fn(parameters=[])]), "tools[0].function.parameters", "invalid_type"),
    (request(tools=[fn(strict="yes")]), "tools[0].function.strict", "invalid_type"),
    (request(tools=[fn(description=1)]), "tools[0].function.description", "invalid_type"),
    (request(tools=[fn(examples=[])]), "tools[0].function.examples", "unknown_parameter"),
    (request(tools=[FN, FN]), "tools[1].function.name", "invalid_value"),
    (request(tool_choice="auto"), "tool_choice", "invalid_parameter_combination"),
    (request(tool_choice="required"), "tool_choice", "invalid_parameter_combination"),
    (
        request(tool_choice={"type": "function", "function": {"name": "f"}}),
        "tool_choice",
        "invalid_parameter_combination",
    ),
    (
        request(tools=[FN], tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice",
        "invalid_value",
    ),
    (
        request(tools=[FN], tool_choice={"type": "allowed_tools", "allowed_tools": {}}),
        "tool_choice.type",
        "unsupported_value",
    ),
    (request(tools=[FN], tool_choice={"type": "x"}), "tool_choice.type", "invalid_value"),
    (
        request(tools=[FN], tool_choice={"type": "function"}),
        "tool_choice.function",
        "missing_required_parameter",
    ),
    (
        request(tools=[FN], tool_choice={"type": "function", "function": {"name": "f", "x": 1}}),
        "tool_choice.function.x",
        "unknown_parameter",
    ),
    (request(tools=[FN], tool_choice="any"), "tool_choice", "invalid_value"),
    (request(tool_choice=1), "tool_choice", "invalid_type"),
    (request(parallel_tool_calls=True), "parallel_tool_calls", "invalid_parameter_combination"),
    (request(tools=[FN], parallel_tool_calls=1), "parallel_tool_calls", "invalid_type"),
    (request(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    (request(function_call="auto"), "function_call", "unsupported_parameter"),
    (request(function_call={"name": "f"}), "function_call", "unsupported_parameter"),
    (request(response_format="text"), "response_format", "invalid_type"),
    (request(response_format={}), "response_format.type", "missing_required_parameter"),
    (request(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
    (
        request(response_format={"type": "json_object", "schema": {}}),
        "response_format.schema",
        "unknown_parameter",
    ),
    (
        request(response_format={"type": "json_schema"}),
        "response_format.json_schema",
        "missing_required_parameter",
    ),
    (
        request(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        "response_format.json_schema.name",
        "missing_required_parameter",
    ),
    (
        request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}),
        "response_format.json_schema.schema",
        "invalid_type",
    ),
    (
        request(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": 1}}),
        "response_format.json_schema.strict",
        "invalid_type",
    ),
    (request(audio="alloy"), "audio", "invalid_type"),
    (request(reasoning_effort="extreme"), "reasoning_effort", "invalid_value"),
    (request(reasoning_effort=1), "reasoning_effort", "invalid_type"),
    (request(chat_template_kwargs=[]), "chat_template_kwargs", "invalid_type"),
    (
        request(chat_template_kwargs={"x": "y" * 70_000}),
        "chat_template_kwargs",
        "string_above_max_length",
    ),
    (request(metadata={"k": "v"}), "metadata", "invalid_parameter_combination"),
    (
        request(stream_options={"include_usage": True}),
        "stream_options",
        "invalid_parameter_combination",
    ),
    (request(modalities=["text", "audio"]), "modalities", "unsupported_value"),
    (request(modalities=[]), "modalities", "unsupported_value"),
    (request(modalities="text"), "modalities", "invalid_type"),
    (
        request(prediction={"type": "content", "content": "x"}),
        "prediction",
        "unsupported_parameter",
    ),
    (request(web_search_options={}), "web_search_options", "unsupported_parameter"),
    (request(verbosity="low"), "verbosity", "unsupported_parameter"),
    (
        request(moderation={"model": "omni-moderation-latest"}),
        "moderation",
        "unsupported_parameter",
    ),
    (request(store=True), "store", "unsupported_value"),
    (request(store="false"), "store", "invalid_type"),
    (request(service_tier="flex"), "service_tier", "unsupported_value"),
    (request(service_tier="priority"), "service_tier", "unsupported_value"),
    (request(service_tier="gold"), "service_tier", "invalid_value"),
    (request(service_tier=1), "service_tier", "invalid_type"),
    # accepted, but type-checked
    (request(parallel_tool_calls="yes"), "parallel_tool_calls", "invalid_type"),
    (request(user=1), "user", "invalid_type"),
    (request(prompt_cache_key=1), "prompt_cache_key", "invalid_type"),
    (request(safety_identifier=1), "safety_identifier", "invalid_type"),
    (request(safety_identifier="x" * 65), "safety_identifier", "string_above_max_length"),
    (request(prompt_cache_retention="1h"), "prompt_cache_retention", "invalid_value"),
    (request(prompt_cache_options="x"), "prompt_cache_options", "invalid_type"),
    (request(prompt_cache_options={"x": 1}), "prompt_cache_options.x", "unknown_parameter"),
    (request(prompt_cache_options={"ttl": "1h"}), "prompt_cache_options.ttl", "invalid_value"),
    (request(prompt_cache_options={"ttl": 30}), "prompt_cache_options.ttl", "invalid_type"),
    (
        request(prompt_cache_options={"mode": "explicit"}),
        "prompt_cache_options.mode",
        "unsupported_value",
    ),
    (request(prompt_cache_options={"mode": "off"}), "prompt_cache_options.mode", "invalid_value"),
    *((request(metadata=value), param, code) for value, param, code in METADATA_REFUSALS),
]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    REFUSALS,
    ids=[f"{i}-{param}-{code}" for i, (_, param, code) in enumerate(REFUSALS)],
)
def test_refusals(body: dict[str, Any], param: str | None, code: str) -> None:
    err = refusal(body)
    assert (err.param, err.code) == (param, code)
    if param is not None and not param.startswith("metadata."):
        # The message names the field, so a user can tell what to fix without the param.
        assert param in err.message


def test_unsupported_messages_say_why() -> None:
    err = refusal(request(tools=[{**FN, "type": "custom"}]))
    assert err.message == (
        "Unsupported value: 'tools[0].type' does not support 'custom' with this server. "
        "Only the default (function) value is supported."
    )
    err = refusal(request(parallel_tool_calls=False))
    assert err.message == (
        "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when "
        "'tools' are specified."
    )
    err = refusal(request(prediction={"type": "content", "content": "x"}))
    assert err.message == (
        "Unsupported parameter: 'prediction' is not supported with this server: "
        "predicted outputs are not implemented."
    )


def test_huge_values_are_not_echoed_whole() -> None:
    err = refusal(request(service_tier="x" * 100_000))
    assert len(err.message) < 300
    err = refusal(request(**{"y" * 100_000: 1}))
    assert len(err.message) < 300


def test_model_is_checked_first() -> None:
    seen: list[str] = []

    def check_model(model: str) -> None:
        seen.append(model)
        raise ApiError(404, "no", "invalid_request_error", None, "model_not_found")

    # Bad messages and unknown fields are not looked at before the model.
    body = {"model": "nope", "messages": 1, "bogus": True}
    with pytest.raises(ApiError) as info:
        parse_chat_object(body, check_model)
    assert (info.value.status, seen) == (404, ["nope"])
    err = refusal({"messages": 1, "bogus": True})
    assert (err.param, err.code) == ("model", "missing_required_parameter")
