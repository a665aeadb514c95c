"""Parsing a Responses request into `Generate`: inputs of every kind we take, and a 400
naming the field for everything we refuse (unknown, unsupported, mistyped, missing)."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

from protocol.codec import decode_gateway_frame, encode
from protocol.core.errors import ApiError
from protocol.frames import DEFAULTABLE, Message, ResponseFormat, SamplingParams, Tool, ToolCall
from protocol.openai.errors import error_body
from protocol.openai.responses.events import response_base
from protocol.openai.responses.request import (
    parse_input_tokens_request,
    parse_responses_object,
    parse_responses_request,
)
from tests.protocol.strategies import json_values, mutations, text

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def parse(**fields: Any) -> Any:
    return parse_responses_object({"model": "m", "input": "hi", **fields}, store=True)


def refused(fields: dict[str, Any], param: str, code: str, *, store: bool = True) -> str:
    with pytest.raises(ApiError) as caught:
        parse_responses_object({"model": "m", "input": "hi", **fields}, store=store)
    err = caught.value
    assert (err.status, err.type, err.param, err.code) == (
        400,
        "invalid_request_error",
        param,
        code,
    ), err
    return err.message


def test_a_string_input_is_one_user_message() -> None:
    request = parse_responses_request(b'{"model": "m", "input": "Hello"}')
    generate = request.to_generate("resp_1")
    assert generate.request_id == "resp_1"
    assert generate.model == "m"
    assert generate.messages == (Message("user", "Hello"),)
    assert generate.max_tokens is None
    assert generate.sampling == SamplingParams(unset=DEFAULTABLE)
    assert request.store is False  # the server keeps nothing: not stored


def test_instructions_then_history_then_input() -> None:
    request = parse(instructions="Be brief.", max_output_tokens=16, temperature=0, top_p=0.5)
    history = (Message("user", "before"), Message("assistant", "ok"))
    generate = request.to_generate("r", history)
    assert generate.messages == (
        Message("system", "Be brief."),
        *history,
        Message("user", "hi"),
    )
    assert generate.max_tokens == 16
    assert (generate.sampling.temperature, generate.sampling.top_p) == (0.0, 0.5)
    assert request.store is True  # OpenAI's default, where the server keeps responses


def test_message_items_function_calls_and_their_outputs() -> None:
    request = parse(
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Weather in"},
                {"type": "input_text", "text": "Paris?"},
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "x"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "rain"}]},
        ]
    )  # fmt: skip
    assert request.input == (
        Message("developer", "Use tools."),
        Message("user", "Weather in\nParis?"),
        Message(
            "assistant",
            "Checking.",
            tool_calls=(
                ToolCall("c1", "get_weather", '{"city": "Paris"}'),
                ToolCall("c2", "get_weather", "{}"),
            ),
            reasoning="x",
        ),
        Message("tool", "sunny", tool_call_id="c1"),
        Message("tool", "rain", tool_call_id="c2"),
    )


def test_a_function_call_first_is_its_own_assistant_message() -> None:
    request = parse(
        input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    )
    assert request.input == (Message("assistant", "", tool_calls=(ToolCall("c", "f", "{}"),)),)


def reasoning(text: str = "why", key: str = "content") -> dict[str, Any]:
    kind = "reasoning_text" if key == "content" else "summary_text"
    return {"type": "reasoning", "id": "rs", "summary": [], key: [{"type": kind, "text": text}]}


CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
ANSWER = {"type": "message", "role": "assistant", "content": "Done."}


def test_a_reasoning_item_goes_with_what_follows_it() -> None:
    user = {"role": "user", "content": "hi"}
    assert parse(input=[user, reasoning(), CALL]).input == (
        Message("user", "hi"),
        Message("assistant", "", tool_calls=(ToolCall("c", "f", "{}"),), reasoning="why"),
    )
    # Two items of one turn, and a summary where the text is not given (another server's).
    assert parse(input=[user, reasoning("a"), reasoning("b", "summary"), ANSWER]).input == (
        Message("user", "hi"),
        Message("assistant", "Done.", reasoning="a\nb"),
    )
    both = {**reasoning("whole"), "summary": [{"type": "summary_text", "text": "short"}]}
    assert parse(input=[user, both, ANSWER]).input[1].reasoning == "whole"
    # An answer before the reasoning is its own turn; reasoning with nothing after it is left
    # out.
    assert parse(input=[user, ANSWER, reasoning(), user]).input == (
        Message("user", "hi"),
        Message("assistant", "Done."),
        Message("user", "hi"),
    )


@pytest.mark.parametrize(
    ("item", "param", "code"),
    [
        ({**reasoning(), "content": [{"type": "summary_text", "text": "x"}]},
         "input[0].content[0].type", "invalid_value"),
        ({**reasoning(), "content": [{"type": "reasoning_text"}]},
         "input[0].content[0].text", "missing_required_parameter"),
        ({**reasoning(), "content": ["x"]}, "input[0].content[0]", "invalid_type"),
        ({**reasoning(), "summary": [{"type": "summary_text", "text": 1}]},
         "input[0].summary[0].text", "invalid_type"),
        ({**reasoning(), "content": [{"type": "reasoning_text", "text": "x", "y": 1}]},
         "input[0].content[0].y", "unknown_parameter"),
    ],
)  # fmt: skip
def test_a_bad_reasoning_item_names_its_part(item: dict[str, Any], param: str, code: str) -> None:
    refused({"input": [item, ANSWER]}, param, code)


def test_reasoning_alone_is_no_input() -> None:
    message = refused({"input": [reasoning()]}, "input", "empty_array")
    assert "a reasoning item goes with the assistant message or call after it" in message


def test_tools_tool_choice_and_formats() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = parse(
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        reasoning={"effort": "none"},
    )
    generate = request.to_generate("r")
    assert generate.tools == (
        Tool(
            "get_weather",
            "Weather.",
            orjson.dumps(WEATHER["parameters"]).decode(),
            strict=True,
        ),
    )
    assert (generate.tool_choice, generate.tool_name) == ("function", "get_weather")
    assert generate.parallel_tool_calls is False
    assert generate.response_format == ResponseFormat(
        "json_schema", orjson.dumps(schema).decode(), "out", True
    )
    assert generate.reasoning_effort == "none"
    assert request.text_format == {
        "type": "json_schema",
        "name": "out",
        "schema": schema,
        "strict": True,
    }
    described = {"type": "json_schema", "name": "o", "description": "D.", "schema": {}}
    assert parse(text={"format": described}).text_format == {**described, "strict": False}
    assert parse(text={"format": {"type": "json_object"}}).response_format == ResponseFormat(
        "json_object"
    )
    assert parse(text={"format": {"type": "text"}}).response_format is None
    assert parse(tools=[WEATHER], tool_choice="required").tool_choice == "required"
    # Without tools: "auto" and parallel_tool_calls are accepted (OpenAI's defaults).
    plain = parse(tool_choice="auto", parallel_tool_calls=False)
    assert (plain.tool_choice, plain.parallel_tool_calls, plain.tools) == ("auto", False, ())


def test_background_needs_the_response_stored() -> None:
    assert (parse(background=True).background, parse(background=True).store) == (True, True)
    assert parse().background is False
    message = refused(
        {"background": True}, "background", "invalid_parameter_combination", store=False
    )  # a server that keeps nothing
    assert "keeps no responses" in message


def test_accepted_fields_with_no_effect() -> None:
    request = parse(
        metadata={"a": "b"},
        user="u",
        safety_identifier="s",
        prompt_cache_key="k",
        max_tool_calls=3,
        truncation="disabled",
        service_tier="auto",
        include=[],
        background=False,
        top_logprobs=0,
        stream=True,
        stream_options={"include_obfuscation": False},
        text={"verbosity": "medium"},
    )
    assert (request.metadata, request.user, request.max_tool_calls) == ({"a": "b"}, "u", 3)
    assert request.stream is True


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"logit_bias": {"1": 2}}, "logit_bias", "unknown_parameter"),
        ({"frequency_penalty": 3}, "frequency_penalty", "decimal_above_max_value"),
        ({"messages": []}, "messages", "unknown_parameter"),
        ({"background": True, "store": False}, "background", "invalid_parameter_combination"),
        ({"background": "yes"}, "background", "invalid_type"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_value"),
        ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"prompt": {"id": "p"}}, "prompt", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_value"),
        ({"service_tier": "flex"}, "service_tier", "unsupported_value"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "unsupported_parameter"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort", "invalid_value"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_value"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_value"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.name",
         "missing_required_parameter"),
        ({"text": {"format": {"type": "text", "x": 1}}}, "text.format.x", "unknown_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "missing_required_parameter"),
        ({"tools": [{**WEATHER, "function": {}}]}, "tools[0].function", "unknown_parameter"),
        ({"tools": [WEATHER], "tool_choice": {"type": "mcp"}}, "tool_choice.type",
         "unsupported_value"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice", "invalid_value"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_parameter_combination"),
        ({"temperature": 3}, "temperature", "decimal_above_max_value"),
        ({"max_output_tokens": 15}, "max_output_tokens", "integer_below_min_value"),
        ({"parallel_tool_calls": 1}, "parallel_tool_calls", "invalid_type"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stream_options": {}}, "stream_options", "invalid_parameter_combination"),
        ({"instructions": 5}, "instructions", "invalid_type"),
        ({"input": 5}, "input", "invalid_type"),
        ({"input": []}, "input", "empty_array"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "empty_array"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
        ({"input": [{"content": "x"}]}, "input[0].type", "missing_required_parameter"),
        ({"input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name",
         "unknown_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0].type", "unsupported_value"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
         "input[0].content[0].type", "invalid_value"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type", "unsupported_value"),
        ({"input": [{"type": "nonsense"}]}, "input[0].type", "invalid_value"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id", "missing_required_parameter"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]},
         "input[0].output", "invalid_type"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
         "input[0].encrypted_content", "unsupported_parameter"),
        ({"metadata": {"a": 1}}, "metadata.a", "invalid_type"),
    ],
)  # fmt: skip
def test_refused_with_the_field_named(fields: dict[str, Any], param: str, code: str) -> None:
    refused(fields, param, code)


def test_the_model_comes_first() -> None:
    with pytest.raises(ApiError) as caught:
        parse_responses_object({"input": "x", "bogus": 1})
    assert caught.value.param == "model"

    def unknown(model: str) -> None:
        raise ApiError(404, f"no {model}", "invalid_request_error", "model", "model_not_found")

    with pytest.raises(ApiError) as caught:
        parse_responses_object({"model": "x", "bogus": 1}, unknown)
    assert caught.value.code == "model_not_found"


def test_without_a_store_store_and_previous_response_id_are_refused() -> None:
    message = refused({"store": True}, "store", "unsupported_value", store=False)
    assert "keeps no responses" in message
    message = refused(
        {"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter",
        store=False,
    )  # fmt: skip
    assert "keeps no responses" in message
    assert parse_responses_object({"model": "m", "input": "x", "store": False}).store is False


def test_store_false_where_the_server_stores() -> None:
    assert parse(store=False).store is False
    assert parse(store=True).store is True


# --- hostile input: anything but a valid request is a 400, never another exception -----------


def _check(body: bytes) -> None:
    """Either an ApiError 400 or a request whose Generate survives the runner codec."""
    try:
        request = parse_responses_request(body, store=True)
    except ApiError as exc:
        err = exc
    else:
        generate = request.to_generate("r", (Message("user", "earlier"),))
        assert decode_gateway_frame(encode(generate)) == generate
        return
    assert err.status == 400
    assert err.type == "invalid_request_error"
    orjson.dumps(error_body(err))


FULL: dict[str, Any] = {
    "model": "m",
    "input": [
        {"role": "system", "content": "s"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "u"}]},
        {"type": "reasoning", "summary": [], "content": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "a", "annotations": [], "logprobs": []},
        ]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
    ],
    "instructions": "i",
    "max_output_tokens": 16,
    "temperature": 1,
    "top_p": 0.5,
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "tool_choice": {"type": "function", "name": "f"},
    "parallel_tool_calls": True,
    "text": {"format": {"type": "json_schema", "name": "o", "schema": {}}, "verbosity": "medium"},
    "reasoning": {"effort": "low"},
    "stream": True,
    "stream_options": {"include_obfuscation": False},
    "store": True,
    "previous_response_id": "resp_1",
    "metadata": {"k": "v"},
    "include": [],
    "truncation": "disabled",
}  # fmt: skip


def mutated_requests() -> st.SearchStrategy[Any]:
    """FULL with one value replaced, one key dropped or one key added, at any depth."""
    return mutations(FULL, text | st.sampled_from(sorted(FULL)))


def test_full_is_valid() -> None:
    request = parse_responses_object(FULL, store=True)
    assert len(request.input) == 4  # the function call joins the assistant message


@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    _check(data)


@given(json_values)
def test_random_json(value: Any) -> None:
    _check(orjson.dumps(value))


@given(mutated_requests())
def test_mutated_requests(value: Any) -> None:
    _check(orjson.dumps(value))


# --- input_tokens --------------------------------------------------------------------------


def count(**fields: Any) -> Any:
    return parse_input_tokens_request(orjson.dumps({"model": "m", **fields}), store=True)


def test_input_tokens_is_the_creates_prompt_with_nothing_to_generate() -> None:
    fields = {"input": "hi", "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": "auto"}
    counted = count(**fields, truncation="disabled", personality=None)
    created = parse(**fields)
    assert counted.to_generate("r").messages == created.to_generate("r").messages
    assert counted.to_generate("r").tools == created.to_generate("r").tools
    assert counted.to_generate("r").max_tokens == 0
    assert counted.stream is False


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"input": "hi", "max_output_tokens": 16}, "max_output_tokens", "unknown_parameter"),
        ({"input": "hi", "stream": True}, "stream", "unknown_parameter"),
        ({"input": "hi", "personality": "friendly"}, "personality", "unsupported_parameter"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({}, "input", "missing_required_parameter"),
    ],
)
def test_input_tokens_takes_only_its_fields(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        count(**fields)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


def test_input_tokens_checks_the_model_first() -> None:
    def unknown(model: str) -> None:
        raise ApiError(404, f"The model '{model}' does not exist", "invalid_request_error")

    with pytest.raises(ApiError) as caught:
        parse_input_tokens_request(b'{"model": "x", "nonsense": 1}', unknown)
    assert caught.value.status == 404


def test_the_penalties_sample_and_the_response_shows_them() -> None:
    """The open Responses specification's presence and frequency penalties: sampled with, and
    echoed by the response object (0 when not given)."""
    request = parse(presence_penalty=0.5, frequency_penalty=-1)
    sampling = request.to_generate("r").sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    shown = response_base(request, id="resp_1", created_at=1, store=False)
    assert (shown["presence_penalty"], shown["frequency_penalty"]) == (0.5, -1.0)
    plain = response_base(parse(), id="resp_2", created_at=1, store=False)
    assert (plain["presence_penalty"], plain["frequency_penalty"]) == (0.0, 0.0)


# Every property of openapi.yaml's Response (ModelResponseProperties, ResponseProperties and
# its own) but `user` and `usage`, which it shows only when given and once finished. Besides
# them: the open Responses specification's two penalties, and `store`, which OpenAI's answers
# carry though its schema does not list it.
OPENAI_RESPONSE_FIELDS = {
    "background", "completed_at", "conversation", "created_at", "error", "id",
    "incomplete_details", "instructions", "max_output_tokens", "max_tool_calls", "metadata",
    "model", "moderation", "object", "output", "parallel_tool_calls", "previous_response_id",
    "prompt", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning",
    "safety_identifier", "service_tier", "status", "temperature", "text", "tool_choice",
    "tools", "top_logprobs", "top_p", "truncation",
}  # fmt: skip


def test_the_response_object_has_every_field_of_openais() -> None:
    shown = response_base(parse(), id="resp_1", created_at=1, store=False)
    extra = {"presence_penalty", "frequency_penalty", "store"}
    assert set(shown) == OPENAI_RESPONSE_FIELDS | extra
    assert (shown["conversation"], shown["prompt"], shown["moderation"]) == (None, None, None)
    assert (shown["prompt_cache_retention"], shown["prompt_cache_options"]) == (None, None)
    cached = parse(prompt_cache_retention="24h", prompt_cache_options={"ttl": "30m", "mode": None})
    shown = response_base(cached, id="resp_2", created_at=1, store=False)
    assert (shown["prompt_cache_retention"], shown["prompt_cache_options"]) == (
        "24h",
        {"ttl": "30m"},
    )
