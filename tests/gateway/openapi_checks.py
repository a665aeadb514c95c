"""What the dialects' OpenAPI test modules share (tests/gateway/anthropic/test_openapi.py and
tests/gateway/ollama/test_openapi.py): validators of a path's documented request, stream
items and errors, the answers the protocol builds from, and the checks of a running
gateway's real answers and errors, each run on the paths of one dialect.

Schemas are checked with jsonschema_rs, the validator schemathesis holds responses against.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson

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
from protocol.core.errors import ApiError
from protocol.frames import Chunk, Error, Generate, ToolCallDelta, Usage
from protocol.openai.errors import error_body
from tests.gateway.openapi_spec import Check, op, response_check, validator
from tests.gateway.waits import until_gone, until_queued
from tests.support import FakeRunner, Gateway

LIMIT = GatewayConfig().max_tokens_limit


def error_shape(path: str) -> ErrorShape:
    """The shape the errors of `path` come in: its API's (gateway.api)."""
    return unrouted(path, APIS, error_body)


def request_check(spec: dict[str, Any], path: str) -> Check:
    return validator(op(spec, path)["requestBody"]["content"]["application/json"]["schema"])


def item_check(spec: dict[str, Any], path: str, media: str) -> Check:
    return validator(op(spec, path)["responses"]["200"]["content"][media]["x-itemSchema"])


def accepted(parse: Callable[[], bool]) -> bool:
    """`parse`'s verdict (False past the gateway's ceilings); a refusal must be a 400."""
    status = 200
    try:
        ok = parse()
    except ApiError as err:
        status, ok = err.status, False
    assert status in (200, 400)
    return ok


def check_error_schemas(spec: dict[str, Any], described: dict[tuple[str, str], str]) -> None:
    """Each documented error status of the `described` routes has the dialect's error shape,
    not OpenAI's, and nothing more."""
    for (method, path), statuses in described.items():
        for status in statuses.split()[1:]:
            shape = error_shape(path)
            err = ApiError(int(status), "why", "invalid_request_error", None, None)
            ok = response_check(spec, path, int(status), method)
            assert ok(shape(err)), (path, status)
            assert not ok(error_body(err)), (path, status)  # OpenAI's shape is not the dialect's
            assert not ok({**shape(err), "extra": 1})


# --- the answers the protocol builds ---------------------------------------------------------

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4)
CALLS = (
    ToolCallDelta(0, "", id="call_a", name="get_weather"),
    ToolCallDelta(0, '{"city": "Paris"}'),
    ToolCallDelta(1, "{}", id="call_b", name="time"),
)


def sse_data(out: list[bytes]) -> list[Any]:
    events = []
    for block in b"".join(out).split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        events.append(event)
    return events


# --- a running gateway's answers and errors --------------------------------------------------

KEY = "openapi-key-51c2"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def answer(runner: FakeRunner, *texts: str) -> None:
    gen = await runner.next_request()
    assert isinstance(gen, Generate)
    for seq, text in enumerate(texts):
        await runner.send(FakeRunner.chunk(gen.request_id, seq, text, done=seq == len(texts) - 1))


async def check_real_answers(
    spec: dict[str, Any],
    runner: FakeRunner,
    http: httpx.AsyncClient,
    requests: dict[str, dict[str, Any]],
) -> None:
    """Each of `requests` (a path and its body), answered by `runner`, streamed and not where
    the path streams, fits the schema documented for its 200 and its media type."""
    for path, body in requests.items():
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


CheckError = Callable[..., None]
"""`check(path, response, method="post")`: the response's status is documented for the path and
its body fits the schema documented for that status."""


def error_checker(spec: dict[str, Any], seen: set[tuple[str, int]]) -> CheckError:
    """A CheckError that adds each (path, status) it checked to `seen`."""

    def check(path: str, response: httpx.Response, method: str = "post") -> None:
        status = response.status_code
        assert str(status) in op(spec, path, method)["responses"], (path, status)
        assert response_check(spec, path, status, method)(response.json()), response.text
        seen.add((path, status))

    return check


async def check_request_errors(
    check: CheckError,
    gateway: Gateway,
    http: httpx.AsyncClient,
    requests: dict[str, dict[str, Any]],
) -> None:
    """Each of `requests` made to fail every way a client can make it fail (a 400, 401, 403,
    404, 413, and a 503 for a model whose only runner left), each answer checked."""
    leaving = await FakeRunner.connect(gateway, models=("leaving",), name="leaving")
    await leaving.close()
    await until_gone(http, "leaving")
    for path, body in requests.items():
        check(path, await http.post(path, content=b"{"))
        check(path, await http.post(path, json={**body, "unknown": 1}))
        check(path, await http.post(path, json=body, headers={"Authorization": "Bearer no"}))
        check(path, await http.post(path, json=body, headers={"Origin": "http://evil.example"}))
        check(path, await http.post(path, json={**body, "model": "nobody"}))
        check(path, await http.post(path, json={**body, "model": "leaving"}))
        check(path, await http.post(path, content=b" " * 70_000))


async def check_busy_errors(
    check: CheckError, gateway: Gateway, http: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    """`body` posted to `path` for a model whose one runner is busy: a full queue's 429, a
    timed-out wait's 429 and the runner's 500, each answer checked."""
    busy = await FakeRunner.connect(gateway, models=("busy",), max_concurrent=1, name="busy")
    try:
        request = {**body, "model": "busy", "stream": False}
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


def check_gateway_errors(spec: dict[str, Any], path: str) -> None:
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
