"""The official `openai` npm package in real headless Chromium, talking to a real gateway and a
real runner on the built-in model through the browser client's `fetch` (gateway/static/
orchard.js): its requests ride the WebSocket, and the SDK's own SSE parser, stream iterator,
`.stream()` helper and error classes read what comes back.

The SDK is the version pinned in tests/js/package.json and package-lock.json, installed by
`just js` (`just test` runs it); the page imports its ESM build from files this module serves
with `page.route`. Chromium is Debian's, as in test_console_browser.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from playwright.sync_api import Browser, Page, Route

from runner.demo_model import TOOL_DEMO_CALLS, TOOL_DEMO_MESSAGES, TOOL_DEMO_TOOLS
from tests.support import (
    REPO,
    UNIT,
    Gateway,
    Stacks,
    page_problems,
    wait_until,
)

MODEL = "orchard-demo"
RUNNER = "test-runner"
SDK = REPO / "tests" / "js" / "node_modules" / "openai"
SDK_ROUTE = "/test-sdk/openai/"
"""Where the page finds the SDK's files (served by the test, not by the gateway)."""
MS = 1000 * UNIT
"""Playwright counts in milliseconds."""

USER = [{"role": "user", "content": "Tell me about the orchard in spring."}]


@pytest.fixture(scope="module")
def gateway(stacks: Stacks) -> Gateway:
    return stacks.get()[0]


@pytest.fixture(scope="module", autouse=True)
def _sdk() -> None:
    if not (SDK / "index.mjs").exists():
        pytest.fail(f"{SDK} is missing: run `just js` (npm ci in tests/js).")


def serve_sdk(route: Route) -> None:
    """The SDK's files from node_modules, as JavaScript modules."""
    wanted = (SDK / urlsplit(route.request.url).path.removeprefix(SDK_ROUTE)).resolve()
    if not wanted.is_relative_to(SDK.resolve()) or not wanted.is_file():
        route.fulfill(status=404)
        return
    route.fulfill(path=wanted, content_type="text/javascript")


# `orchard` is the browser client; `openai` the SDK on its fetch, retries off so that every
# error reaches the test as the SDK first raised it.
SETUP = """async () => {
  const sdk = await import("/test-sdk/openai/index.mjs");
  const { OrchardClient } = await import("/static/orchard.js");
  window.sdk = sdk;
  window.orchard = new OrchardClient();
  window.openai = new sdk.OpenAI({
    baseURL: `${location.origin}/v1`, apiKey: "unused", dangerouslyAllowBrowser: true,
    maxRetries: 0, fetch: orchard.fetch,
  });
  await orchard.ping();
}"""


@pytest.fixture
def page(browser: Browser, gateway: Gateway) -> Iterator[Page]:
    """A page on the gateway's origin with the SDK loaded and a connected client; it fails the
    test on any script error or console error."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(15 * MS)
    problems = page_problems(page)
    page.route(f"{gateway.base}{SDK_ROUTE}**", serve_sdk)
    page.goto(f"{gateway.base}/static/orchard.js")
    page.evaluate(SETUP)
    yield page
    page.evaluate("orchard.close()")
    context.close()
    assert not problems, problems


def runner_state(gateway: Gateway) -> dict[str, Any]:
    (runner,) = [r for r in gateway.runners() if r["name"] == RUNNER]
    return runner


def without_id(obj: dict[str, Any]) -> dict[str, Any]:
    """A response object without its per-response `id` and `created`."""
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


def joined(chunks: list[Any]) -> list[Any]:
    """A real stream with its deltas joined: where a model's tokens split into chunks depends
    on timing (tokens that pile up go out together), not on the transport."""
    assert len({c["id"] for c in chunks}) == 1
    role, *middle, finish, usage = [without_id(c) for c in chunks]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in middle)
    return [role, content, finish, usage]


def sse_payloads(body: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, checked to be framed as the HTTP API frames them:
    `data: <json>` events, each as the gateway's orjson writes it, and `data: [DONE]` last."""
    events = body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], body[-80:]
    payloads = [event.removeprefix(b"data: ") for event in events[:-2]]
    assert all(event.startswith(b"data: ") for event in events[:-2]), body
    for payload in payloads:
        assert payload == orjson.dumps(orjson.loads(payload)), payload
    return payloads


# --- a plain completion: the same over the socket as over HTTP -------------------------

# The SDK's stream over the socket, with a copy of the SSE bytes its fetch gave it, then the
# same request not streamed (collected by the fetch into one chat.completion).
PLAIN_SCRIPT = """async (request) => {
  const bodies = [], streamHeaders = [];
  const teeing = new sdk.OpenAI({
    baseURL: `${location.origin}/v1`, apiKey: "unused", dangerouslyAllowBrowser: true,
    maxRetries: 0,
    fetch: async (url, init) => {
      const response = await orchard.fetch(url, init);
      const [mine, theirs] = response.body.tee();
      bodies.push(new Response(mine).text());
      streamHeaders.push(Object.fromEntries(response.headers));
      return new Response(theirs, response);
    },
  });
  const stream = await teeing.chat.completions.create({
    ...request, stream: true, stream_options: { include_usage: true },
  });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  const { data: plain, response } = await openai.chat.completions.create(request).withResponse();
  return {
    chunks, sse: await bodies[0], streamHeaders: streamHeaders[0],
    plain, requestId: plain._request_id, headers: Object.fromEntries(response.headers),
    status: response.status,
  };
}"""


def test_a_streamed_completion_equals_http(page: Page, gateway: Gateway) -> None:
    request = {"model": MODEL, "messages": USER, "max_tokens": 16, "temperature": 0}
    streamed = {**request, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=gateway.base, timeout=60 * UNIT) as http:
        # Once first, so that every request below finds the same prefix cache.
        http.post("/v1/chat/completions", json=streamed).raise_for_status()
        over_http = http.post("/v1/chat/completions", json=streamed)
        result = page.evaluate(PLAIN_SCRIPT, request)
        plain_over_http = http.post("/v1/chat/completions", json=request).json()

    http_chunks = [orjson.loads(p) for p in sse_payloads(over_http.content)]
    socket_bytes = result["sse"].encode()
    socket_chunks = [orjson.loads(p) for p in sse_payloads(socket_bytes)]
    # The SDK parsed exactly the events the fetch gave it.
    assert result["chunks"] == socket_chunks
    assert joined(socket_chunks) == joined(http_chunks)
    text = joined(socket_chunks)[1]
    assert text.strip()
    assert socket_chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = socket_chunks[-1]["usage"]
    assert usage == http_chunks[-1]["usage"]
    assert usage["completion_tokens"] == 16

    assert result["streamHeaders"]["content-type"] == "text/event-stream"

    # Not streamed: the fetch collects the socket's chunks into the HTTP API's body.
    assert result["status"] == 200
    assert result["headers"]["content-type"] == "application/json"
    # The socket's request_id (crypto.randomUUID()), as the SDK reads x-request-id.
    assert re.fullmatch(r"[0-9a-f-]{36}", result["requestId"])
    assert result["headers"]["x-request-id"] == result["requestId"]
    plain = result["plain"]
    assert plain["id"].startswith("chatcmpl-")
    assert without_id(plain) == without_id(plain_over_http)
    assert plain["choices"][0]["message"]["content"] == text
    assert plain["usage"] == usage


# --- a tool call, streamed through the SDK and its .stream() helper -------------------

TOOL_SCRIPT = """async (request) => {
  const stream = await openai.chat.completions.create({ ...request, stream: true });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);

  const helper = openai.chat.completions.stream(request);
  const argumentDeltas = [];
  helper.on("tool_calls.function.arguments.delta", (event) => argumentDeltas.push(event));
  const final = await helper.finalChatCompletion();

  const plain = await openai.chat.completions.create(request);  // collected by the fetch
  return { chunks, argumentDeltas, final, plain };
}"""


def merged_tool_calls(chunks: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The tool calls the chunks stream, merged by index, and the finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert choice["index"] == 0
            finish = choice["finish_reason"] or finish
            for piece in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"index": piece["index"], "arguments": ""})
                for key in ("id", "type"):
                    if key in piece:
                        call[key] = piece[key]
                if "name" in piece.get("function", {}):
                    call["name"] = piece["function"]["name"]
                call["arguments"] += piece.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)], finish


def test_a_streamed_tool_call(page: Page, gateway: Gateway) -> None:
    """The built-in model's tool conversation: greedy decoding calls get_weather."""
    (expected,) = TOOL_DEMO_CALLS
    assert expected["name"] == "get_weather"
    arguments = expected["arguments"]
    request = {
        "model": MODEL,
        "messages": list(TOOL_DEMO_MESSAGES),
        "tools": list(TOOL_DEMO_TOOLS),
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 200,
    }
    result = page.evaluate(TOOL_SCRIPT, request)

    calls, finish = merged_tool_calls(result["chunks"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in result["chunks"])
    assert len(calls) == 1, f"no single tool call; the model wrote {text!r}"
    (call,) = calls
    assert call["index"] == 0
    assert re.fullmatch(r"call_\w+", call["id"])
    assert call["type"] == "function"
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == arguments
    assert finish == "tool_calls"

    # The .stream() helper: argument deltas as they come, and the final completion's call.
    deltas = result["argumentDeltas"]
    assert deltas, "no tool_calls.function.arguments.delta event"
    assert {(d["name"], d["index"]) for d in deltas} == {("get_weather", 0)}
    assert "".join(d["arguments_delta"] for d in deltas) == deltas[-1]["arguments"]
    assert json.loads(deltas[-1]["arguments"]) == arguments
    (choice,) = result["final"]["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (final_call,) = choice["message"]["tool_calls"]
    assert final_call["id"].startswith("call_")
    assert final_call["type"] == "function"
    assert final_call["function"]["name"] == "get_weather"
    assert json.loads(final_call["function"]["arguments"]) == arguments

    # Not streamed: the fetch merges the call's pieces into the body the HTTP API answers.
    plain_over_http = httpx.post(
        f"{gateway.base}/v1/chat/completions", json=request, timeout=60 * UNIT
    ).json()
    plain = result["plain"]
    (plain_call,) = plain["choices"][0]["message"]["tool_calls"]
    assert plain_call["id"].startswith("call_")
    assert without_call_ids(plain) == without_call_ids(plain_over_http)
    assert plain["choices"][0]["finish_reason"] == "tool_calls"


def without_call_ids(body: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion without its per-response id, created and tool call ids."""
    body = json.loads(json.dumps(without_id(body)))
    for choice in body["choices"]:
        for call in choice["message"].get("tool_calls") or []:
            call["id"] = "call_"
    return body


# --- errors and aborts -------------------------------------------------------------

# Each body through the SDK (as it sent it, streamed or not), and what the SDK raised.
ERROR_SCRIPT = """async (bodies) => {
  const outcomes = [];
  for (const body of bodies) {
    try {
      await openai.chat.completions.create(body);
      outcomes.push("no error");
    } catch (err) {
      outcomes.push({
        name: err.constructor.name, apiError: err instanceof sdk.APIError,
        status: err.status, error: err.error, code: err.code, param: err.param, type: err.type,
      });
    }
  }
  return outcomes;
}"""

SDK_ERRORS = {404: "NotFoundError", 400: "BadRequestError"}


def test_errors_are_the_sdks_with_the_http_apis_status_and_body(
    page: Page, gateway: Gateway
) -> None:
    base = {"model": MODEL, "messages": USER}
    bodies: list[dict[str, Any]] = [
        {**base, "model": "no-such-model", "stream": True},  # 404 model_not_found
        {**base, "model": "no-such-model"},
        {**base, "temperature": 9, "stream": True},  # 400 from the gateway's validation
        # 400 from the fetch itself: the socket would take stream_options, HTTP refuses them.
        {**base, "stream_options": {"include_usage": True}},
    ]
    outcomes = page.evaluate(ERROR_SCRIPT, bodies)
    for body, outcome in zip(bodies, outcomes, strict=True):
        over_http = httpx.post(f"{gateway.base}/v1/chat/completions", json=body, timeout=10 * UNIT)
        expected = over_http.json()["error"]
        assert over_http.status_code in SDK_ERRORS, over_http.text
        assert outcome != "no error", body
        assert outcome["name"] == SDK_ERRORS[over_http.status_code]
        assert outcome["apiError"]
        assert outcome["status"] == over_http.status_code
        assert outcome["error"] == expected
        assert (outcome["code"], outcome["param"], outcome["type"]) == (
            expected["code"],
            expected["param"],
            expected["type"],
        )
    assert outcomes[0]["code"] == "model_not_found"


# A body that is not JSON (the SDK never sends one), and a request fetch does not carry.
NOT_CARRIED_SCRIPT = """async () => {
  const bad = await orchard.fetch("/v1/chat/completions", { method: "POST", body: "{not json" });
  const models = await openai.models.list();
  return { status: bad.status, error: (await bad.json()).error, models: models.data };
}"""


def test_a_body_that_is_not_json_and_requests_not_carried(page: Page, gateway: Gateway) -> None:
    result = page.evaluate(NOT_CARRIED_SCRIPT)
    over_http = httpx.post(
        f"{gateway.base}/v1/chat/completions", content=b"{not json", timeout=10 * UNIT
    )
    assert result["status"] == over_http.status_code == 400
    expected = over_http.json()["error"]
    # The message quotes the JSON parser, which is not the same one.
    assert {**result["error"], "message": ""} == {**expected, "message": ""}
    assert result["error"]["code"] == "invalid_json"
    # GET /v1/models is not a chat completion: it went to window.fetch, over HTTP.
    assert [m["id"] for m in result["models"]] == [MODEL]


# Wraps the client's message handler to see the socket's `done` messages, then stops one
# stream with an AbortController and leaves another by breaking out of the SDK's loop.
ABORT_SCRIPT = """async ([request, waitMs]) => {
  const dones = [];
  const receive = orchard.receive.bind(orchard);
  orchard.receive = (message, data) => {
    if (message.type === "done") dones.push(message);
    receive(message, data);
  };
  const waitForDones = async (count) => {
    const deadline = Date.now() + waitMs;
    while (dones.length < count && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
  };

  const controller = new AbortController();
  const stream = await openai.chat.completions.create(
    { ...request, stream: true }, { signal: controller.signal });
  let seen = 0, thrown = null;
  try {
    for await (const chunk of stream) {
      if (++seen === 3) controller.abort();
    }
  } catch (err) {
    thrown = err.constructor.name;
  }
  await waitForDones(1);

  const left = await openai.chat.completions.create({ ...request, stream: true });
  let read = 0;
  for await (const chunk of left) {
    if (++read === 3) break;
  }
  await waitForDones(2);
  return { seen, thrown, dones };
}"""


def test_an_aborted_stream_is_cancelled(page: Page, gateway: Gateway) -> None:
    before = runner_state(gateway)["tokens_generated"]
    request = {"model": MODEL, "messages": USER, "max_tokens": 1800}
    result = page.evaluate(ABORT_SCRIPT, [request, 10 * MS])
    # The SDK ends its loop quietly when its own signal aborts the body, as over HTTP.
    assert result["seen"] == 3
    assert result["thrown"] is None
    dones = result["dones"]
    assert [d["finish_reason"] for d in dones] == ["cancelled", "cancelled"], dones
    assert all(0 < d["usage"]["completion_tokens"] < 1800 for d in dones), dones
    wait_until(lambda: runner_state(gateway)["active"] == 0, 10, "the runner to free its slots")
    generated = runner_state(gateway)["tokens_generated"] - before
    assert generated == sum(d["usage"]["completion_tokens"] for d in dones)
