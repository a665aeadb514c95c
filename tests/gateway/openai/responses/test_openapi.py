"""The OpenAPI description of OpenAI's Responses endpoints agrees with the code: a body the
request schema allows is one the parser takes (and the bounds are the parser's), every
response object and event the protocol builds fits the 200 schemas, and a running gateway's
real answers and errors fit the schemas documented for their status.

Schemas are checked with jsonschema_rs, the validator schemathesis holds responses against.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import GatewayConfig
from gateway.errors import (
    ModelNotFound,
    ModelUnavailable,
    QueueFull,
    RunnerLost,
    ShuttingDown,
    StreamTimeout,
)
from gateway.http_errors import api_error_for
from protocol.core.errors import ApiError, server_error
from protocol.core.limits import MAX_MESSAGES, MAX_PROMPT_CHARS
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, Error, Generate, ToolCallDelta, Usage
from protocol.openai.errors import error_body
from protocol.openai.responses.events import ResponseEvents, response_base, response_body
from protocol.openai.responses.input import MAX_CONTENT_PARTS
from protocol.openai.responses.request import MAX_TOOLS, MIN_OUTPUT_TOKENS, parse_responses_object
from tests.gateway.openapi_spec import (
    Check,
    gateway_spec,
    limited_gateway,
    op,
    response_check,
    validator,
)
from tests.gateway.waits import until_gone, until_queued
from tests.support import UNIT, FakeRunner, Gateway

LIMIT = GatewayConfig().max_tokens_limit
CREATE = "/v1/responses"
BY_ID = "/v1/responses/{response_id}"

DESCRIBED = {
    ("post", CREATE): "200 400 401 403 404 413 429 500 502 503 504",
    ("get", BY_ID): "200 400 401 403 404",
    ("delete", BY_ID): "200 400 401 403 404",
    ("get", BY_ID + "/input_items"): "200 400 401 403 404",
    ("post", "/v1/responses/compact"): "200 400 401 403 404 413 429 500 502 503 504",
    ("post", "/v1/responses/input_tokens"): "200 400 401 403 404 413 429 500 502 503 504",
}


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return gateway_spec()


def event_check(spec: dict[str, Any]) -> Check:
    media = op(spec, CREATE)["responses"]["200"]["content"]["text/event-stream"]
    return validator(media["x-itemSchema"])


def test_the_routes_are_described(spec: dict[str, Any]) -> None:
    for (method, path), statuses in DESCRIBED.items():
        assert sorted(op(spec, path, method)["responses"]) == statuses.split(), (method, path)


def test_errors_are_openais(spec: dict[str, Any]) -> None:
    for (method, path), statuses in DESCRIBED.items():
        for status in statuses.split()[1:]:
            err = ApiError(int(status), "why", "invalid_request_error", "model", None)
            assert response_check(spec, path, int(status), method)(error_body(err)), (path, status)


# --- the request ----------------------------------------------------------------------------


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def parser_accepts(data: Any) -> bool:
    """The parser's verdict with a store (False past the gateway's ceiling); a refusal must
    be a 400."""
    status = 200
    try:
        parsed = parse_responses_object(data, store=True)
    except ApiError as err:
        status = err.status
    assert status in (200, 400)
    if status == 400:
        return False
    return parsed.max_output_tokens is None or parsed.max_output_tokens <= LIMIT


@pytest.fixture(scope="module")
def accepted(spec: dict[str, Any]) -> Check:
    return validator(op(spec, CREATE)["requestBody"]["content"]["application/json"]["schema"])


TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
MESSAGE = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
ITEMS = [
    MESSAGE,
    {"role": "developer", "content": "Be brief."},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
    },
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text",
                                                                   "text": "sunny"}]},
]  # fmt: skip
NULLABLE = (
    "instructions", "max_output_tokens", "temperature", "top_p", "presence_penalty",
    "frequency_penalty", "tools", "tool_choice",
    "parallel_tool_calls", "text", "reasoning", "stream", "stream_options", "store",
    "previous_response_id", "metadata", "user", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "max_tool_calls", "truncation",
    "service_tier", "background", "include", "top_logprobs", "conversation", "prompt",
    "context_management", "moderation",
)  # fmt: skip
GOOD = [
    body(),
    body(background=True),
    body(background=True, store=True, stream=True),
    body(background=False, store=False),
    body(input=ITEMS),
    body(input=[{"role": "user", "content": "hi"}]),
    body(instructions="Be brief.", max_output_tokens=MIN_OUTPUT_TOKENS, temperature=0, top_p=1),
    body(max_output_tokens=LIMIT),
    body(tools=[TOOL], tool_choice="required", parallel_tool_calls=False),
    body(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}),
    body(tool_choice="auto", parallel_tool_calls=True),
    body(tool_choice="none"),
    body(text={"format": {"type": "text"}, "verbosity": "medium"}),
    body(text={"format": {"type": "json_object"}}),
    body(text={"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": True}}),
    body(reasoning={"effort": "low"}),
    body(stream=True, stream_options={"include_obfuscation": False}),
    body(store=True, previous_response_id="resp_1", metadata={"k": "v"}),
    body(user="u", safety_identifier="s" * 64, prompt_cache_key="k", max_tool_calls=1),
    body(prompt_cache_retention="24h", prompt_cache_options={"ttl": "30m", "mode": "implicit"}),
    body(truncation="disabled", service_tier="auto", background=False, include=[]),
    body(top_logprobs=0),
    body(input="x" * MAX_PROMPT_CHARS),
    body(input=[MESSAGE] * MAX_MESSAGES),
    body(input=[{"role": "user", "content": [MESSAGE["content"][0]] * MAX_CONTENT_PARTS}]),
    body(tools=[{**TOOL, "name": f"f{i}"} for i in range(MAX_TOOLS)]),
    # null is read as left out, wherever a field is not required.
    body(**dict.fromkeys(NULLABLE)),
    body(stream_options=None, tool_choice=None),
    body(
        text={"format": None, "verbosity": None},
        reasoning={"effort": None, "summary": None, "generate_summary": None},
        prompt_cache_options={"ttl": None, "mode": None},
        tools=[{**TOOL, "description": None, "parameters": None, "strict": None}],
        input=[
            {"type": None, "role": "user", "content": "hi", "id": None, "status": None},
            {"type": "reasoning", "summary": None, "content": None, "encrypted_content": None},
        ],
    ),
]
BAD = [
    body(model=None),
    body(input=None),
    {"input": "hi"},
    {"model": "m"},
    body(unknown=1),
    body(input=[]),
    body(input=[{"type": "message", "role": "tool", "content": "x"}]),
    body(input=[{**MESSAGE, "extra": 1}]),
    body(
        input=[
            {"type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]}
        ]
    ),
    body(input=[{"type": "web_search_call"}]),
    body(input=[{"type": "function_call", "call_id": "c1", "name": "f"}]),
    body(input=[{"type": "reasoning", "encrypted_content": "x"}]),
    body(input="x" * (MAX_PROMPT_CHARS + 1)),
    body(input=[MESSAGE] * (MAX_MESSAGES + 1)),
    body(input=[{"role": "user", "content": [MESSAGE["content"][0]] * (MAX_CONTENT_PARTS + 1)}]),
    body(max_output_tokens=MIN_OUTPUT_TOKENS - 1),
    body(max_output_tokens=LIMIT + 1),
    body(temperature=2.5),
    body(top_p=-1),
    body(tools=[{**TOOL, "type": "web_search"}]),
    body(tools=[{**TOOL, "name": "bad name"}]),
    body(tools=[{**TOOL, "extra": 1}]),
    body(tools=[{**TOOL, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]),
    body(tool_choice="required"),
    body(tool_choice={"type": "function", "name": "get_weather"}),
    body(tool_choice="any"),
    body(text={"format": {"type": "xml"}}),
    body(text={"verbosity": "low"}),
    body(text={"format": {"type": "json_schema"}}),
    body(reasoning={"effort": "huge"}),
    body(reasoning={"summary": "auto"}),
    body(stream_options={"include_obfuscation": False}),
    body(stream=False, stream_options={}),
    body(stream=True, stream_options={"x": 1}),
    body(metadata={f"k{i}": "v" for i in range(17)}),
    body(metadata={"k": "v" * 513}),
    body(metadata={"k" * 65: "v"}),
    body(metadata={"k": 1}),
    body(safety_identifier="s" * 65),
    body(prompt_cache_retention="1h"),
    body(prompt_cache_options={"mode": "explicit"}),
    body(max_tool_calls=0),
    body(truncation="auto"),
    body(service_tier="flex"),
    body(background=True, store=False),
    body(background="yes"),
    body(include=["reasoning.encrypted_content"]),
    body(top_logprobs=2),
    body(conversation="conv_1"),
    body(prompt={"id": "p"}),
    body(context_management=[]),
    body(moderation={}),
    body(stream="yes"),
    body(store="yes"),
]


@pytest.mark.parametrize("data", GOOD)
def test_the_schema_allows_what_the_parser_takes(accepted: Check, data: Any) -> None:
    assert accepted(data)
    assert parser_accepts(data)


@pytest.mark.parametrize("data", BAD)
def test_the_schema_refuses_what_the_parser_refuses(accepted: Check, data: Any) -> None:
    assert not parser_accepts(data)
    assert not accepted(data)


def test_every_optional_field_is_nullable(spec: dict[str, Any]) -> None:
    schema = op(spec, CREATE)["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) - set(schema["required"]) == set(NULLABLE)


def test_what_a_schema_cannot_say_is_in_the_descriptions(spec: dict[str, Any]) -> None:
    schema = op(spec, CREATE)["requestBody"]["content"]["application/json"]["schema"]
    props = schema["properties"]
    assert f"at most {MAX_PROMPT_CHARS} characters" in props["input"]["description"]
    assert "besides reasoning" in props["input"]["description"]
    assert "must be one of them" in props["tool_choice"]["description"].replace("\n", " ")
    # Only reasoning items: the schema allows it, the parser names input.
    only_reasoning = body(input=[{"type": "reasoning"}])
    assert validator(schema)(only_reasoning)
    assert not parser_accepts(only_reasoning)


# --- the answers ----------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4, reasoning_tokens=2)
CALLS = (
    ToolCallDelta(0, "", id="call_a", name="get_weather"),
    ToolCallDelta(0, '{"city": "Paris"}'),
    ToolCallDelta(1, "{}", id="call_b", name="time"),
)
REQUESTS = [
    body(),
    body(background=True),
    body(
        instructions="Be brief.",
        max_output_tokens=64,
        temperature=0.5,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "x", "description": "d", "schema": {}}},
        reasoning={"effort": "high"},
        metadata={"k": "v"},
        user="u",
        safety_identifier="s",
        prompt_cache_key="k",
        max_tool_calls=3,
        store=True,
        previous_response_id="resp_0",
    ),
    body(tools=[{"type": "function", "name": "f"}], tool_choice="required", store=False),
    body(text={"format": {"type": "json_object"}}),
]
ANSWERS = [
    ("", "Hello", (), "stop"),
    ("hmm", "", (), "length"),
    ("hmm", "Let me look.", CALLS, "tool_calls"),
    ("", "", CALLS, "length"),
    ("", "", (), "stop"),
]


def base(data: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_responses_object(data, store=True)
    return response_base(parsed, id="resp_1", created_at=1, store=parsed.store)


@pytest.mark.parametrize("data", REQUESTS)
@pytest.mark.parametrize("answer", ANSWERS)
def test_responses_fit_the_schema(
    spec: dict[str, Any], data: dict[str, Any], answer: tuple[str, str, Any, Any]
) -> None:
    reasoning, text, calls, reason = answer
    ok = response_check(spec, CREATE, 200)
    stored_ok = response_check(spec, BY_ID, 200, "get")
    made = response_body(
        base(data),
        reasoning=reasoning,
        text=text,
        tool_calls=calls,
        reason=reason,
        usage=USAGE,
        completed_at=2,
    )
    assert ok(made), made
    assert stored_ok(made)
    assert not ok({**made, "extra": 1})
    assert not ok({key: value for key, value in made.items() if key != "usage"})
    assert not ok({**made, "status": "in_progress"})
    for item in made["output"]:
        assert not ok({**made, "output": [{**item, "extra": 1}]})


def stream_events(data: dict[str, Any], items: list[Any], fail: bool = False) -> list[Any]:
    clock = itertools.count(2)
    events = ResponseEvents(base(data), clock=lambda: next(clock))
    stream = CompletionStream(events, events)
    out: list[bytes] = [events.queued()] if data.get("background") else []
    for item in items:
        stream.feed(item, out)
    if fail:
        stream.fail(server_error("boom"), out)
    parsed = []
    for block in b"".join(out).split(b"\n\n")[:-1]:
        name, line = block.split(b"\n")
        event = orjson.loads(line.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        parsed.append(event)
    return parsed


STREAMS = [
    ([Chunk("r", 0, "Hel", "hmm", 1, USAGE), Chunk("r", 1, "lo", "", 1, USAGE, "stop")], False),
    ([Chunk("r", 0, "", "hmm", 1, USAGE), Chunk("r", 1, "Hel", "", 1, USAGE, "length")], False),
    (
        [
            Chunk("r", 0, "Let me look.", "", 1, USAGE),
            Chunk("r", 1, "", "", 2, USAGE, tool_calls=CALLS),
            Chunk("r", 2, "", "", 0, USAGE, "tool_calls"),
        ],
        False,
    ),
    ([Chunk("r", 0, "", "", 0, USAGE, "stop")], False),
    ([Chunk("r", 0, "a", "", 1, USAGE)], True),
    ([Chunk("r", 0, "a", "", 1, USAGE, "cancelled")], False),
    ([], True),
]


@pytest.mark.parametrize("data", REQUESTS)
def test_stream_events_fit_the_schema(spec: dict[str, Any], data: dict[str, Any]) -> None:
    ok = event_check(spec)
    media = op(spec, CREATE)["responses"]["200"]["content"]["text/event-stream"]
    sse_ok = validator(media["schema"])
    assert media["schema"]["properties"]["data"]["contentSchema"] == media["x-itemSchema"]
    names = set(media["schema"]["properties"]["event"]["enum"])
    seen: set[str] = set()
    for items, fail in STREAMS:
        for event in stream_events(data, items, fail):
            seen.add(event["type"])
            assert ok(event), event
            assert not ok({**event, "extra": 1})
            # As schemathesis reads an OpenAPI 3.1 event stream.
            assert sse_ok({"event": event["type"], "data": orjson.dumps(event).decode()})
    # A background stream starts queued, so that a failure is always response.failed.
    unseen = {"error"} if data.get("background") else {"response.queued"}
    assert seen == names - unseen
    assert not sse_ok({"event": "message", "data": "[DONE]"})


# --- a running gateway's answers and errors --------------------------------------------------

KEY = "openapi-key-7d1e"
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


REQUEST = {"model": "fake-model", "input": "hi"}


async def answer(runner: FakeRunner, *texts: str) -> None:
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    for seq, text in enumerate(texts):
        await runner.send(FakeRunner.chunk(gen.request_id, seq, text, done=seq == len(texts) - 1))


async def test_real_answers_fit_the_schema(
    spec: dict[str, Any], runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    ok = event_check(spec)
    ids = []
    for stream in (False, True):
        served = asyncio.create_task(answer(runner, "Hel", "lo"))
        response = await http.post(CREATE, json={**REQUEST, "stream": stream})
        await served
        assert response.status_code == 200, response.text
        if stream:
            assert response.headers["content-type"].startswith("text/event-stream")
            blocks = [b for b in response.content.split(b"\n\n") if b.startswith(b"event:")]
            events = [orjson.loads(block.split(b"\ndata: ")[1]) for block in blocks]
            assert events, response.text
            assert all(ok(event) for event in events), response.text
            ids.append(events[-1]["response"]["id"])
        else:
            assert response_check(spec, CREATE, 200)(response.json()), response.text
            ids.append(response.json()["id"])
    for response_id in ids:
        got = await http.get(f"/v1/responses/{response_id}")
        assert got.status_code == 200, got.text
        assert response_check(spec, BY_ID, 200, "get")(got.json()), got.text
        gone = await http.delete(f"/v1/responses/{response_id}")
        assert gone.status_code == 200, gone.text
        assert response_check(spec, BY_ID, 200, "delete")(gone.json()), gone.text


async def test_real_errors_fit_the_schema(
    spec: dict[str, Any], gateway: Gateway, runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    seen: set[tuple[str, str, int]] = set()

    def check(path: str, response: httpx.Response, method: str = "post") -> None:
        status = response.status_code
        assert str(status) in op(spec, path, method)["responses"], (path, status)
        assert response_check(spec, path, status, method)(response.json()), response.text
        seen.add((method, path, status))

    leaving = await FakeRunner.connect(gateway, models=("leaving",), name="leaving")
    await leaving.close()
    await until_gone(http, "leaving")
    check(CREATE, await http.post(CREATE, content=b"{"))
    check(CREATE, await http.post(CREATE, json={**REQUEST, "unknown": 1}))
    check(CREATE, await http.post(CREATE, json={**REQUEST, "previous_response_id": "resp_x"}))
    check(CREATE, await http.post(CREATE, json=REQUEST, headers={"Authorization": "Bearer no"}))
    check(CREATE, await http.post(CREATE, json=REQUEST, headers={"Origin": "http://evil.example"}))
    check(CREATE, await http.post(CREATE, json={**REQUEST, "model": "nobody"}))
    check(CREATE, await http.post(CREATE, json={**REQUEST, "model": "leaving"}))
    check(CREATE, await http.post(CREATE, content=b" " * 70_000))
    for method in ("get", "delete"):
        url = "/v1/responses/resp_none"
        check(BY_ID, await http.request(method, url), method)
        check(BY_ID, await http.request(method, url + "?include=x"), method)
        check(
            BY_ID, await http.request(method, url, headers={"Authorization": "Bearer no"}), method
        )
        evil = {"Origin": "http://evil.example"}
        check(BY_ID, await http.request(method, url, headers=evil), method)
    busy = await FakeRunner.connect(gateway, models=("busy",), max_concurrent=1, name="busy")
    try:
        request = {**REQUEST, "model": "busy"}
        holder = asyncio.create_task(http.post(CREATE, json=request))
        gen = await busy.next_request()
        queued = asyncio.create_task(http.post(CREATE, json=request))
        await until_queued(http, 1)
        check(CREATE, await http.post(CREATE, json=request))  # the queue is full: 429
        check(CREATE, await queued)  # timed out in the queue: 429
        await busy.send(Chunk(gen.request_id, 0, "", "", 0, Usage(1, 0), None))
        await busy.send(Error(gen.request_id, "internal_error", "boom"))  # a runner's 500
        check(CREATE, await holder)
    finally:
        await busy.close()
    assert {s for m, _, s in seen if m == "post"} == {400, 401, 403, 404, 413, 429, 500, 503}
    for method in ("get", "delete"):
        assert {s for m, _, s in seen if m == method} == {400, 401, 403, 404}, seen


def test_every_gateway_error_fits_the_schema(spec: dict[str, Any]) -> None:
    """The errors a running gateway cannot be made to answer here (a lost runner, a stream
    timeout, a stopping gateway), as the gateway writes them."""
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
    responses = op(spec, CREATE)["responses"]
    for problem in problems:
        err = api_error_for(problem)
        assert str(err.status) in responses, problem
        assert response_check(spec, CREATE, err.status)(error_body(err)), problem
