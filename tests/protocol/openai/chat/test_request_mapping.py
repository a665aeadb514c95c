"""OpenAI Chat Completions request parsing, valid requests: the exact ChatRequest and Generate
each field maps to, nulls, the max_tokens ceilings, inclusive bounds, messages and tool
history as the SDK sends them back, tool choices and response formats."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from protocol.core.errors import ApiError
from protocol.core.limits import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_STOP_CHARS
from protocol.frames import (
    DEFAULTABLE,
    Generate,
    LogitBias,
    Message,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
)
from protocol.openai.chat.request import MAX_CONTENT_PARTS, ChatRequest
from protocol.openai.errors import error_body
from protocol.openai.params import MAX_LOGIT_BIAS, MAX_N
from tests.protocol.openai.chat.requests import BASE, FN, USER, fn, parse, refusal, request


def test_minimal_request() -> None:
    chat = parse(BASE)
    assert chat == ChatRequest(
        model="m",
        messages=(Message(role="user", content="hi"),),
        stream=False,
        include_usage=False,
        continuous_usage_stats=False,
        max_tokens=None,
        stop=(),
        sampling=SamplingParams(unset=DEFAULTABLE),
    )
    assert chat.to_generate("req-1") == Generate(
        request_id="req-1",
        model="m",
        messages=(Message(role="user", content="hi"),),
        sampling=SamplingParams(unset=DEFAULTABLE),
    )


def test_full_request_maps_to_the_exact_generate() -> None:
    body = {
        "model": "llama-3",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Sys"}], "name": "s"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "alice",
            },
            {
                "role": "assistant",
                "content": "ok",
                "refusal": None,
                "reasoning_content": "thinking...",
                "tool_calls": [],
                "function_call": None,
                "audio": None,
            },
            {"role": "user", "content": ""},
        ],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 64,
        "temperature": 0.5,
        "top_p": 1,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": -2,
        "frequency_penalty": 1.5,
        "seed": -(2**63),
        "stop": ["\n\n", "END"],
        "logit_bias": {"50256": -100, "7": 2.5, "0": 100},
        "n": 1,
        "logprobs": True,
        "top_logprobs": 3,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather now",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    "strict": True,
                },
            },
            {"type": "function", "function": {"name": "noop"}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "function_call": "none",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
        },
        "reasoning_effort": "minimal",
        "chat_template_kwargs": {"enable_thinking": False},
        "audio": {"voice": "alloy", "format": "wav"},
        "modalities": ["text"],
        "store": False,
        "service_tier": "default",
        "user": "u-1",
        "safety_identifier": "x" * 64,
        "prompt_cache_key": "key",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"ttl": "30m", "mode": "implicit"},
    }
    chat = parse(body)
    assert chat.stream
    assert chat.include_usage
    assert chat.continuous_usage_stats
    assert chat.to_generate("r") == Generate(
        request_id="r",
        model="llama-3",
        messages=(
            Message(role="developer", content="Be brief."),
            Message(role="system", content="Sys", name="s"),
            Message(role="user", content="a\nb", name="alice"),
            Message(role="assistant", content="ok", reasoning="thinking..."),
            Message(role="user", content=""),
        ),
        max_tokens=64,
        stop=("\n\n", "END"),
        sampling=SamplingParams(
            temperature=0.5,
            top_p=1.0,
            top_k=40,
            min_p=0.05,
            seed=-(2**63),
            presence_penalty=-2.0,
            frequency_penalty=1.5,
            logit_bias=(
                LogitBias(token=50256, bias=-100.0),
                LogitBias(token=7, bias=2.5),
                LogitBias(token=0, bias=100.0),
            ),
        ),
        tools=(
            Tool(
                name="get_weather",
                description="Weather now",
                parameters='{"type":"object","properties":{"city":{"type":"string"}}}',
                strict=True,
            ),
            Tool(name="noop"),
        ),
        tool_choice="function",
        tool_name="get_weather",
        parallel_tool_calls=False,
        response_format=ResponseFormat(
            "json_schema", schema='{"type":"object"}', name="out", strict=True
        ),
        logprobs=True,
        top_logprobs=3,
        chat_template_kwargs='{"enable_thinking":false}',
        reasoning_effort="minimal",
    )
    # Integers given for decimal fields arrive as floats, which the codec requires.
    assert type(chat.sampling.top_p) is float
    assert type(chat.sampling.presence_penalty) is float
    assert type(chat.sampling.logit_bias[0].bias) is float


NULLABLE = (
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "logit_bias",
    "n",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "verbosity",
    "moderation",
    "store",
    "metadata",
    "service_tier",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
)


@pytest.mark.parametrize("field", NULLABLE)
def test_null_means_not_given(field: str) -> None:
    assert parse(request(**{field: None})) == parse(BASE)


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 7}, 7),
        ({"max_tokens": 5, "max_completion_tokens": None}, 5),
        ({"max_tokens": None, "max_completion_tokens": 7}, 7),
        ({"max_tokens": 2**63 - 1}, 2**63 - 1),
    ],
)
def test_max_tokens(fields: dict[str, Any], max_tokens: int) -> None:
    assert parse(request(**fields)).max_tokens == max_tokens


def accepted(chat: ChatRequest, limit: int) -> bool:
    """Whether the gateway's ceiling (`check_ceilings`) lets `chat` through."""
    try:
        chat.check_ceilings(limit, MAX_N)
    except ApiError:
        return False
    return True


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        ({}, None),
        ({"max_tokens": 100}, 100),
        ({"max_completion_tokens": 100}, 100),
        ({"max_tokens": 1}, 1),
    ],
)
def test_max_tokens_within_the_gateway_ceiling(
    fields: dict[str, Any], max_tokens: int | None
) -> None:
    chat = parse(request(**fields))
    assert chat.max_tokens == max_tokens
    assert accepted(chat, 100)
    # The ceiling is the bound itself: one lower refuses what it asks.
    assert accepted(chat, 99) is (max_tokens is None or max_tokens < 100)


@pytest.mark.parametrize("fields", [{"max_tokens": 101}, {"max_completion_tokens": 101}])
def test_max_tokens_over_the_gateway_ceiling(fields: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as caught:
        parse(request(**fields)).check_ceilings(100, MAX_N)
    assert caught.value.status == 400
    assert error_body(caught.value) == {
        "error": {
            "message": "max_tokens is 101; this gateway allows at most 100.",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "integer_above_max_value",
        }
    }


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_minus_one_or_zero_is_off(top_k: int, expected: int) -> None:
    assert parse(request(top_k=top_k)).sampling.top_k == expected


@pytest.mark.parametrize(
    ("stop", "expected"),
    [("x", ("x",)), (["a"], ("a",)), (["a", "b", "a", "d"], ("a", "b", "a", "d"))],
)
def test_stop(stop: Any, expected: tuple[str, ...]) -> None:
    assert parse(request(stop=stop)).stop == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"temperature": 0}, SamplingParams(temperature=0.0)),
        ({"temperature": 2}, SamplingParams(temperature=2.0)),
        ({"top_p": 0}, SamplingParams(top_p=0.0)),
        ({"min_p": 1}, SamplingParams(min_p=1.0)),
        ({"presence_penalty": 2}, SamplingParams(presence_penalty=2.0)),
        ({"frequency_penalty": -2.0}, SamplingParams(frequency_penalty=-2.0)),
        ({"seed": 2**63 - 1}, SamplingParams(seed=2**63 - 1)),
        ({"seed": 0}, SamplingParams(seed=0)),
        ({"logit_bias": {}}, SamplingParams()),
        (
            {"logit_bias": {"2147483647": -100.0}},
            SamplingParams(logit_bias=(LogitBias(2**31 - 1, -100.0),)),
        ),
    ],
)
def test_sampling_bounds_are_inclusive(value: dict[str, Any], expected: SamplingParams) -> None:
    # What the request leaves out of temperature, top_p, top_k and min_p is unset.
    unset = tuple(name for name in DEFAULTABLE if name not in value)
    assert parse(request(**value)).sampling == attrs.evolve(expected, unset=unset)


@pytest.mark.parametrize(
    "stream_options",
    [
        {},
        {"include_usage": False},
        {"include_usage": None},
        {"include_obfuscation": True},
        {"include_obfuscation": False},
        {"include_usage": True, "continuous_usage_stats": False},
    ],
)
def test_stream_options_without_usage_flags(stream_options: dict[str, Any]) -> None:
    chat = parse(request(stream=True, stream_options=stream_options))
    assert chat.stream
    assert chat.include_usage == (stream_options.get("include_usage") is True)
    assert not chat.continuous_usage_stats


def test_assistant_message_as_the_openai_sdk_sends_it_back() -> None:
    # What `messages.append(completion.choices[0].message)` puts on the wire.
    message = {"role": "assistant", "content": "4", "refusal": None, "reasoning_content": "2+2"}
    chat = parse(request(messages=[USER, message, USER]))
    assert chat.messages[1] == Message(role="assistant", content="4", reasoning="2+2")


def test_an_assistant_messages_reasoning_goes_back_under_either_name() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for key in ("reasoning_content", "reasoning"):
        message = {"role": "assistant", "content": None, key: "why", "tool_calls": [call]}
        assert parse(request(messages=[USER, message])).messages[1] == Message(
            role="assistant", content="", tool_calls=(ToolCall("c", "f", "{}"),), reasoning="why"
        )
    same = {"role": "assistant", "content": "4", "reasoning_content": "r", "reasoning": "r"}
    assert parse(request(messages=[USER, same])).messages[1].reasoning == "r"
    both = {"role": "assistant", "content": "4", "reasoning_content": "a", "reasoning": "b"}
    err = refusal(request(messages=[USER, both]))
    assert (err.status, err.param, err.code) == (400, "messages[1].reasoning", "invalid_value")
    assert err.message == (
        "Invalid 'messages[1]': reasoning_content and reasoning differ; send one of them."
    )
    wrong = {"role": "assistant", "content": "4", "reasoning": 7}
    assert refusal(request(messages=[USER, wrong])).param == "messages[1].reasoning"
    # Only an assistant's message carries reasoning.
    assert refusal(request(messages=[{**USER, "reasoning": "x"}])).param == "messages[0].reasoning"


def test_text_part_with_cache_breakpoint() -> None:
    part = {"type": "text", "text": "doc", "prompt_cache_breakpoint": {"mode": "explicit"}}
    assert parse(request(messages=[{"role": "user", "content": [part]}])).messages == (
        Message(role="user", content="doc"),
    )


def test_limits_are_inclusive() -> None:
    many = [USER] * MAX_MESSAGES
    assert len(parse(request(messages=many)).messages) == MAX_MESSAGES
    parts = [{"type": "text", "text": "a"}] * MAX_CONTENT_PARTS
    assert parse(request(messages=[{"role": "user", "content": parts}])).messages[0].content == (
        "\n".join(["a"] * MAX_CONTENT_PARTS)
    )
    big = {"role": "user", "content": "x" * MAX_PROMPT_CHARS}
    assert parse(request(messages=[big])).messages == (
        Message(role="user", content="x" * MAX_PROMPT_CHARS),
    )
    assert parse(request(stop="s" * MAX_STOP_CHARS)).stop == ("s" * MAX_STOP_CHARS,)
    bias = {str(i): 1 for i in range(MAX_LOGIT_BIAS)}
    assert len(parse(request(logit_bias=bias)).sampling.logit_bias) == MAX_LOGIT_BIAS


def test_tool_history_maps_to_messages() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    chat = parse(
        request(
            messages=[
                USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "7"}],
                },
                {"role": "assistant", "content": "It is 7.", "tool_calls": []},
            ],
            tools=[FN],
        )
    )
    assert chat.messages[1:] == (
        Message(
            role="assistant",
            content="",
            tool_calls=(ToolCall(id="call_1", name="f", arguments='{"a":1}'),),
        ),
        Message(role="tool", content="7", tool_call_id="call_1"),
        Message(role="assistant", content="It is 7."),
    )
    assert (chat.tools, chat.tool_choice, chat.parallel_tool_calls) == (
        (Tool(name="f"),),
        "auto",
        True,
    )


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("none", ("none", None)),
        ("auto", ("auto", None)),
        ("required", ("required", None)),
        ({"type": "function", "function": {"name": "f"}}, ("function", "f")),
    ],
)
def test_tool_choice(choice: Any, expected: tuple[str, str | None]) -> None:
    chat = parse(request(tools=[FN, fn(name="g")], tool_choice=choice))
    assert (chat.tool_choice, chat.tool_name) == expected


def test_tool_choice_none_needs_no_tools() -> None:
    assert parse(request(tool_choice="none")).tool_choice == "none"


def test_response_formats() -> None:
    assert parse(request(response_format={"type": "text"})).response_format is None
    assert parse(request(response_format={"type": "json_object"})).response_format == (
        ResponseFormat("json_object")
    )
    spec = {"name": "o", "description": "d", "schema": {"type": "object"}, "strict": None}
    assert parse(
        request(response_format={"type": "json_schema", "json_schema": spec})
    ).response_format == ResponseFormat("json_schema", schema='{"type":"object"}', name="o")


def test_stop_may_be_an_empty_array() -> None:
    assert parse(request(stop=[])).stop == ()


def test_n_choices_up_to_the_gateways_limit() -> None:
    chat = parse(request(n=5))
    assert (chat.n, chat.to_generate("r").n) == (5, 5)
    assert parse(request()).n == 1
    chat.check_ceilings(2**31, 5)
    with pytest.raises(ApiError) as info:
        chat.check_ceilings(2**31, 4)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "n", "integer_above_max_value")
    assert err.message == "n is 5; this gateway allows at most 4 choices per request."


def test_an_sdk_reply_goes_back_into_the_history_as_it_is() -> None:
    """What the OpenAI SDK sends when a client appends a response's message (model_dump)."""
    reply = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    chat = parse(request(messages=[USER, reply, tool], tools=[FN]))
    assert chat.messages[1] == Message(
        role="assistant", content="", tool_calls=(ToolCall("call_1", "f", "{}"),)
    )
