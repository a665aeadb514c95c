"""The OpenAPI descriptions of the Anthropic Messages and Ollama endpoints agree with the code:
a body the request schema allows is one the parser takes (and the bounds are the parser's),
every answer the protocol builds fits the 200 schemas, and a running gateway's real answers
and errors, for every documented status, fit the schemas documented for their status.

Schemas are checked with jsonschema_rs, the validator schemathesis holds responses against.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.api import unrouted
from gateway.app import APIS
from gateway.config import GatewayConfig
from gateway.errors import (
    ModelNotFound,
    ModelUnavailable,
    QueueFull,
    RunnerLost,
    ShuttingDown,
    StreamTimeout,
)
from gateway.http_errors import ErrorShape, api_error_for
from protocol.anthropic.request import (
    MAX_BLOCKS,
    MAX_TOOLS,
    parse_count_request,
    parse_messages_request,
)
from protocol.anthropic.stream import ANTHROPIC_SSE, MessageWriter, message_body
from protocol.core.errors import ApiError, server_error
from protocol.core.limits import MAX_MESSAGES, MAX_STOP
from protocol.core.stream import CollectedChoice, CompletionStream
from protocol.frames import Chunk, Error, Generate, ModelInfo, ToolCallDelta, Usage
from protocol.ollama.models import ServedModel, ps_body, show_body, tags_body, version_body
from protocol.ollama.request import parse_chat, parse_generate
from protocol.ollama.stream import (
    NDJSON,
    OllamaWriter,
    TimedBuilder,
    Timings,
    answer_body,
    load_body,
)
from protocol.openai.errors import error_body
from tests.gateway.openapi_spec import (
    Check,
    gateway_spec,
    limited_gateway,
    op,
    response_check,
    validator,
)
from tests.gateway.waits import until_gone, until_queued
from tests.support import UNIT, FakeRunner, Gateway, on_the_wire

LIMIT = GatewayConfig().max_tokens_limit

DESCRIBED = {
    ("post", "/v1/messages"): "200 400 401 403 404 413 429 500 502 503 504",
    ("post", "/v1/messages/count_tokens"): "200 400 401 403 404 413 429 500 502 503 504",
    ("post", "/api/chat"): "200 400 401 403 404 413 429 500 502 503 504",
    ("post", "/api/generate"): "200 400 401 403 404 413 429 500 502 503 504",
    ("post", "/api/show"): "200 400 401 403 404 413 503",
    ("get", "/api/tags"): "200 401 403",
    ("get", "/api/ps"): "200 401 403",
    ("get", "/api/version"): "200 401 403",
}


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return gateway_spec()


def error_shape(path: str) -> ErrorShape:
    """The shape the errors of `path` come in: its API's (gateway.api)."""
    return unrouted(path, APIS, error_body)


def request_check(spec: dict[str, Any], path: str) -> Check:
    return validator(op(spec, path)["requestBody"]["content"]["application/json"]["schema"])


def item_check(spec: dict[str, Any], path: str, media: str) -> Check:
    return validator(op(spec, path)["responses"]["200"]["content"][media]["x-itemSchema"])


def test_the_dialect_routes_are_described(spec: dict[str, Any]) -> None:
    for (method, path), statuses in DESCRIBED.items():
        assert sorted(op(spec, path, method)["responses"]) == statuses.split(), path
    # The model-management calls only ever answer 501: nothing to describe.
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete"):
        assert path not in spec["paths"]
    assert not [path for path in spec["paths"] if path.startswith("/api/blobs")]


def test_error_schemas_are_the_dialects(spec: dict[str, Any]) -> None:
    for (method, path), statuses in DESCRIBED.items():
        for status in statuses.split()[1:]:
            shape = error_shape(path)
            err = ApiError(int(status), "why", "invalid_request_error", None, None)
            ok = response_check(spec, path, int(status), method)
            assert ok(shape(err)), (path, status)
            assert not ok(error_body(err)), (path, status)  # OpenAI's shape is not the dialect's
            assert not ok({**shape(err), "extra": 1})


# --- Anthropic's requests -------------------------------------------------------------------


def _accepted(parse: Callable[[], bool]) -> bool:
    """`parse`'s verdict (False past the gateway's ceilings); a refusal must be a 400."""
    status = 200
    try:
        ok = parse()
    except ApiError as err:
        status, ok = err.status, False
    assert status in (200, 400)
    return ok


def message(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def messages_accepted(body: dict[str, Any]) -> bool:
    """True when the parser and the gateway's max_tokens ceiling take the body (else a 400)."""
    return _accepted(lambda: parse_messages_request(orjson.dumps(body)).max_tokens <= LIMIT)


def count_accepted(body: dict[str, Any]) -> bool:
    return _accepted(lambda: parse_count_request(orjson.dumps(body)) is not None)


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


# --- Ollama's requests ----------------------------------------------------------------------


def ollama_accepted(parse: Any, body: dict[str, Any]) -> bool:
    def parsed_within_limit() -> bool:
        tokens: int | None = parse(orjson.dumps(body)).max_tokens
        return tokens is None or tokens <= LIMIT

    return _accepted(parsed_within_limit)


CALL = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
FUNCTION = {"type": "function", "function": {"name": "get_weather"}}
COMMON: list[tuple[dict[str, Any], bool]] = [
    ({}, True),
    ({"model": 1}, False),
    ({"stream": False}, True),
    ({"stream": 0}, False),
    ({"format": "json"}, True),
    ({"format": ""}, True),
    ({"format": {"type": "object"}}, True),
    ({"format": "xml"}, False),
    ({"format": ["json"]}, False),
    ({"keep_alive": "5m"}, True),
    ({"keep_alive": 300}, True),
    ({"keep_alive": 1.5}, True),
    ({"keep_alive": True}, False),
    ({"think": True}, True),
    ({"think": False}, True),
    ({"think": "high"}, True),
    ({"think": "max"}, False),
    ({"think": 1}, False),
    ({"logprobs": False}, True),
    ({"logprobs": True}, False),
    ({"top_logprobs": 0}, True),
    ({"top_logprobs": 3}, False),
    ({"options": {}}, True),
    ({"options": {"temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0.5, "seed": -1,
                  "presence_penalty": -2, "frequency_penalty": 2, "stop": ["\n"]}}, True),
    ({"options": {"num_predict": -2}}, True),
    ({"options": {"num_predict": -1}}, True),
    ({"options": {"num_predict": 0}}, False),
    ({"options": {"num_predict": -3}}, False),
    ({"options": {"num_predict": LIMIT}}, True),
    ({"options": {"num_predict": LIMIT + 1}}, False),
    ({"options": {"temperature": 3}}, False),
    ({"options": {"top_k": -1}}, False),
    ({"options": {"stop": [""]}}, False),
    ({"options": {"stop": ["s"] * MAX_STOP}}, True),
    ({"options": {"stop": ["s"] * (MAX_STOP + 1)}}, False),
    ({"options": {"num_ctx": 4096}}, False),
    ({"options": "fast"}, False),
    ({"unknown": 1}, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        *COMMON,
        ({"messages": []}, True),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
         True),
        ({"messages": [{"role": "user"}]}, True),
        ({"messages": [{"role": "user", "content": "hi", "images": []}]}, True),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, False),
        ({"messages": [{"role": "user", "content": 1}]}, False),
        ({"messages": [{"role": "user", "content": "hi", "thinking": "hm"}]}, False),
        ({"messages": [{"role": "developer", "content": "hi"}]}, False),
        ({"messages": [{"content": "hi"}]}, False),
        ({"messages": [{"role": "assistant", "content": "", "thinking": "hm",
                        "tool_calls": [CALL, {"id": "c", "type": "function",
                                              "function": {"index": 1, "name": "f"}}]},
                       {"role": "tool", "content": "sunny", "tool_name": "get_weather",
                        "tool_call_id": "c"}]}, True),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                          "arguments": "{}"}}]}]},
         False),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "custom", **CALL}]}]},
         False),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, False),
        ({"messages": [{"role": "tool", "content": "x", "tool_calls": []}]}, False),
        ({"messages": "hi"}, False),
        ({"tools": [FUNCTION]}, True),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, False),
        ({"prompt": "hi"}, False),
    ],
)  # fmt: skip
def test_chat_schema_and_parser_agree(
    spec: dict[str, Any], fields: dict[str, Any], ok: bool
) -> None:
    body = {"model": "m", **fields}
    assert ollama_accepted(parse_chat, body) is ok
    assert request_check(spec, "/api/chat")(body) is ok


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        *COMMON,
        ({"prompt": "Once"}, True),
        ({"prompt": ""}, True),
        ({"prompt": 1}, False),
        ({"prompt": "Once", "system": "s"}, True),
        ({"prompt": "Once", "raw": True}, True),
        ({"prompt": "Once", "raw": True, "system": ""}, True),
        ({"prompt": "Once", "raw": True, "system": "s"}, False),
        ({"prompt": "Once", "raw": False, "system": "s"}, True),
        ({"raw": "yes"}, False),
        ({"suffix": ""}, True),
        ({"suffix": "end"}, False),
        ({"template": "{{ .Prompt }}"}, False),
        ({"context": []}, True),
        ({"context": [1, 2]}, False),
        ({"images": []}, True),
        ({"images": ["aGk="]}, False),
        ({"width": 0, "height": 0, "steps": 0}, True),
        ({"width": 512}, False),
        ({"messages": []}, False),
        ({"tools": [FUNCTION]}, False),
    ],
)  # fmt: skip
def test_generate_schema_and_parser_agree(
    spec: dict[str, Any], fields: dict[str, Any], ok: bool
) -> None:
    body = {"model": "m", **fields}
    assert ollama_accepted(parse_generate, body) is ok
    assert request_check(spec, "/api/generate")(body) is ok


def test_what_only_the_ollama_descriptions_say(spec: dict[str, Any]) -> None:
    body = {"model": "m", "tools": [FUNCTION, FUNCTION]}
    assert request_check(spec, "/api/chat")(body)
    assert not ollama_accepted(parse_chat, body)
    props = op(spec, "/api/chat")["requestBody"]["content"]["application/json"]["schema"][
        "properties"
    ]
    assert "names must differ" in props["tools"]["description"]
    assert "characters of content in all" in props["messages"]["description"]


# --- the answers the protocol builds ---------------------------------------------------------

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4)
CALLS = (
    ToolCallDelta(0, "", id="call_a", name="get_weather"),
    ToolCallDelta(0, '{"city": "Paris"}'),
    ToolCallDelta(1, "{}", id="call_b", name="time"),
)


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


def sse_data(out: list[bytes]) -> list[Any]:
    events = []
    for block in b"".join(out).split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        events.append(event)
    return events


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


def clocks() -> tuple[Callable[[], int], Callable[[], int]]:
    wall = itertools.count(1_764_547_200_000_000_001)
    mono = itertools.count(10_000_000, 1_000_000)
    return (lambda: next(wall)), (lambda: next(mono))


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_ollama_lines_and_answers_fit_the_schema(spec: dict[str, Any], endpoint: Any) -> None:
    path = f"/api/{endpoint}"
    line_ok = item_check(spec, path, "application/x-ndjson")
    answer_ok = response_check(spec, path, 200)
    wall, mono = clocks()
    out: list[bytes] = []
    for items in (
        [
            Chunk("r", 0, "Hel", "hm", 1, USAGE),
            Chunk("r", 1, "lo", "", 1, USAGE, tool_calls=CALLS),
            Chunk("r", 2, "", "", 0, USAGE, "tool_calls"),
        ],
        [
            Chunk("r", 0, "", "", 1, USAGE, tool_calls=(ToolCallDelta(0, '{"cut', "c", "f"),)),
            Chunk("r", 1, "", "", 0, USAGE, "length"),
        ],
    ):
        stream = CompletionStream(
            OllamaWriter(endpoint, "m", Timings(0, 1), wall=wall, mono=mono), NDJSON
        )
        for item in items:
            stream.feed(item, out)
        builder = TimedBuilder(Timings(0, 1), mono)
        for item in items:
            builder.feed(item)
        body = on_the_wire(answer_body(builder, endpoint, "m", wall=wall, mono=mono))
        assert answer_ok(body), body
        assert not answer_ok({**body, "extra": 1})
    failed = CompletionStream(
        OllamaWriter(endpoint, "m", Timings(0, 1), wall=wall, mono=mono), NDJSON
    )
    failed.feed(Chunk("r", 0, "a", "", 1, USAGE), out)
    failed.fail(server_error("boom"), out)
    lines = [orjson.loads(line) for line in b"".join(out).split(b"\n")[:-1]]
    lines.append(load_body(endpoint, "m", wall()))
    assert any("error" in line for line in lines)
    assert any(line.get("done_reason") == "length" for line in lines)
    for line in lines:
        assert line_ok(line), line
        assert not line_ok({**line, "extra": 1})
    assert answer_ok(load_body(endpoint, "m", wall()))


def test_model_bodies_fit_the_schema(spec: dict[str, Any]) -> None:
    models = [
        ServedModel(ModelInfo("b", 4096, "mlx-lm 0.32.2"), 1_764_547_200_000_000_000),
        ServedModel(ModelInfo("a", 8192), 1_764_547_200_123_000_000),
    ]
    assert response_check(spec, "/api/tags", 200, "get")(tags_body(models))
    assert response_check(spec, "/api/ps", 200, "get")(ps_body(models))
    assert response_check(spec, "/api/version", 200, "get")(version_body())
    for model in models:
        assert response_check(spec, "/api/show", 200)(show_body(model))
    assert response_check(spec, "/api/tags", 200, "get")(tags_body([]))


# --- a running gateway's answers and errors --------------------------------------------------

KEY = "openapi-key-51c2"
AUTH = {"Authorization": f"Bearer {KEY}"}


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
    "/api/chat": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
    "/api/generate": {"model": "fake-model", "prompt": "Once"},
    "/api/show": {"model": "fake-model"},
}


async def answer(runner: FakeRunner, *texts: str) -> None:
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    for seq, text in enumerate(texts):
        await runner.send(FakeRunner.chunk(gen.request_id, seq, text, done=seq == len(texts) - 1))


async def test_real_answers_fit_the_schema(
    spec: dict[str, Any], runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    for path, body in REQUESTS.items():
        streams = (
            (False, True) if path in ("/v1/messages", "/api/chat", "/api/generate") else (None,)
        )
        for stream in streams:
            request = body if stream is None else {**body, "stream": stream}
            served = None
            if path != "/api/show":
                served = asyncio.create_task(answer(runner, "Hel", "lo"))
            response = await http.post(path, json=request)
            if served is not None:
                await served
            assert response.status_code == 200, response.text
            media = response.headers["content-type"].split(";")[0]
            if media == "application/json":
                assert response_check(spec, path, 200)(response.json()), response.text
            elif media == "text/event-stream":
                ok = item_check(spec, path, media)
                events = sse_data([response.content])
                assert events, response.text
                assert all(ok(event) for event in events), response.text
            else:
                assert media == "application/x-ndjson"
                ok = item_check(spec, path, media)
                lines = response.content.split(b"\n")[:-1]
                assert lines, response.text
                assert all(ok(orjson.loads(line)) for line in lines), response.text
    for path in ("/api/tags", "/api/ps", "/api/version"):
        response = await http.get(path)
        assert response.status_code == 200
        assert response_check(spec, path, 200, "get")(response.json()), response.text
    load = await http.post("/api/chat", json={"model": "fake-model"})  # nothing to generate
    assert load.headers["content-type"].startswith("application/x-ndjson")
    assert item_check(spec, "/api/chat", "application/x-ndjson")(orjson.loads(load.content))


async def test_real_errors_fit_the_schema(
    spec: dict[str, Any], gateway: Gateway, runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    seen: set[tuple[str, int]] = set()

    def check(path: str, response: httpx.Response, method: str = "post") -> None:
        status = response.status_code
        assert str(status) in op(spec, path, method)["responses"], (path, status)
        assert response_check(spec, path, status, method)(response.json()), response.text
        seen.add((path, status))

    leaving = await FakeRunner.connect(gateway, models=("leaving",), name="leaving")
    await leaving.close()
    await until_gone(http, "leaving")
    for path, body in REQUESTS.items():
        check(path, await http.post(path, content=b"{"))
        check(path, await http.post(path, json={**body, "unknown": 1}))
        check(path, await http.post(path, json=body, headers={"Authorization": "Bearer no"}))
        check(path, await http.post(path, json=body, headers={"Origin": "http://evil.example"}))
        check(path, await http.post(path, json={**body, "model": "nobody"}))
        check(path, await http.post(path, json={**body, "model": "leaving"}))
        check(path, await http.post(path, content=b" " * 70_000))
    for path in ("/api/tags", "/api/ps", "/api/version"):
        check(path, await http.get(path, headers={"Authorization": "Bearer no"}), "get")
        check(path, await http.get(path, headers={"Origin": "http://evil.example"}), "get")
    busy = await FakeRunner.connect(gateway, models=("busy",), max_concurrent=1, name="busy")
    try:
        for path in ("/v1/messages", "/api/chat"):
            request = {**REQUESTS[path], "model": "busy", "stream": False}
            holder = asyncio.create_task(http.post(path, json=request))
            gen = await busy.next_request()
            queued = asyncio.create_task(http.post(path, json=request))
            await until_queued(http, 1)
            check(path, await http.post(path, json=request))  # the queue is full: 429
            check(path, await queued)  # timed out in the queue: 429
            await busy.send(Chunk(gen.request_id, 0, "", "", 0, Usage(1, 0), None))
            await busy.send(Error(gen.request_id, "internal_error", "boom"))  # a runner's 500
            check(path, await holder)
    finally:
        await busy.close()
    statuses = {status for _, status in seen}
    assert statuses == {400, 401, 403, 404, 413, 429, 500, 503}, seen


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/api/chat",
                                  "/api/generate", "/api/show"])  # fmt: skip
def test_every_gateway_error_fits_the_schema(spec: dict[str, Any], path: str) -> None:
    """The errors a running gateway cannot be made to answer here (a lost runner, a stream
    timeout, a stopping gateway), written as the gateway writes them for the path."""
    problems = [
        RunnerLost("gone"),
        StreamTimeout(60.0),
        ShuttingDown(),
        ModelNotFound("m"),
        ModelUnavailable("m", retry_after=1.0),
        QueueFull("m", retry_after=1.0),
        Error("r", "internal_error", "boom"),
        Error("r", "context_length_exceeded", "too long"),
    ]
    responses = op(spec, path)["responses"]
    for problem in problems:
        err = api_error_for(problem)
        if str(err.status) not in responses:
            assert path == "/api/show"
            assert err.status in (429, 500, 502, 504)
            continue
        assert response_check(spec, path, err.status)(error_shape(path)(err)), (path, problem)
