"""Messages API request bodies parsed into `Generate`: what each field becomes, and a 400
naming the field for anything wrong, missing, unknown or not implemented."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

from protocol.anthropic.request import parse_count_request, parse_messages_request
from protocol.codec import decode_gateway_frame, encode
from protocol.core.errors import ApiError
from protocol.frames import DEFAULTABLE, Message, ResponseFormat, SamplingParams, Tool, ToolCall
from tests.protocol.strategies import json_values, mutations

TOOL = {
    "name": "get_weather",
    "description": "Weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def parse(**fields: Any) -> Any:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return parse_messages_request(orjson.dumps(body)).to_generate("msg_1")


def refused(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(**fields)
    assert err.value.status == 400
    return err.value


def test_a_plain_request() -> None:
    gen = parse()
    assert gen.messages == (Message(role="user", content="Hi"),)
    assert (gen.max_tokens, gen.sampling, gen.tools, gen.reasoning_effort) == (
        16,
        SamplingParams(unset=DEFAULTABLE),
        (),
        None,
    )


def test_system_messages_and_sampling() -> None:
    gen = parse(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        temperature=0,
        top_p=0.5,
        top_k=3,
        metadata={"user_id": "u1"},
        stream=True,
        stop_sequences=["END", "\n\n"],
    )
    assert gen.messages[0] == Message(role="system", content="Be brief.\nBe kind.")
    assert gen.stop == ("END", "\n\n")
    assert parse(stop_sequences=[]).stop == ()
    assert gen.sampling == SamplingParams(temperature=0.0, top_p=0.5, top_k=3, unset=("min_p",))
    assert parse(system="S").messages[0] == Message(role="system", content="S")


def test_a_tool_conversation() -> None:
    gen = parse(
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": ""},
                    {"type": "text", "text": "Looking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert gen.tools == (
        Tool(
            "get_weather",
            "Weather in a city.",
            parameters=orjson.dumps(TOOL["input_schema"]).decode(),
        ),
    )
    assert (gen.tool_choice, gen.tool_name, gen.parallel_tool_calls) == (
        "function",
        "get_weather",
        False,
    )
    assert gen.messages == (
        Message(role="user", content="Weather?"),
        Message(
            role="assistant",
            content="Looking.",
            tool_calls=(ToolCall("toolu_1", "get_weather", '{"city":"Paris"}'),),
            reasoning="t",
        ),
        Message(role="tool", content="Sunny", tool_call_id="toolu_1"),
        Message(role="user", content="And tomorrow?"),
    )


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, ("auto", None, True)),
        ({"type": "any"}, ("required", None, True)),
        ({"type": "none"}, ("none", None, True)),
    ],
)
def test_tool_choices(choice: Any, expected: Any) -> None:
    gen = parse(tools=[TOOL], tool_choice=choice)
    assert (gen.tool_choice, gen.tool_name, gen.parallel_tool_calls) == expected


def test_thinking_goes_through_the_chat_template_switch() -> None:
    assert parse(thinking={"type": "disabled"}).reasoning_effort == "none"
    enabled = parse(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled.reasoning_effort not in (None, "none", "minimal")


def test_output_config_is_the_answers_schema_and_the_effort() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    gen = parse(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert gen.response_format == ResponseFormat(
        "json_schema", schema=orjson.dumps(schema).decode(), strict=True
    )
    assert gen.reasoning_effort is None
    assert parse(output_config={"effort": "high"}).reasoning_effort == "high"
    assert parse(
        output_config={"effort": "low"}, thinking={"type": "disabled"}
    ).reasoning_effort == ("none")
    on = {"type": "enabled", "budget_tokens": 1024}
    assert parse(
        max_tokens=2048, thinking=on, output_config={"effort": "max"}
    ).reasoning_effort == ("max")
    assert parse(output_config={}).response_format is None


@pytest.mark.parametrize(
    ("config", "param"),
    [
        ("json", "output_config"),
        ({"effort": "extreme"}, "output_config.effort"),
        ({"effort": 3}, "output_config.effort"),
        ({"format": {"type": "json_object"}}, "output_config.format.type"),
        ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
        ({"format": {"type": "json_schema", "schema": "{}"}}, "output_config.format.schema"),
        ({"format": {"type": "json_schema", "schema": {}, "x": 1}}, "output_config.format.x"),
        ({"verbosity": "low"}, "output_config.verbosity"),
    ],
)
def test_a_bad_output_config_names_its_field(config: Any, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse(output_config=config)
    assert (err.value.status, err.value.param) == (400, param)


def test_a_thinking_block_needs_its_text() -> None:
    turn = {"role": "assistant", "content": [{"type": "thinking", "signature": ""}]}
    with pytest.raises(ApiError) as err:
        parse(messages=[{"role": "user", "content": "Hi"}, turn, {"role": "user", "content": "?"}])
    assert err.value.param == "messages[1].content[0].thinking"
    redacted = {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}
    gen = parse(
        messages=[{"role": "user", "content": "Hi"}, redacted, {"role": "user", "content": "?"}]
    )
    assert gen.messages[1] == Message(role="assistant", content="")


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"foo": 1}, "foo"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"stop_sequences": "\n"}, "stop_sequences"),
        ({"stop_sequences": [1]}, "stop_sequences[0]"),
        ({"stop_sequences": ["a", ""]}, "stop_sequences[1]"),
        ({"stop_sequences": ["x" * 257]}, "stop_sequences[0]"),
        ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
        ({"metadata": {"user_id": "u", "x": 1}}, "metadata.x"),
        ({"system": 3}, "system"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "messages[1]",
        ),
        ({"tools": [{**TOOL, "type": "web_search_20250305"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "adaptive"}}, "thinking.type"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], names: str) -> None:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    body.update(fields)
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ApiError) as err:
        parse_messages_request(orjson.dumps(body))
    assert err.value.status == 400
    assert names in err.value.message


def test_the_model_comes_first() -> None:
    seen: list[str] = []

    def check(model: str) -> None:
        seen.append(model)
        raise ApiError(404, f"model {model} not found", "invalid_request_error")

    with pytest.raises(ApiError) as err:
        parse_messages_request(b'{"model": "nope", "foo": 1}', check)
    assert (err.value.status, seen) == (404, ["nope"])


def test_count_tokens_generates_nothing() -> None:
    parsed = parse_count_request(
        orjson.dumps({"model": "m", "system": "S", "messages": [{"role": "user", "content": "Hi"}]})
    )
    gen = parsed.to_generate("count_1")
    assert (gen.max_tokens, len(gen.messages), parsed.stream) == (0, 2, False)
    with pytest.raises(ApiError, match="max_tokens"):
        parse_count_request(
            orjson.dumps(
                {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
            )
        )


# --- hostile input: a 400, never anything else -----------------------------------------------

FULL: dict[str, Any] = {
    "model": "m",
    "max_tokens": 2048,
    "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "u"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t", "signature": "x"},
                {"type": "text", "text": "a"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "7"}],
                },
                {"type": "text", "text": "more"},
            ],
        },
    ],
    "stream": True,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 3,
    "stop_sequences": [],
    "metadata": {"user_id": "u"},
    "tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": False}],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
}


def check(data: bytes) -> None:
    """Parses into a Generate the runner protocol can carry, or is a 400."""
    try:
        parsed = parse_messages_request(data)
    except ApiError as exc:
        err = exc
    else:
        generate = parsed.to_generate("msg_1")
        assert decode_gateway_frame(encode(generate)) == generate
        return
    assert err.status == 400


def mutated_requests() -> st.SearchStrategy[Any]:
    """FULL with one value replaced, one key dropped or one key added, at any depth."""
    return mutations(FULL, st.text(max_size=8) | st.sampled_from(sorted(FULL)))


def test_full_is_valid() -> None:
    gen = parse_messages_request(orjson.dumps(FULL)).to_generate("msg_1")
    assert [m.role for m in gen.messages] == ["system", "user", "assistant", "tool", "user"]


@given(mutated_requests())
def test_mutated_requests(value: Any) -> None:
    check(orjson.dumps(value))


@given(json_values)
def test_random_json(value: Any) -> None:
    check(orjson.dumps(value))
