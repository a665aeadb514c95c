"""The OpenAPI description of the Anthropic Messages endpoints agrees with the code: a body the
request schema allows is one the parser takes (and the bounds are the parser's), every
answer the protocol builds fits the 200 schemas, and a running gateway's real answers and
errors, for every documented status, fit the schemas documented for their status.

Schemas are checked with jsonschema_rs, the validator schemathesis holds responses against.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from protocol.anthropic.request import (
    MAX_BLOCKS,
    MAX_TOOLS,
    parse_count_request,
    parse_messages_request,
)
from protocol.anthropic.stream import ANTHROPIC_SSE, MessageWriter, message_body
from protocol.core.errors import server_error
from protocol.core.limits import MAX_MESSAGES
from protocol.core.stream import CollectedChoice, CompletionStream
from protocol.frames import Chunk
from tests.gateway.openapi_checks import (
    AUTH,
    CALLS,
    KEY,
    LIMIT,
    USAGE,
    accepted,
    check_busy_errors,
    check_error_schemas,
    check_gateway_errors,
    check_real_answers,
    check_request_errors,
    error_checker,
    item_check,
    request_check,
    sse_data,
)
from tests.gateway.openapi_spec import gateway_spec, limited_gateway, op, response_check, validator
from tests.support import UNIT, FakeRunner, Gateway, on_the_wire

DESCRIBED = {
    ("post", "/v1/messages"): "200 400 401 403 404 413 429 500 502 503 504",
    ("post", "/v1/messages/count_tokens"): "200 400 401 403 404 413 429 500 502 503 504",
}


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return gateway_spec()


def test_the_dialect_routes_are_described(spec: dict[str, Any]) -> None:
    for (method, path), statuses in DESCRIBED.items():
        assert sorted(op(spec, path, method)["responses"]) == statuses.split(), path


def test_error_schemas_are_the_dialects(spec: dict[str, Any]) -> None:
    check_error_schemas(spec, DESCRIBED)


# --- the requests ---------------------------------------------------------------------------


def message(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def messages_accepted(body: dict[str, Any]) -> bool:
    """True when the parser and the gateway's max_tokens ceiling take the body (else a 400)."""
    return accepted(lambda: parse_messages_request(orjson.dumps(body)).max_tokens <= LIMIT)


def count_accepted(body: dict[str, Any]) -> bool:
    return accepted(lambda: parse_count_request(orjson.dumps(body)) is not None)


TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
CACHE = {"type": "ephemeral", "ttl": "1h"}


def turns(*contents: Any) -> list[dict[str, Any]]:
    """User and assistant turns, alternating from the user's; the last must be the user's."""
    roles = itertools.cycle(("user", "assistant"))
    return [
        {"role": role, "content": content} for role, content in zip(roles, contents, strict=False)
    ]


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        # The required fields and their types.
        ({"model": 1}, False),
        ({"max_tokens": None}, False),
        ({"max_tokens": 0}, True),
        ({"max_tokens": 1.5}, False),
        ({"messages": []}, False),
        ({"messages": "hi"}, False),
        ({"stream": True}, True),
        ({"stream": "yes"}, False),
        ({"n": 1}, False),
        # Messages and their blocks.
        ({"messages": turns([{"type": "text", "text": "hi", "cache_control": CACHE}])}, True),
        ({"messages": turns([{"type": "text", "text": "hi", "citations": None}])}, True),
        ({"messages": turns([{"type": "text", "text": "hi", "citations": []}])}, False),
        ({"messages": turns([{"type": "text", "text": 1}])}, False),
        ({"messages": turns([{"type": "text"}])}, False),
        ({"messages": turns([{"type": "text", "text": "hi", "x": 1}])}, False),
        ({"messages": turns([{"type": "text", "text": "hi",
                              "cache_control": {"type": "persistent"}}])}, False),
        ({"messages": turns([{"type": "text", "text": "hi",
                              "cache_control": {"type": "ephemeral", "ttl": "1d"}}])}, False),
        ({"messages": turns([{"type": "image", "source": {}}])}, False),
        ({"messages": turns([])}, True),
        ({"messages": turns("hi", [USE], [RESULT, {"type": "text", "text": "go on"}])}, True),
        ({"messages": turns("hi", [USE], [{**RESULT, "content": [{"type": "text",
                                                                 "text": "sunny"}]}])}, True),
        ({"messages": turns("hi", [USE], [{**RESULT, "is_error": True}])}, True),
        ({"messages": turns("hi", [USE], [{**RESULT, "is_error": "yes"}])}, False),
        ({"messages": turns("hi", [USE], [{**RESULT, "content": 1}])}, False),
        ({"messages": turns("hi", [USE], [{"type": "tool_result", "content": "x"}])}, False),
        ({"messages": turns([USE])}, False),  # a user's tool_use
        ({"messages": turns("hi", [RESULT], "ok")}, False),  # an assistant's tool_result
        ({"messages": turns("hi", [{**USE, "input": "{}"}], "ok")}, False),
        ({"messages": turns("hi", [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                   {"type": "redacted_thinking", "data": "d"},
                                   {"type": "text", "text": "Hello"}], "ok")}, True),
        ({"messages": turns("hi", [{"type": "thinking", "x": 1}], "ok")}, False),
        ({"messages": [{"role": "system", "content": "x"}]}, False),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, False),
        ({"messages": [{"role": "user"}]}, False),
        # The system prompt.
        ({"system": "Be brief."}, True),
        ({"system": [{"type": "text", "text": "Be brief.", "cache_control": CACHE}]}, True),
        ({"system": [{"type": "tool_result", "tool_use_id": "t"}]}, False),
        ({"system": 1}, False),
        # Tools and tool_choice.
        ({"tools": []}, True),
        ({"tools": [TOOL]}, True),
        ({"tools": [{**TOOL, "type": "custom", "description": "d", "strict": True,
                     "cache_control": CACHE}]}, True),
        ({"tools": [{**TOOL, "type": "web_search_20250305"}]}, False),
        ({"tools": [{**TOOL, "name": "a b"}]}, False),
        ({"tools": [{**TOOL, "name": "f" * 129}]}, False),
        ({"tools": [{**TOOL, "input_schema": {"type": "array"}}]}, False),
        ({"tools": [{**TOOL, "input_schema": {}}]}, False),
        ({"tools": [{"name": "f"}]}, False),
        ({"tools": [{**TOOL, "x": 1}]}, False),
        ({"tool_choice": {"type": "auto"}}, True),
        ({"tool_choice": {"type": "none"}}, True),
        ({"tool_choice": {"type": "any"}}, False),
        ({"tool_choice": {"type": "any"}, "tools": [TOOL]}, True),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}, "tools": [TOOL]}, True),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}}, False),
        ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, False),
        ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, True),
        ({"tool_choice": {"type": "none", "disable_parallel_tool_use": True}}, False),
        ({"tool_choice": {"type": "auto", "name": "get_weather"}}, False),
        ({"tool_choice": {"type": "required"}, "tools": [TOOL]}, False),
        ({"tool_choice": "auto"}, False),
        # Thinking.
        ({"thinking": {"type": "disabled"}}, True),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}, True),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "summarized"},
          "max_tokens": 2048}, True),
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}, "max_tokens": 2048}, False),
        ({"thinking": {"type": "enabled"}, "max_tokens": 2048}, False),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
          "max_tokens": 2048}, False),
        ({"thinking": {"type": "disabled", "budget_tokens": 1024}}, False),
        ({"thinking": {"type": "adaptive"}}, False),
        # Sampling, stop sequences, metadata.
        ({"temperature": 0, "top_p": 1, "top_k": 0}, True),
        ({"temperature": 1.5}, False),
        ({"top_p": -0.1}, False),
        ({"top_k": -1}, False),
        ({"stop_sequences": ["\n\n", "END"]}, True),
        ({"stop_sequences": "END"}, False),
        ({"stop_sequences": ["END", 1]}, False),
        ({"stop_sequences": ["END", ""]}, False),
        ({"stop_sequences": ["x" * 256]}, True),
        ({"stop_sequences": ["x" * 257]}, False),
        ({"stop_sequences": ["a"] * 16}, True),
        ({"stop_sequences": ["a"] * 17}, False),
        ({"metadata": {"user_id": "u"}}, True),
        ({"metadata": {"user_id": 1}}, False),
        ({"metadata": {"session": "s"}}, False),
    ],
)  # fmt: skip
def test_messages_schema_and_parser_agree(
    spec: dict[str, Any], fields: dict[str, Any], ok: bool
) -> None:
    body = {k: v for k, v in message(**fields).items() if v is not None}
    assert messages_accepted(body) is ok
    assert request_check(spec, "/v1/messages")(body) is ok


def test_messages_bounds(spec: dict[str, Any]) -> None:
    allowed = request_check(spec, "/v1/messages")
    props = op(spec, "/v1/messages")["requestBody"]["content"]["application/json"]["schema"][
        "properties"
    ]

    def both(body: dict[str, Any]) -> bool:
        verdict = messages_accepted(body)
        assert allowed(body) is verdict, body
        return verdict

    assert props["max_tokens"]["maximum"] == LIMIT
    assert both(message(max_tokens=LIMIT))
    assert not both(message(max_tokens=LIMIT + 1))
    assert not both(message(max_tokens=-1))
    assert both(message(model="m" * props["model"]["maxLength"]))
    assert not both(message(model="m" * (props["model"]["maxLength"] + 1)))
    assert props["messages"]["maxItems"] == MAX_MESSAGES
    assert both(message(messages=turns(*["x"] * (MAX_MESSAGES - 1))))
    assert not both(message(messages=turns(*["x"] * (MAX_MESSAGES + 1))))
    text = {"type": "text", "text": "x"}
    assert both(message(messages=turns([text] * MAX_BLOCKS)))
    assert not both(message(messages=turns([text] * (MAX_BLOCKS + 1))))
    assert both(message(system=[text] * MAX_BLOCKS))
    assert not both(message(system=[text] * (MAX_BLOCKS + 1)))
    tools = [{**TOOL, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]
    assert both(message(tools=tools[:-1]))
    assert not both(message(tools=tools))
    assert both(message(tools=[{**TOOL, "name": "f" * 128}]))


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": turns("hi", "Hello")},  # a prefill
        {"tools": [TOOL, TOOL]},
        {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024},
    ],
)
def test_what_only_the_messages_descriptions_say(
    spec: dict[str, Any], fields: dict[str, Any]
) -> None:
    schema = op(spec, "/v1/messages")["requestBody"]["content"]["application/json"]["schema"]
    assert request_check(spec, "/v1/messages")(message(**fields))
    assert not messages_accepted(message(**fields))
    props = schema["properties"]
    assert "prefill" in props["messages"]["description"]
    assert "names must differ" in props["tools"]["description"]
    assert "must be one of them" in props["tool_choice"]["description"]
    assert (
        "Less than max_tokens"
        in (props["thinking"]["oneOf"][0]["properties"]["budget_tokens"]["description"])
    )


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        ({}, True),
        ({"system": "s", "tools": [TOOL], "tool_choice": {"type": "any"}}, True),
        ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, True),
        ({"max_tokens": 16}, False),
        ({"stream": True}, False),
        ({"temperature": 0.5}, False),
        ({"messages": []}, False),
        ({"tool_choice": {"type": "any"}}, False),
    ],
)
def test_count_tokens_schema_and_parser_agree(
    spec: dict[str, Any], fields: dict[str, Any], ok: bool
) -> None:
    body = {"model": "m", "messages": turns("hi"), **fields}
    assert count_accepted(body) is ok
    assert request_check(spec, "/v1/messages/count_tokens")(body) is ok


# --- the answers the protocol builds ---------------------------------------------------------


def collected(text: str, reasoning: str, finish: Any, **fields: Any) -> CollectedChoice:
    choice = CollectedChoice()
    choice.content.append(text)
    choice.reasoning.append(reasoning)
    choice.finish = finish
    for name, value in fields.items():
        setattr(choice, name, value)
    return choice


@pytest.mark.parametrize(
    "choice",
    [
        collected("Hello", "", "stop"),
        collected("Hello", "hmm", "length"),
        collected("END", "", "stop", matched_stop="END"),
        collected("", "", "tool_calls", tool_calls=list(CALLS)),
        collected("", "", "stop"),
    ],
)
def test_messages_fit_the_schema(spec: dict[str, Any], choice: CollectedChoice) -> None:
    body = on_the_wire(message_body(choice, USAGE, id="msg_1", model="m"))
    ok = response_check(spec, "/v1/messages", 200)
    assert ok(body)
    assert not ok({**body, "extra": 1})
    assert not ok({**body, "stop_reason": None})


def test_message_events_fit_the_schema(spec: dict[str, Any]) -> None:
    out: list[bytes] = []
    stream = CompletionStream(MessageWriter("msg_1", "m"), ANTHROPIC_SSE)
    stream.feed(Chunk("r", 0, "", "hmm", 1, USAGE), out)
    stream.feed(Chunk("r", 1, "Let me look.", "", 1, USAGE), out)
    stream.feed(Chunk("r", 2, "", "", 3, USAGE, tool_calls=CALLS), out)
    stream.feed(Chunk("r", 3, "", "", 0, USAGE, "tool_calls"), out)
    stopped = CompletionStream(MessageWriter("msg_2", "m"), ANTHROPIC_SSE)
    stopped.feed(Chunk("r", 0, "x END", "", 2, USAGE, "stop", matched_stop="END"), out)
    failed = CompletionStream(MessageWriter("msg_3", "m"), ANTHROPIC_SSE)
    failed.feed(Chunk("r", 0, "a", "", 1, USAGE), out)
    failed.fail(server_error("boom"), out)
    cancelled = CompletionStream(MessageWriter("msg_4", "m"), ANTHROPIC_SSE)
    cancelled.feed(Chunk("r", 0, "a", "", 1, USAGE, "cancelled"), out)
    events = sse_data(out)
    kinds = {event["type"] for event in events}
    assert kinds == {
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "error",
    }
    ok = item_check(spec, "/v1/messages", "text/event-stream")
    for event in events:
        assert ok(event), event
        assert not ok({**event, "extra": 1})
    # Each event as schemathesis reads an OpenAPI 3.1 event stream: the media type's schema
    # is one event's (`event` and `data`), the data's JSON its contentSchema.
    media = op(spec, "/v1/messages")["responses"]["200"]["content"]["text/event-stream"]
    event_ok = validator(media["schema"])
    assert set(media["schema"]["properties"]["event"]["enum"]) == kinds
    assert media["schema"]["properties"]["data"]["contentSchema"] == media["x-itemSchema"]
    for event in events:
        assert event_ok({"event": event["type"], "data": orjson.dumps(event).decode()})
    assert not event_ok({"event": "done", "data": "[DONE]"})


# --- a running gateway's answers and errors --------------------------------------------------


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = limited_gateway(KEY)
    yield gw
    gw.stop()


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT, headers=AUTH) as c:
        yield c


REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/messages": message(model="fake-model"),
    "/v1/messages/count_tokens": {"model": "fake-model", "messages": turns("hi")},
}


async def test_real_answers_fit_the_schema(
    spec: dict[str, Any], runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    await check_real_answers(spec, runner, http, REQUESTS)


async def test_real_errors_fit_the_schema(
    spec: dict[str, Any], gateway: Gateway, runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    seen: set[tuple[str, int]] = set()
    check = error_checker(spec, seen)
    await check_request_errors(check, gateway, http, REQUESTS)
    await check_busy_errors(check, gateway, http, "/v1/messages", REQUESTS["/v1/messages"])
    statuses = {status for _, status in seen}
    assert statuses == {400, 401, 403, 404, 413, 429, 500, 503}, seen


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_every_gateway_error_fits_the_schema(spec: dict[str, Any], path: str) -> None:
    """The errors a running gateway cannot be made to answer here (a lost runner, a stream
    timeout, a stopping gateway), written as the gateway writes them for the path."""
    check_gateway_errors(spec, path)
