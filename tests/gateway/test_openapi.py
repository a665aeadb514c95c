"""The OpenAPI description of `POST /v1/chat/completions` and the request parser agree: every
bound the schema states is where the parser starts refusing, and a body the schema allows is
one the parser takes (schema-driven fuzzers rely on it); every answer the protocol builds fits
the response schemas.

Schemas are checked with jsonschema_rs, the validator schemathesis holds responses against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import jsonschema_rs
import orjson
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol.core.errors import ApiError, server_error
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, ReasoningEffort, TokenLogprob, ToolCallDelta, TopLogprob, Usage
from protocol.openai.chat.request import (
    MAX_TEMPLATE_KWARGS_BYTES,
    parse_chat_object,
)
from protocol.openai.chat.response import ChunkWriter, completion
from protocol.openai.sse import SSE

Check = Callable[[Any], bool]


@pytest.fixture(scope="module")
def operation() -> dict[str, Any]:
    spec = create_app().openapi_schema.to_schema()
    post: dict[str, Any] = spec["paths"]["/v1/chat/completions"]["post"]
    return post


@pytest.fixture(scope="module")
def schema(operation: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = operation["requestBody"]["content"]["application/json"]["schema"]
    return body


@pytest.fixture(scope="module")
def allowed(schema: dict[str, Any]) -> Check:
    """True when the request schema allows the body."""
    return jsonschema_rs.Draft202012Validator(schema).is_valid


def base(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def accepted(body: dict[str, Any]) -> bool:
    """True when the parser takes the body; a refusal must be a 400."""
    status = 200
    try:
        config = GatewayConfig()
        parse_chat_object(body).check_ceilings(config.max_tokens_limit, config.max_choices)
    except ApiError as err:
        status = err.status
    assert status in (200, 400)
    return status == 200


def tool(name: str = "get_weather", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


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
        "top_logprobs",
    ],
)
def test_number_bounds(schema: dict[str, Any], field: str) -> None:
    prop = schema["properties"][field]
    low, high = prop["minimum"], prop["maximum"]
    needs = {"logprobs": True} if field == "top_logprobs" else {}
    assert accepted(base(**needs, **{field: low}))
    assert accepted(base(**needs, **{field: high}))
    step = 1 if prop["type"] == "integer" else 0.001
    assert not accepted(base(**needs, **{field: low - step}))
    assert not accepted(base(**needs, **{field: high + step}))


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

    plain, assistant, tool_message = props["messages"]["items"]["oneOf"]
    longest = plain["properties"]["content"]["maxLength"]
    assert assistant["properties"]["content"]["maxLength"] == longest
    assert tool_message["properties"]["content"]["maxLength"] == longest
    assert accepted(base(messages=[{"role": "user", "content": "x" * longest}]))
    assert not accepted(base(messages=[{"role": "user", "content": "x" * (longest + 1)}]))

    roles = [
        role
        for kind in (plain, assistant, tool_message)
        for role in kind["properties"]["role"]["enum"]
    ]
    assert sorted(roles) == ["assistant", "developer", "system", "tool", "user"]
    for kind in (plain, assistant, tool_message):
        for role in kind["properties"]["role"]["enum"]:
            fields = dict.fromkeys(kind["required"], "x")
            assert accepted(base(messages=[{**fields, "role": role, "content": "x"}]))
    assert not accepted(base(messages=[{"role": "function", "content": "x"}]))

    calls = assistant["properties"]["tool_calls"]["maxItems"]
    with_calls = {"role": "assistant", "content": None, "tool_calls": [CALL] * calls}
    assert accepted(base(messages=[with_calls]))
    assert not accepted(base(messages=[{**with_calls, "tool_calls": [CALL] * (calls + 1)}]))

    one, many = props["stop"]["oneOf"]
    assert accepted(base(stop="s" * one["maxLength"]))
    assert not accepted(base(stop="s" * (one["maxLength"] + 1)))
    assert not accepted(base(stop=""))
    assert many["minItems"] == 0
    assert accepted(base(stop=[]))
    assert accepted(base(stop=["s"] * many["maxItems"]))
    assert not accepted(base(stop=["s"] * (many["maxItems"] + 1)))


def test_tool_bounds(schema: dict[str, Any]) -> None:
    tools = schema["properties"]["tools"]
    most = tools["maxItems"]
    assert accepted(base(tools=[tool(f"f{i}") for i in range(most)]))
    assert not accepted(base(tools=[tool(f"f{i}") for i in range(most + 1)]))

    name = tools["items"]["properties"]["function"]["properties"]["name"]
    assert name["pattern"] == "^[a-zA-Z0-9_-]+$"
    assert accepted(base(tools=[tool("f" * name["maxLength"])]))
    assert not accepted(base(tools=[tool("f" * (name["maxLength"] + 1))]))
    choice = schema["properties"]["tool_choice"]["oneOf"][1]
    assert choice["properties"]["function"]["properties"]["name"] == name
    response_format = schema["properties"]["response_format"]["oneOf"][2]
    assert response_format["properties"]["json_schema"]["properties"]["name"] == name


def test_enums(schema: dict[str, Any], allowed: Check) -> None:
    props = schema["properties"]
    efforts = props["reasoning_effort"]["enum"]
    assert efforts == list(get_args(ReasoningEffort))
    for effort in efforts:
        assert accepted(base(reasoning_effort=effort))
    assert not accepted(base(reasoning_effort="extreme"))

    choices = props["tool_choice"]["oneOf"][0]["enum"]
    assert choices == ["none", "auto", "required"]
    for choice in choices:
        assert accepted(base(tools=[tool()], tool_choice=choice))
        assert allowed(base(tools=[tool()], tool_choice=choice))

    formats = [kind["properties"]["type"]["enum"] for kind in props["response_format"]["oneOf"]]
    assert formats == [["text"], ["json_object"], ["json_schema"]]


JSON_SCHEMA = {"name": "out", "description": "d", "schema": {"type": "object"}, "strict": True}


# Each body as both sides see it: allowed by the schema exactly when accepted by the parser.
@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        # Messages of every role.
        ({"messages": [{"role": "system", "content": "x"}]}, True),
        ({"messages": [{"role": "developer", "content": "x", "name": "n"}]}, True),
        ({"messages": [{"role": "user", "content": 3}]}, False),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, False),
        ({"messages": [{"role": "function", "content": "x"}]}, False),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "call_1"}]}, True),
        ({"messages": [{"role": "tool", "content": "x"}]}, False),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]}, False),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c", "name": "n"}]}, False),
        ({"messages": [{"role": "assistant", "content": "x"}]}, True),
        ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": "r"}]}, True),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, True),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [CALL]}]}, True),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [CALL]}]}, True),
        ({"messages": [{"role": "assistant", "tool_calls": [CALL]}]}, True),
        ({"messages": [{"role": "assistant", "content": None}]}, False),
        ({"messages": [{"role": "assistant"}]}, False),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, False),
        ({"messages": [{"role": "assistant", "content": 1, "tool_calls": [CALL]}]}, False),
        ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}]}, False),
        ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "x": 1}]}]}, False),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f"}}]}]}, False),
        # Tools.
        ({"tools": []}, True),
        ({"tools": [tool()]}, True),
        ({"tools": [tool(description="d", parameters={"type": "object"}, strict=True)]}, True),
        ({"tools": [tool(parameters="{}")]}, False),
        ({"tools": [tool(strict="yes")]}, False),
        ({"tools": [tool(extra=1)]}, False),
        ({"tools": [tool("a b")]}, False),
        ({"tools": [tool("é")]}, False),
        ({"tools": [tool("")]}, False),
        ({"tools": [{"type": "function", "function": {"description": "d"}}]}, False),
        ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, False),
        ({"tools": [{**tool(), "extra": 1}]}, False),
        ({"tools": {"type": "function"}}, False),
        # tool_choice and parallel_tool_calls need tools, but tool_choice "none".
        ({"tool_choice": "none"}, True),
        ({"tool_choice": "auto"}, False),
        ({"tool_choice": "required", "tools": []}, False),
        ({"tool_choice": "any", "tools": [tool()]}, False),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "tools": [tool()]}, True),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, False),
        ({"tool_choice": {"type": "function", "function": {"name": "a b"}}, "tools": [tool()]},
         False),
        ({"tool_choice": {"type": "function"}, "tools": [tool()]}, False),
        ({"tool_choice": {"type": "allowed_tools", "function": {"name": "get_weather"}},
          "tools": [tool()]}, False),
        ({"parallel_tool_calls": False, "tools": [tool()]}, True),
        ({"parallel_tool_calls": True}, False),
        ({"parallel_tool_calls": True, "tools": []}, False),
        ({"parallel_tool_calls": "yes", "tools": [tool()]}, False),
        # Output formats.
        ({"response_format": {"type": "text"}}, True),
        ({"response_format": {"type": "json_object"}}, True),
        ({"response_format": {"type": "json_schema", "json_schema": JSON_SCHEMA}}, True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "out"}}}, True),
        ({"response_format": {"type": "json_schema"}}, False),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, False),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {**JSON_SCHEMA, "name": "a b"}}}, False),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {**JSON_SCHEMA, "schema": []}}}, False),
        ({"response_format": {"type": "json_object", "json_schema": JSON_SCHEMA}}, False),
        ({"response_format": {"type": "xml"}}, False),
        ({"response_format": "json_object"}, False),
        # Logprobs: top_logprobs only with logprobs true.
        ({"logprobs": True}, True),
        ({"logprobs": False}, True),
        ({"logprobs": True, "top_logprobs": 5}, True),
        ({"top_logprobs": 5}, False),
        ({"logprobs": False, "top_logprobs": 0}, False),
        ({"logprobs": 1}, False),
        # The rest.
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": 1}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}}, True),
        ({"chat_template_kwargs": "enable_thinking"}, False),
        ({"stop": []}, True),
        ({"stop": [""]}, False),
        ({"stop": ["a", 1]}, False),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, True),
        ({"audio": "alloy"}, False),
    ],
)  # fmt: skip
def test_schema_and_parser_agree(allowed: Check, fields: dict[str, Any], ok: bool) -> None:
    body = base(**fields)
    assert accepted(body) is ok
    assert allowed(body) is ok


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [tool(), tool()]},
        {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "other"}}},
        {"chat_template_kwargs": {"x": "y" * MAX_TEMPLATE_KWARGS_BYTES}},
    ],
)
def test_what_only_the_descriptions_say(
    schema: dict[str, Any], allowed: Check, fields: dict[str, Any]
) -> None:
    # Rules a JSON Schema cannot state (distinct names, a name among the tools, a size as
    # JSON): the schema allows these bodies, its descriptions say why the parser refuses them.
    assert allowed(base(**fields))
    assert not accepted(base(**fields))
    props = schema["properties"]
    assert "names must differ" in props["tools"]["description"]
    assert "must be one of them" in props["tool_choice"]["description"]
    assert (
        f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes" in props["chat_template_kwargs"]["description"]
    )


# --- the answers ----------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4, reasoning_tokens=2)
LOGPROB = TokenLogprob("x", -0.5, (120,), (TopLogprob("x", -0.5, (120,)),))
CALLS = (
    ToolCallDelta(0, "", id="call_a", name="get_weather"),
    ToolCallDelta(0, '{"city": "Paris"}'),
    ToolCallDelta(1, "{}", id="call_b", name="time"),
)


@pytest.fixture(scope="module")
def completion_ok(operation: dict[str, Any]) -> Check:
    content = operation["responses"]["200"]["content"]
    return jsonschema_rs.Draft202012Validator(content["application/json"]["schema"]).is_valid


@pytest.fixture(scope="module")
def event_ok(operation: dict[str, Any]) -> Check:
    content = operation["responses"]["200"]["content"]
    return jsonschema_rs.Draft202012Validator(content["text/event-stream"]["x-itemSchema"]).is_valid


@pytest.mark.parametrize(
    "fields",
    [
        {"content": "Hello", "reasoning": "", "finish_reason": "length"},
        {"content": "", "reasoning": "hmm", "finish_reason": "cancelled"},
        {"content": "", "reasoning": "", "finish_reason": "tool_calls", "tool_calls": CALLS},
        {"content": "Let me look.", "reasoning": "", "finish_reason": "tool_calls",
         "tool_calls": CALLS, "fingerprint": "fp_0123456789"},
        {"content": "x", "reasoning": "", "finish_reason": "stop", "logprobs": (LOGPROB,)},
        {"content": "x", "reasoning": "", "finish_reason": "stop", "logprobs": ()},
    ],
)  # fmt: skip
def test_completions_fit_the_schema(completion_ok: Check, fields: dict[str, Any]) -> None:
    body = completion(id="chatcmpl-1", created=1, model="m", usage=USAGE, **fields)
    assert completion_ok(body)


def test_the_completion_schema_is_closed(completion_ok: Check) -> None:
    body = completion(
        id="c", created=1, model="m", content="x", reasoning="", finish_reason="stop", usage=USAGE
    )
    assert completion_ok(body)
    assert not completion_ok({**body, "extra": 1})
    assert not completion_ok({**body, "system_fingerprint": "fp_x"})
    cancelled = {**body["choices"][0], "finish_reason": "cancelled"}
    assert not completion_ok({**body, "choices": [cancelled]})
    for key in ("prompt_tokens_details", "completion_tokens_details"):
        assert not completion_ok({**body, "usage": {**body["usage"], key: {}}})


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_stream_events_fit_the_schema(
    event_ok: Check, include_usage: bool, continuous: bool, logprobs: bool
) -> None:
    stream = CompletionStream(
        ChunkWriter(
            id="chatcmpl-1",
            created=1,
            model="m",
            include_usage=include_usage,
            continuous_usage_stats=continuous and include_usage,
            logprobs=logprobs,
            fingerprint="fp_0123456789",
        ),
        SSE,
    )
    out: list[bytes] = []
    for item in (
        Chunk("r", 0, "Hel", "hmm", 1, USAGE, logprobs=(LOGPROB,)),
        Chunk("r", 1, "", "", 1, USAGE),
        Chunk("r", 2, "", "", 2, USAGE, tool_calls=CALLS),
        Chunk("r", 3, "", "", 0, USAGE, "tool_calls"),
    ):
        stream.feed(item, out)
    failed = CompletionStream(ChunkWriter(id="chatcmpl-2", created=1, model="m"), SSE)
    failed.feed(Chunk("r", 0, "a", "", 1, USAGE), out)
    failed.fail(server_error("boom"), out)
    events = b"".join(out).split(b"\n\n")
    assert events[-1] == b""
    data = [event.removeprefix(b"data: ") for event in events[:-1] if event != b"data: [DONE]"]
    # role, text, tool calls, finish (usage; with continuous usage, the empty chunk too, for
    # its usage); role, text, error.
    assert len(data) == 7 + int(include_usage) + int(include_usage and continuous)
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
