"""The OpenAPI description of `POST /v1/chat/completions` and the request parser agree: every
bound the schema states is where the parser starts refusing (schema-driven fuzzers rely on it)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol.openai.errors import OpenAIError
from protocol.openai.request import check_max_tokens, parse_chat_object


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    spec = create_app().openapi_schema.to_schema()
    operation = spec["paths"]["/v1/chat/completions"]["post"]
    body: dict[str, Any] = operation["requestBody"]["content"]["application/json"]["schema"]
    return body


def base(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def accepted(body: dict[str, Any]) -> bool:
    """True when the parser takes the body; a refusal must be a 400."""
    status = 200
    try:
        check_max_tokens(parse_chat_object(body), GatewayConfig().max_tokens_limit)
    except OpenAIError as err:
        status = err.status
    assert status in (200, 400)
    return status == 200


def test_required_fields(schema: dict[str, Any]) -> None:
    assert schema["required"] == ["model", "messages"]
    for field in schema["required"]:
        body = base()
        del body[field]
        assert not accepted(body)


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "seed",
        "max_tokens",
        "max_completion_tokens",
    ],
)
def test_number_bounds(schema: dict[str, Any], field: str) -> None:
    prop = schema["properties"][field]
    low, high = prop["minimum"], prop["maximum"]
    assert accepted(base(**{field: low}))
    assert accepted(base(**{field: high}))
    step = 1 if prop["type"] == "integer" else 0.001
    assert not accepted(base(**{field: low - step}))
    assert not accepted(base(**{field: high + step}))


def test_string_and_array_bounds(schema: dict[str, Any]) -> None:
    props = schema["properties"]
    longest_model = props["model"]["maxLength"]
    assert accepted(base(model="m" * longest_model))
    assert not accepted(base(model="m" * (longest_model + 1)))

    most = props["messages"]["maxItems"]
    assert props["messages"]["minItems"] == 1
    assert not accepted(base(messages=[]))
    message = {"role": "user", "content": "x"}
    assert accepted(base(messages=[message] * most))
    assert not accepted(base(messages=[message] * (most + 1)))

    longest = props["messages"]["items"]["properties"]["content"]["maxLength"]
    assert accepted(base(messages=[{"role": "user", "content": "x" * longest}]))
    assert not accepted(base(messages=[{"role": "user", "content": "x" * (longest + 1)}]))

    roles = props["messages"]["items"]["properties"]["role"]["enum"]
    for role in roles:
        assert accepted(base(messages=[{"role": role, "content": "x"}]))
    assert not accepted(base(messages=[{"role": "tool", "content": "x"}]))

    one, many = props["stop"]["oneOf"]
    assert accepted(base(stop="s" * one["maxLength"]))
    assert not accepted(base(stop="s" * (one["maxLength"] + 1)))
    assert not accepted(base(stop=""))
    assert accepted(base(stop=["s"] * many["maxItems"]))
    assert not accepted(base(stop=["s"] * (many["maxItems"] + 1)))
