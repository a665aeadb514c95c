"""The OpenAPI description of `POST /v1/completions` and its parser agree: every bound the
schema states is where the parser starts refusing, a body the schema allows is one the parser
takes; every text_completion the protocol builds, streamed or not, fits the answer schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema_rs
import orjson
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol.core.errors import ApiError, server_error
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk, Echo, PromptToken, TokenLogprob, TopLogprob, Usage
from protocol.openai.completions.request import parse_completion_object
from protocol.openai.completions.response import TextCompletionWriter, text_completion_body
from protocol.openai.sse import SSE

Check = Callable[[Any], bool]


@pytest.fixture(scope="module")
def operation() -> dict[str, Any]:
    spec = create_app().openapi_schema.to_schema()
    post: dict[str, Any] = spec["paths"]["/v1/completions"]["post"]
    return post


@pytest.fixture(scope="module")
def schema(operation: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = operation["requestBody"]["content"]["application/json"]["schema"]
    return body


@pytest.fixture(scope="module")
def allowed(schema: dict[str, Any]) -> Check:
    return jsonschema_rs.Draft202012Validator(schema).is_valid


def base(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Once", **fields}


def accepted(body: dict[str, Any]) -> bool:
    """True when the parser (and the gateway's default ceilings) take the body."""
    status = 200
    config = GatewayConfig()
    try:
        parse_completion_object(body).check_ceilings(config.max_tokens_limit, config.max_choices)
    except ApiError as err:
        status = err.status
    assert status in (200, 400)
    return status == 200


def test_required_fields(schema: dict[str, Any]) -> None:
    assert schema["required"] == ["model", "prompt"]
    for field in schema["required"]:
        body = base()
        del body[field]
        assert not accepted(body)


@pytest.mark.parametrize(
    "field",
    [
        *("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "top_k"),
        *("seed", "max_tokens", "logprobs", "n"),
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


def test_prompt_bounds(schema: dict[str, Any]) -> None:
    text, strings, ids, lists, null = schema["properties"]["prompt"]["oneOf"]
    assert null == {"type": "null"}
    assert accepted(base(prompt="x" * text["maxLength"]))
    assert not accepted(base(prompt="x" * (text["maxLength"] + 1)))
    for kind, item in ((strings, "x"), (lists, [1])):
        assert kind["minItems"] == 1
        assert accepted(base(prompt=[item] * kind["maxItems"]))
        assert not accepted(base(prompt=[item] * (kind["maxItems"] + 1)))
    assert lists["items"] == ids
    token = ids["items"]
    assert accepted(base(prompt=[token["minimum"], token["maximum"]]))
    assert not accepted(base(prompt=[token["maximum"] + 1]))
    assert not accepted(base(prompt=[token["minimum"] - 1]))
    assert accepted(base(prompt=[1] * ids["maxItems"]))
    assert not accepted(base(prompt=[1] * (ids["maxItems"] + 1)))


# Each body as both sides see it: allowed by the schema exactly when accepted by the parser.
@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        ({"prompt": None}, True),
        ({"prompt": []}, False),
        ({"prompt": [[]]}, False),
        ({"prompt": ["a", 1]}, False),
        ({"prompt": [True]}, False),
        ({"prompt": {"text": "x"}}, False),
        ({"echo": True, "logprobs": 0, "max_tokens": 0}, True),
        ({"echo": "yes"}, False),
        ({"logprobs": True}, False),
        ({"best_of": 1}, True),
        ({"suffix": None}, True),
        ({"suffix": "end"}, False),
        ({"stop": "x"}, True),
        ({"stop": []}, True),
        ({"stop": ""}, False),
        ({"logit_bias": {"12": -100}}, True),
        ({"logit_bias": {"x": 1}}, False),
        ({"logit_bias": {"12": 101}}, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
        ({"stream_options": {"include_usage": True}}, False),
        ({"stream": True, "stream_options": {"other": True}}, False),
        ({"user": "u"}, True),
        # Closed: what the parser does not know the schema does not allow.
        ({"messages": []}, False),
        ({"max_completion_tokens": 1}, False),
    ],
)
def test_schema_and_parser_agree(allowed: Check, fields: dict[str, Any], ok: bool) -> None:
    assert allowed(base(**fields)) is ok
    assert accepted(base(**fields)) is ok


# --- the answers ----------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4)
LOGPROB = TokenLogprob("x", -0.5, (120,), (TopLogprob("y", -0.25, (121,)),))
ECHO = Echo("Hi", (PromptToken("H", (72,)), PromptToken("i", (105,), -1.0)))


@pytest.fixture(scope="module")
def body_ok(operation: dict[str, Any]) -> Check:
    content = operation["responses"]["200"]["content"]
    return jsonschema_rs.Draft202012Validator(content["application/json"]["schema"]).is_valid


@pytest.fixture(scope="module")
def event_ok(operation: dict[str, Any]) -> Check:
    content = operation["responses"]["200"]["content"]
    return jsonschema_rs.Draft202012Validator(content["text/event-stream"]["x-itemSchema"]).is_valid


def items() -> list[Chunk]:
    return [
        Chunk("r", 0, "Hel", "", 1, USAGE, logprobs=(LOGPROB,), echo=ECHO),
        Chunk("r", 1, "", "", 1, USAGE, index=1, echo=ECHO, choice_finish="stop"),
        Chunk("r", 2, "lo", "", 1, USAGE, "cancelled", logprobs=(LOGPROB,)),
    ]


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_bodies_fit_the_schema(body_ok: Check, echo: bool, logprobs: bool) -> None:
    builder = CompletionBuilder(n=2)
    for item in items():
        builder.feed(item)
    body = text_completion_body(
        builder,
        id="cmpl-1",
        created=1,
        model="m",
        echo=echo,
        logprobs=logprobs,
        fingerprint="fp_0123456789",
    )
    assert body_ok(body)
    assert not body_ok({**body, "extra": 1})
    assert not body_ok({**body, "choices": [{**body["choices"][0], "finish_reason": "x"}]})


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_stream_events_fit_the_schema(
    event_ok: Check, include_usage: bool, echo: bool, logprobs: bool
) -> None:
    stream = CompletionStream(
        TextCompletionWriter(
            id="cmpl-1",
            created=1,
            model="m",
            include_usage=include_usage,
            logprobs=logprobs,
            echo=echo,
        ),
        SSE,
        n=2,
    )
    out: list[bytes] = []
    for item in items():
        stream.feed(item, out)
    failed = CompletionStream(TextCompletionWriter("cmpl-2", 1, "m"), SSE)
    failed.feed(Chunk("r", 0, "a", "", 1, USAGE), out)
    failed.fail(server_error("boom"), out)
    events = b"".join(out).split(b"\n\n")
    data = [event.removeprefix(b"data: ") for event in events[:-1] if event != b"data: [DONE]"]
    # Four chunks (with echo, the second choice's prompt in one more), usage; text, error.
    assert len(data) == 6 + int(echo) + int(include_usage)
    for event in data:
        assert event_ok(orjson.loads(event)), event


def test_stream_media_schema_is_one_event(operation: dict[str, Any]) -> None:
    """The media type's schema is one event as schemathesis reads an OpenAPI 3.1 event stream
    (`event` "message": no event line; `data`), its data the JSON of an x-itemSchema object
    or the final [DONE]."""
    media = operation["responses"]["200"]["content"]["text/event-stream"]
    event_ok = jsonschema_rs.Draft202012Validator(media["schema"]).is_valid
    json_data = media["schema"]["properties"]["data"]["anyOf"][1]
    assert json_data["contentMediaType"] == "application/json"
    assert json_data["contentSchema"] == media["x-itemSchema"]
    assert event_ok({"event": "message", "data": "[DONE]"})
    assert event_ok({"event": "message", "data": '{"id": "x"}'})
    assert not event_ok({"event": "error", "data": "[DONE]"})
    assert not event_ok({"event": "message", "data": "[DONE]", "extra": 1})
