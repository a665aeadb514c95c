"""OpenAI Chat Completions request parsing of hostile input: random bytes, random JSON and
mutations of a request using every field are a 400 or a Generate the runner codec carries."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import orjson
from hypothesis import given

from protocol.codec import decode_gateway_frame, encode
from protocol.core.errors import ApiError
from protocol.frames import LogitBias, Message, ResponseFormat, SamplingParams, Tool
from protocol.openai.chat.request import ChatRequest, parse_chat_request
from protocol.openai.errors import error_body
from tests.protocol.openai.chat.requests import parse
from tests.protocol.strategies import json_values, mutations, text


def _check(data: bytes) -> None:
    """Either an ApiError 400 or a request whose Generate survives the runner codec."""
    try:
        chat = parse_chat_request(data)
    except ApiError as exc:
        err = exc
    else:
        generate = chat.to_generate("r")
        assert decode_gateway_frame(encode(generate)) == generate
        return
    assert err.status == 400
    assert err.type == "invalid_request_error"
    orjson.dumps(error_body(err))


@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    _check(data)


@given(json_values)
def test_random_json(value: Any) -> None:
    _check(orjson.dumps(value))


FULL: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": [{"type": "text", "text": "s"}], "name": "n"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "refusal": None, "tool_calls": []},
    ],
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_tokens": 5,
    "temperature": 1,
    "top_p": 0.5,
    "top_k": 3,
    "min_p": 0.1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "seed": 1,
    "stop": ["a"],
    "logit_bias": {"1": 1},
    "n": 1,
    "logprobs": True,
    "top_logprobs": 2,
    "tools": [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "strict": False},
        }
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {}}},
    "modalities": ["text"],
    "service_tier": "auto",
    "prompt_cache_options": {"mode": "implicit"},
    "chat_template_kwargs": {"k": [1]},
}


def mutated_requests() -> st.SearchStrategy[Any]:
    """FULL with one value replaced, one key dropped or one key added, at any depth."""
    return mutations(FULL, text | st.sampled_from(sorted(FULL)))


def test_full_is_valid() -> None:
    # Every field of FULL read as it says, so that its mutations start from a valid request.
    assert parse(FULL) == ChatRequest(
        model="m",
        messages=(
            Message(role="system", content="s", name="n"),
            Message(role="user", content="u"),
            Message(role="assistant", content="a"),
        ),
        stream=True,
        include_usage=True,
        continuous_usage_stats=True,
        max_tokens=5,
        stop=("a",),
        sampling=SamplingParams(
            temperature=1.0,
            top_p=0.5,
            top_k=3,
            min_p=0.1,
            seed=1,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            logit_bias=(LogitBias(token=1, bias=1.0),),
        ),
        tools=(Tool(name="f", parameters='{"type":"object"}', strict=False),),
        tool_choice="auto",
        parallel_tool_calls=True,
        response_format=ResponseFormat(type="json_schema", schema="{}", name="o"),
        logprobs=True,
        top_logprobs=2,
        chat_template_kwargs='{"k":[1]}',
        n=1,
    )


@given(mutated_requests())
def test_mutated_requests(value: Any) -> None:
    _check(orjson.dumps(value))
