"""OpenAI's legacy text completions request with no event loop, field by field: the Generate it
maps to, its refusals (a 400 naming the parameter) and any JSON as a request or a 400."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given

from protocol.core import errors
from protocol.core.errors import ApiError
from protocol.frames import DEFAULTABLE, Generate, LogitBias, SamplingParams
from protocol.openai.completions.request import (
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
    CompletionRequest,
    parse_completion_object,
    parse_completion_request,
)
from tests.protocol.strategies import json_values

BASE: dict[str, Any] = {"model": "m", "prompt": "Once upon"}


def body(**fields: Any) -> dict[str, Any]:
    """BASE with `fields` set (a value of ... removes the field)."""
    merged = {**BASE, **fields}
    return {key: value for key, value in merged.items() if value is not ...}


def parse(**fields: Any) -> CompletionRequest:
    return parse_completion_request(orjson.dumps(body(**fields)))


def refusal(data: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_completion_request(data if isinstance(data, bytes) else orjson.dumps(data))
    err = info.value
    assert (err.status, err.type) == (400, "invalid_request_error")
    return err


def test_minimal_request_has_the_legacy_defaults() -> None:
    request = parse()
    unset = SamplingParams(unset=DEFAULTABLE)
    assert request == CompletionRequest(
        model="m", prompts=("Once upon",), max_tokens=16, sampling=unset
    )
    assert request.to_generates("cmpl-1") == [
        Generate("cmpl-1", "m", (), max_tokens=16, sampling=unset, prompt="Once upon")
    ]


def test_full_request_maps_to_the_exact_generates() -> None:
    request = parse(
        prompt=[[1, 2, 3], [4]],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=0,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=1,
        frequency_penalty=-1,
        seed=7,
        stop=["\n", "END"],
        logit_bias={"13": -100},
        logprobs=2,
        echo=True,
        n=2,
        user="u",
    )
    sampling = SamplingParams(0.5, 0.9, 5, 0.1, 7, 1.0, -1.0, (LogitBias(13, -100.0),))
    expected = [
        Generate(
            f"cmpl-1-{k}",
            "m",
            (),
            max_tokens=0,
            stop=("\n", "END"),
            sampling=sampling,
            logprobs=True,
            top_logprobs=2,
            n=2,
            prompt_tokens=tokens,
            echo=True,
            prompt_logprobs=True,
        )
        for k, tokens in enumerate([(1, 2, 3), (4,)])
    ]
    assert request.to_generates("cmpl-1") == expected
    assert (request.stream, request.include_usage, request.choices) == (True, True, 4)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("", ("",)),
        (None, ("",)),  # OpenAI's default: the start of a document
        (["a", "b"], ("a", "b")),
        ([1, 2], ((1, 2),)),
        ([[1], [2, 3]], ((1,), (2, 3))),
        ([0, 2**31 - 1], ((0, 2**31 - 1),)),
    ],
)
def test_prompt_forms(prompt: Any, expected: tuple[Any, ...]) -> None:
    assert parse(prompt=prompt).prompts == expected


@pytest.mark.parametrize(
    ("fields", "echo", "prompt_logprobs", "logprobs", "top"),
    [
        ({}, False, False, False, 0),
        ({"echo": True}, True, False, False, 0),
        ({"logprobs": 0}, True, False, True, 0),  # the prompt's text: text_offset's start
        ({"logprobs": 5, "echo": True}, True, True, True, 5),
        ({"logprobs": None, "echo": None}, False, False, False, 0),
    ],
)
def test_echo_and_logprobs_in_the_generate(
    fields: dict[str, Any], echo: bool, prompt_logprobs: bool, logprobs: bool, top: int
) -> None:
    (generate,) = parse(**fields).to_generates("c")
    assert (generate.echo, generate.prompt_logprobs) == (echo, prompt_logprobs)
    assert (generate.logprobs, generate.top_logprobs) == (logprobs, top)


def test_best_of_equal_to_n_is_n_choices() -> None:
    assert parse(best_of=3, n=3).n == 3
    assert parse(best_of=1).n == 1
    assert parse(best_of=1, stream=True).stream


def test_limits_are_inclusive() -> None:
    assert len(parse(prompt=["x"] * MAX_PROMPTS).prompts) == MAX_PROMPTS
    assert parse(prompt=[1] * MAX_PROMPT_TOKEN_IDS).prompts == ((1,) * MAX_PROMPT_TOKEN_IDS,)
    assert parse(logprobs=5).logprobs == 5
    assert parse(max_tokens=0).max_tokens == 0


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"prompt": ...}, "prompt", "missing_required_parameter"),
        ({"model": ...}, "model", "missing_required_parameter"),
        ({"model": 1}, "model", "invalid_type"),
        ({"prompt": 1}, "prompt", "invalid_type"),
        ({"prompt": {}}, "prompt", "invalid_type"),
        ({"prompt": []}, "prompt", "empty_array"),
        ({"prompt": [[]]}, "prompt[0]", "empty_array"),
        ({"prompt": ["a", 1]}, "prompt[1]", "invalid_type"),
        ({"prompt": [1, "a"]}, "prompt[1]", "invalid_type"),
        ({"prompt": [1, True]}, "prompt[1]", "invalid_type"),
        ({"prompt": [1.5]}, "prompt[0]", "invalid_type"),
        ({"prompt": [-1]}, "prompt[0]", "integer_below_min_value"),
        ({"prompt": [2**31]}, "prompt[0]", "integer_above_max_value"),
        ({"prompt": [[1], [2, "x"]]}, "prompt[1][1]", "invalid_type"),
        ({"prompt": [[1], 2]}, "prompt[1]", "invalid_type"),
        ({"prompt": [None]}, "prompt[0]", "invalid_type"),
        ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt", "array_above_max_length"),
        ({"prompt": [[1]] * (MAX_PROMPTS + 1)}, "prompt", "array_above_max_length"),
        ({"prompt": [1] * (MAX_PROMPT_TOKEN_IDS + 1)}, "prompt", "array_above_max_length"),
        (
            {"prompt": [[1] * (MAX_PROMPT_TOKEN_IDS // 2 + 1)] * 2},
            "prompt",
            "array_above_max_length",
        ),
        ({"suffix": "end"}, "suffix", "unsupported_parameter"),
        ({"suffix": 1}, "suffix", "invalid_type"),
        ({"best_of": 2}, "best_of", "unsupported_value"),
        ({"best_of": 1, "n": 2}, "best_of", "invalid_value"),
        ({"best_of": 0}, "best_of", "invalid_value"),
        ({"best_of": 21}, "best_of", "integer_above_max_value"),
        ({"best_of": 2, "n": 2, "stream": True}, "best_of", "invalid_parameter_combination"),
        ({"logprobs": True}, "logprobs", "invalid_type"),
        ({"logprobs": 6}, "logprobs", "integer_above_max_value"),
        ({"logprobs": -1}, "logprobs", "integer_below_min_value"),
        ({"echo": 1}, "echo", "invalid_type"),
        ({"max_tokens": -1}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 1.0}, "max_tokens", "invalid_type"),
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"n": 129}, "n", "integer_above_max_value"),
        ({"temperature": 2.5}, "temperature", "decimal_above_max_value"),
        ({"top_p": -0.1}, "top_p", "decimal_below_min_value"),
        ({"presence_penalty": "x"}, "presence_penalty", "invalid_type"),
        ({"seed": 2**63}, "seed", "integer_above_max_value"),
        ({"stop": ""}, "stop", "empty_string"),
        ({"stop": ["a"] * 5}, "stop", "array_above_max_length"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_parameter_combination",
        ),
        ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x", "unknown_parameter"),
        ({"user": 1}, "user", "invalid_type"),
        ({"messages": []}, "messages", "unknown_parameter"),
        ({"tools": []}, "tools", "unknown_parameter"),
        ({"max_completion_tokens": 3}, "max_completion_tokens", "unknown_parameter"),
    ],
)
def test_refusals_name_the_parameter(fields: dict[str, Any], param: str, code: str) -> None:
    err = refusal(body(**fields))
    assert (err.param, err.code) == (param, code)


def test_refusals_say_why() -> None:
    assert refusal(body(suffix="x")).message == (
        "Unsupported parameter: 'suffix' is not supported with this server: inserting text "
        "(a suffix after the completion) is not implemented."
    )
    assert refusal(body(best_of=3)).message == (
        "Unsupported value: 'best_of' does not support 3 with this server. Only the default "
        "(1, the value of n) value is supported."
    )
    assert refusal(body(prompt=[1, "a"])).message == (
        "Invalid type for 'prompt[1]': expected an integer, but got a string instead."
    )


def test_bodies_that_are_not_objects() -> None:
    assert refusal(b"{").code == "invalid_json"
    assert refusal([BASE]).code == "invalid_type"


def test_the_model_is_checked_first() -> None:
    def check(model: str) -> None:
        raise errors.model_not_found(model)

    with pytest.raises(ApiError) as info:
        parse_completion_object({"model": "nope", "prompt": 1, "suffix": "x"}, check)
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_the_gateways_limits() -> None:
    parse(max_tokens=100, n=8).check_ceilings(100, 8)
    with pytest.raises(ApiError) as info:
        parse(max_tokens=101).check_ceilings(100, 8)
    assert (info.value.param, info.value.code) == ("max_tokens", "integer_above_max_value")
    with pytest.raises(ApiError) as info:
        parse(n=9).check_ceilings(100, 8)
    assert (info.value.param, info.value.code) == ("n", "integer_above_max_value")


@given(json_values)
def test_any_json_is_a_request_or_a_400(value: Any) -> None:
    for data in (value, {"model": "m", "prompt": value}, {**BASE, "stop": value}):
        status = 200
        try:
            parse_completion_object(data)
        except ApiError as err:
            status = err.status
        assert status in (200, 400)
