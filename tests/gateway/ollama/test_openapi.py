"""The OpenAPI description of the Ollama endpoints agrees with the code: a body the request
schema allows is one the parser takes (and the bounds are the parser's), every line and
answer the protocol builds fits the 200 schemas, and a running gateway's real answers and
errors, for every documented status, fit the schemas documented for their status.

Schemas are checked with jsonschema_rs, the validator schemathesis holds responses against.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from protocol.core.errors import server_error
from protocol.core.limits import MAX_STOP
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, ModelInfo, ToolCallDelta
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
)
from tests.gateway.openapi_spec import gateway_spec, limited_gateway, op, response_check
from tests.support import UNIT, FakeRunner, Gateway, on_the_wire

DESCRIBED = {
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


def test_the_dialect_routes_are_described(spec: dict[str, Any]) -> None:
    for (method, path), statuses in DESCRIBED.items():
        assert sorted(op(spec, path, method)["responses"]) == statuses.split(), path
    # The model-management calls only ever answer 501: nothing to describe.
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete"):
        assert path not in spec["paths"]
    assert not [path for path in spec["paths"] if path.startswith("/api/blobs")]


def test_error_schemas_are_the_dialects(spec: dict[str, Any]) -> None:
    check_error_schemas(spec, DESCRIBED)


# --- the requests ---------------------------------------------------------------------------


def ollama_accepted(parse: Any, body: dict[str, Any]) -> bool:
    def parsed_within_limit() -> bool:
        tokens: int | None = parse(orjson.dumps(body)).max_tokens
        return tokens is None or tokens <= LIMIT

    return accepted(parsed_within_limit)


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
    "/api/chat": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
    "/api/generate": {"model": "fake-model", "prompt": "Once"},
    "/api/show": {"model": "fake-model"},
}


async def test_real_answers_fit_the_schema(
    spec: dict[str, Any], runner: FakeRunner, http: httpx.AsyncClient
) -> None:
    await check_real_answers(spec, runner, http, REQUESTS)
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
    check = error_checker(spec, seen)
    await check_request_errors(check, gateway, http, REQUESTS)
    for path in ("/api/tags", "/api/ps", "/api/version"):
        check(path, await http.get(path, headers={"Authorization": "Bearer no"}), "get")
        check(path, await http.get(path, headers={"Origin": "http://evil.example"}), "get")
    await check_busy_errors(check, gateway, http, "/api/chat", REQUESTS["/api/chat"])
    statuses = {status for _, status in seen}
    assert statuses == {400, 401, 403, 404, 413, 429, 500, 503}, seen


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/show"])
def test_every_gateway_error_fits_the_schema(spec: dict[str, Any], path: str) -> None:
    """The errors a running gateway cannot be made to answer here (a lost runner, a stream
    timeout, a stopping gateway), written as the gateway writes them for the path."""
    check_gateway_errors(spec, path)
