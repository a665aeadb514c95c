"""Ollama's `/api/chat` and `/api/generate` bodies into `Generate`: every honoured field, and a
400 naming each field that is unknown, mistyped or not supported."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from protocol.core.errors import ApiError, model_not_found
from protocol.frames import DEFAULTABLE, Message, ResponseFormat, SamplingParams, Tool, ToolCall
from protocol.ollama.request import OLLAMA_DEFAULTS, in_ollama_terms, parse_chat, parse_generate
from runner import demo_model

HI = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> Any:
    return parse_chat(orjson.dumps({"model": "m", "messages": HI, **fields}))


def generate(**fields: Any) -> Any:
    return parse_generate(orjson.dumps({"model": "m", "prompt": "Once", **fields}))


def refused(parse: Any, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(**fields)
    assert info.value.status == 400
    return info.value


def test_a_minimal_chat_streams_with_ollamas_defaults() -> None:
    request = chat()
    assert request.stream is True
    assert request.sampling == SamplingParams(
        temperature=0.8, top_p=0.9, top_k=40, unset=DEFAULTABLE
    )
    assert request.sampling == OLLAMA_DEFAULTS
    generate_ = request.to_generate("r1")
    assert generate_.messages == (Message("user", "hi"),)
    assert (generate_.request_id, generate_.model, generate_.max_tokens) == ("r1", "m", None)
    assert generate_.prompt is None
    assert not request.load_only


def test_options_are_honoured() -> None:
    request = chat(
        stream=False,
        options={
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "min_p": 0.1,
            "num_predict": 7,
            "stop": ["\n", "END"],
            "seed": 42,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
        },
        keep_alive="5m",
    )
    assert request.stream is False
    assert request.sampling == SamplingParams(
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
    )
    generate_ = request.to_generate("r")
    assert (generate_.max_tokens, generate_.stop) == (7, ("\n", "END"))


@pytest.mark.parametrize("value", [-1, -2])
def test_num_predict_without_a_limit(value: int) -> None:
    assert chat(options={"num_predict": value}).max_tokens is None


def test_a_negative_seed_is_random() -> None:
    assert chat(options={"seed": -1}).sampling.seed is None


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("json", ResponseFormat("json_object")),
        ("", None),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}},
            ResponseFormat(
                "json_schema",
                schema='{"type":"object","properties":{"a":{"type":"string"}}}',
                name="format",
            ),
        ),
    ],
)
def test_format(fmt: Any, expected: ResponseFormat | None) -> None:
    assert chat(format=fmt).response_format == expected


@pytest.mark.parametrize(
    ("think", "effort", "kwargs"),
    [
        (None, None, None),
        (True, "medium", None),
        (False, None, '{"enable_thinking":false}'),
        ("low", "low", None),
        ("high", "high", None),
    ],
)
def test_think(think: Any, effort: str | None, kwargs: str | None) -> None:
    generate_ = chat(think=think).to_generate("r")
    assert (generate_.reasoning_effort, generate_.chat_template_kwargs) == (effort, kwargs)


def test_a_model_that_cannot_think_is_refused_in_ollamas_terms() -> None:
    refusal = ApiError(
        400, "reasoning_effort is for ...", "invalid_request_error", "reasoning_effort"
    )
    err = in_ollama_terms(refusal, "m")
    assert (err.status, err.message, err.param) == (400, '"m" does not support thinking', "think")
    unknown = in_ollama_terms(model_not_found("gone"), "gone")
    assert (unknown.status, unknown.message) == (404, 'model "gone" not found')
    other = ApiError(400, "too long", "invalid_request_error", "messages")
    assert in_ollama_terms(other, "m").message == "too long"


def test_tools_and_a_tool_conversation() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        *demo_model.TOOL_DEMO_MESSAGES,
        {
            "role": "assistant",
            "thinking": "I should call it.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    request = chat(messages=messages, tools=list(demo_model.TOOL_DEMO_TOOLS))
    (tool,) = request.tools
    assert isinstance(tool, Tool)
    assert tool.name == "get_weather"
    assert tool.parameters is not None
    assert orjson.loads(tool.parameters)["required"] == ["city"]
    assert request.messages == (
        Message("system", "Be brief."),
        Message("user", "What is the weather like in Paris today?"),
        Message(
            "assistant",
            "",
            tool_calls=(ToolCall("call_0", "get_weather", '{"city":"Paris"}'),),
            reasoning="I should call it.",
        ),
        Message("tool", "sunny", name="get_weather"),
    )


def test_the_library_sends_an_empty_tools_list() -> None:
    assert chat(tools=[]).tools == ()


def test_no_messages_only_loads() -> None:
    assert chat(messages=[]).load_only
    assert parse_chat(b'{"model": "m"}').load_only
    assert generate(prompt="").load_only


def test_generate_wraps_the_prompt_as_a_user_message() -> None:
    request = generate(system="Be brief.")
    assert request.endpoint == "generate"
    assert request.messages == (Message("system", "Be brief."), Message("user", "Once"))
    assert request.to_generate("r").prompt is None


def test_a_raw_prompt_goes_as_it_is() -> None:
    generate_ = generate(raw=True).to_generate("r")
    assert (generate_.prompt, generate_.messages) == ("Once", ())


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"truncate": True}, "truncate"),
        ({"options": {"num_ctx": 4096}}, "options.num_ctx"),
        ({"options": {"repeat_penalty": 1.1}}, "options.repeat_penalty"),
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"temperature": 3}}, "options.temperature"),
        ({"options": {"top_k": -1}}, "options.top_k"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"options": {"stop": "x"}}, "options.stop"),
        ({"options": {"stop": ["x", 1]}}, "options.stop[1]"),
        ({"options": []}, "options"),
        ({"format": "yaml"}, "format"),
        ({"format": 3}, "format"),
        ({"think": "extreme"}, "think"),
        ({"think": 1}, "think"),
        ({"keep_alive": [1]}, "keep_alive"),
        ({"stream": "yes"}, "stream"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "messages[0].images",
        ),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": "hi"}, "messages"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}], "x": 1}
                ]
            },
            "messages[0].x",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
    ],
)
def test_chat_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(chat, **fields).param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"context": [1, 2]}, "context"),
        ({"images": ["aGk="]}, "images"),
        ({"width": 64}, "width"),
        ({"messages": HI}, "messages"),
        ({"prompt": 3}, "prompt"),
        ({"raw": True, "system": "x"}, "system"),
    ],
)
def test_generate_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(generate, **fields).param == param


def test_the_model_is_checked_first() -> None:
    def check_model(model: str) -> None:
        raise ApiError(404, f"no {model}", "invalid_request_error", "model", "model_not_found")

    with pytest.raises(ApiError) as info:
        parse_chat(orjson.dumps({"model": "gone", "bogus": 1}), check_model)
    assert (info.value.status, info.value.message) == (404, "no gone")
    with pytest.raises(ApiError) as info:
        parse_chat(b'{"messages": []}')
    assert info.value.param == "model"
