"""The browser's client for the Responses API's WebSocket mode (gateway/static/
responses-socket.js) in real headless Chromium, against a real gateway and a real runner on
the built-in model: lanes routed by `stream_id` (two at once, two one after another on one
lane), each response the HTTP one at temperature 0, a continuation, the nested error event
with its status, local refusals, steering, a dropped socket and API keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page

from tests.support import UNIT, Gateway, Stacks, page_problems

MODEL = "orchard-demo"
API_KEY = "responses-socket-key"
MS = 1000 * UNIT
"""Playwright counts in milliseconds."""
ENDS = ("response.completed", "response.incomplete")


@pytest.fixture(scope="module")
def gateway(stacks: Stacks) -> Gateway:
    return stacks.get()[0]


def open_page(browser: Browser, base: str) -> tuple[Page, list[str]]:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(30 * MS)
    problems = page_problems(page)
    page.goto(f"{base}/static/responses-socket.js")
    page.evaluate(SETUP)
    return page, problems


@pytest.fixture
def page(browser: Browser, gateway: Gateway) -> Iterator[Page]:
    """A page on the gateway's origin with the module loaded; it fails the test on any script
    or console error."""
    page, problems = open_page(browser, gateway.base)
    yield page
    page.context.close()
    assert not problems, problems


# `collect(run)`: a response's events, its final object and how it ended (an OrchardError's
# status and error, or null).
SETUP = """async () => {
  window.rs = await import("/static/responses-socket.js");
  window.collect = async (run) => {
    const events = [];
    let thrown = null, failure = null, response = null;
    try { for await (const event of run) events.push(event); }
    catch (err) { thrown = { name: err.name, status: err.status, error: err.error }; }
    try { response = await run.response; }
    catch (err) { failure = { name: err.name, status: err.status, error: err.error }; }
    return { events, response, thrown, failure, streamId: run.streamId, id: run.id };
  };
}"""


def http_response(gateway: Gateway, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{gateway.base}/v1/responses", json=body, timeout=60 * UNIT)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def check_stream(result: dict[str, Any], lane: str) -> None:
    """One response's events as the socket must route them: all of its lane, numbered from
    0 without gaps, created first and ended last, the deltas joining to the final text."""
    events = result["events"]
    assert (result["thrown"], result["failure"]) == (None, None), result
    assert {e["stream_id"] for e in events} == {lane}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ENDS
    final = result["response"]
    assert events[-1]["response"] == final
    assert events[0]["response"]["id"] == final["id"] == result["id"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == text_of(final)


# --- lanes ---------------------------------------------------------------------------------

LANES_SCRIPT = """async ([pears, plums, short]) => {
  const client = new rs.ResponsesSocket();
  // Two lanes at once, and two creates one after another on a third lane.
  const a = client.create(pears, { streamId: "a" });
  const b = client.create(plums, { streamId: "b" });
  const first = client.create(short, { streamId: "same" });
  const second = client.create(pears, { streamId: "same" });
  const results = await Promise.all([a, b, first, second].map(collect));
  // A continuation of lane a's response, on a fresh lane.
  const next = client.create({ ...plums, previous_response_id: a.id });
  const continued = await collect(next);
  client.close();
  return { results, continued, status: client.status };
}"""


def test_lanes_are_routed_and_each_response_is_the_http_one(page: Page, gateway: Gateway) -> None:
    pears = {"model": MODEL, "input": "Tell me about pears.", "temperature": 0,
             "max_output_tokens": 32}  # fmt: skip
    plums = {**pears, "input": "And plums?"}
    short = {**pears, "max_output_tokens": 16}
    out = page.evaluate(LANES_SCRIPT, [pears, plums, short])
    a, b, first, second = out["results"]
    for result, lane in ((a, "a"), (b, "b"), (first, "same"), (second, "same")):
        check_stream(result, lane)
    assert [r["streamId"] for r in out["results"]] == ["a", "b", "same", "same"]
    # Each is the HTTP response to its body: a lane's events reached the create they are of.
    assert text_of(a["response"]) == text_of(http_response(gateway, pears))
    assert text_of(b["response"]) == text_of(http_response(gateway, plums))
    assert text_of(first["response"]) == text_of(http_response(gateway, short))
    assert text_of(second["response"]) == text_of(a["response"])
    assert first["response"]["usage"]["output_tokens"] <= 16
    assert len({r["id"] for r in out["results"]}) == 4
    # The lane without a name the client chose for it: its own, and every event carries it.
    continued = out["continued"]
    check_stream(continued, continued["streamId"])
    assert continued["streamId"].startswith("lane-")
    assert continued["response"]["previous_response_id"] == a["id"]
    over_http = http_response(gateway, {**plums, "previous_response_id": a["id"]})
    assert text_of(continued["response"]) == text_of(over_http)
    assert out["status"] == "closed"


# --- errors ----------------------------------------------------------------------------------

ERRORS_SCRIPT = """async ([good]) => {
  const client = new rs.ResponsesSocket();
  const unknown = client.create({ ...good, model: "no-such-model" }, { streamId: "bad" });
  const notStreamed = client.create({ ...good, stream: false }, { streamId: "bad" });
  const fine = client.create(good, { streamId: "bad" });
  const badLane = client.create(good, { streamId: "no spaces" });
  const huge = client.create({ ...good, input: "x".repeat(2 * 1024 * 1024) });
  const results = await Promise.all([unknown, notStreamed, fine, badLane, huge].map(collect));
  let started = null;
  try { await unknown.started; } catch (err) { started = err.error.code; }
  client.close();
  let closed = null;
  try { await client.create(good).response; } catch (err) { closed = err.error; }
  return { results, started, closed };
}"""


def test_error_events_end_their_response_with_the_status(page: Page) -> None:
    good = {"model": MODEL, "input": "Hello there.", "temperature": 0, "max_output_tokens": 16}
    out = page.evaluate(ERRORS_SCRIPT, [good])
    unknown, not_streamed, fine, bad_lane, huge = out["results"]
    error = {
        "type": "invalid_request_error",
        "code": "model_not_found",
        "message": "The model `no-such-model` does not exist or you do not have access to it.",
        "param": None,
    }
    failed = {"name": "OrchardError", "status": 404, "error": error}
    assert (unknown["thrown"], unknown["failure"], unknown["events"]) == (failed, failed, [])
    assert out["started"] == "model_not_found"
    # Refused at its turn on the lane, with the status the HTTP API would give.
    assert not_streamed["failure"]["status"] == 400
    assert not_streamed["failure"]["error"]["code"] == "unsupported_value"
    assert not_streamed["failure"]["error"]["param"] == "stream"
    # The lane goes on after its refusals.
    check_stream(fine, "bad")
    # Refused here, before anything is sent.
    assert bad_lane["failure"] == {
        "name": "OrchardError",
        "status": 400,
        "error": {
            "message": "stream_id must be 1 to 256 of A-Z a-z 0-9 _ . -",
            "type": "invalid_request_error",
            "param": "stream_id",
            "code": "invalid_value",
        },
    }
    assert huge["failure"]["error"]["code"] == "message_too_large"
    assert huge["failure"]["status"] is None
    assert out["closed"] == {
        "message": "The client is closed.",
        "type": "connection_error",
        "param": None,
        "code": "client_closed",
    }


# --- steering ------------------------------------------------------------------------------

STEER_SCRIPT = """async ([body]) => {
  const client = new rs.ResponsesSocket();
  const run = client.create(body, { streamId: "s" });
  const after = client.create({ ...body, max_output_tokens: 16 }, { streamId: "s" });
  const collecting = collect(run);
  const id = await run.started;
  const { steer, successor } = await run.steer("Now tell me about plums.");
  const [steered, followed, behind] = await Promise.all(
    [collecting, collect(successor), collect(after)],
  );
  let again = null, nowhere = null;
  try { await run.steer("Once more."); } catch (err) { again = err.error; }
  try { await client.steer("resp_none", "Hello?"); } catch (err) { nowhere = err.error; }
  client.close();
  return { id, steer, steered, followed, behind, again, nowhere };
}"""


def test_a_steered_response_is_followed_by_its_successor_on_its_lane(page: Page) -> None:
    body = {"model": MODEL, "input": "Tell me everything about pear trees.",
            "temperature": 0, "max_output_tokens": 1000}  # fmt: skip
    out = page.evaluate(STEER_SCRIPT, [body])
    assert out["steer"]["id"].startswith("steer_")
    assert out["steer"]["previous_response_id"] == out["id"]
    steered = out["steered"]["response"]
    check_stream(out["steered"], "s")
    if steered["status"] == "incomplete":
        assert steered["incomplete_details"] == {"reason": "steered"}
    else:  # it ended before the stop reached its runner: the successor follows all the same
        assert steered["status"] == "completed"
    # The successor ran next on the lane, before the create queued behind the steered one.
    followed = out["followed"]
    check_stream(followed, "s")
    assert followed["response"]["previous_response_id"] == out["id"]
    check_stream(out["behind"], "s")
    assert out["behind"]["response"]["created_at"] >= followed["response"]["created_at"]
    assert out["again"]["code"] == "response_already_completed"
    assert out["nowhere"]["code"] == "response_not_found"


# --- the socket's life ---------------------------------------------------------------------

DROP_SCRIPT = """async ([body]) => {
  const statuses = [];
  const client = new rs.ResponsesSocket(undefined, { onStatus: (s) => statuses.push(s) });
  const run = client.create({ ...body, max_output_tokens: 1000 });
  const collecting = collect(run);
  await run.started;
  client.socket.close();  // as a network drop would
  const lost = await collecting;
  const next = await collect(client.create(body));  // waits for the new socket
  client.close();
  return { statuses, lost, next };
}"""


def test_a_dropped_socket_fails_its_responses_and_the_client_reconnects(page: Page) -> None:
    body = {"model": MODEL, "input": "Hello there.", "temperature": 0, "max_output_tokens": 16}
    out = page.evaluate(DROP_SCRIPT, [body])
    lost = {
        "name": "OrchardError",
        "status": None,
        "error": {
            "message": "connection lost",
            "type": "connection_error",
            "param": None,
            "code": "connection_lost",
        },
    }
    assert out["lost"]["thrown"] == out["lost"]["failure"] == lost
    assert out["lost"]["events"][0]["type"] == "response.created"
    check_stream(out["next"], out["next"]["streamId"])
    assert out["statuses"] == ["open", "connecting", "open", "closed"]


@pytest.fixture(scope="module")
def keyed_gateway() -> Iterator[Gateway]:
    """A gateway that wants an API key (no runner: a create's error event shows that the
    socket was let in)."""
    gw = Gateway("--api-key", API_KEY)
    try:
        yield gw
    finally:
        gw.stop()


KEYED_SCRIPT = """async ([key]) => {
  const body = { model: "orchard-demo", input: "hi" };
  const statuses = [];
  const onStatus = (s) => statuses.push(s);
  const client = new rs.ResponsesSocket(undefined, { apiKey: "wrong", onStatus });
  const refused = await collect(client.create(body));
  const later = await collect(client.create(body));
  client.setApiKey(key);
  const admitted = await collect(client.create(body));
  client.close();
  return { statuses, refused, later, admitted };
}"""


def test_the_api_key_is_sent_first_and_a_refusal_waits_for_another(
    browser: Browser, keyed_gateway: Gateway
) -> None:
    page, problems = open_page(browser, keyed_gateway.base)
    out = page.evaluate(KEYED_SCRIPT, [API_KEY])
    page.context.close()
    assert not problems, problems
    refusal = {
        "name": "OrchardError",
        "status": None,
        "error": {
            "message": "invalid API key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        },
    }
    assert out["refused"]["failure"] == refusal
    assert out["later"]["failure"] == refusal  # at once: no retry loop on a wrong key
    # With the right key the create reached the gateway: its answer is the error event of a
    # model no runner serves, with its status.
    admitted = out["admitted"]["failure"]
    assert admitted["status"] == 404
    assert admitted["error"]["code"] == "model_not_found"
    assert out["statuses"] == ["refused", "connecting", "open", "closed"]
