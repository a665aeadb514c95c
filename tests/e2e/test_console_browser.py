"""The web console and the browser client (gateway/static/) in real headless Chromium, against
a real gateway and a real runner on the built-in model.

Chromium is Debian's (`/usr/bin/chromium`, installed by `just browser`), driven by Playwright;
the browser Playwright would download is never used. Screenshots go to artifacts/.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from playwright.sync_api import Browser, Locator, Page, expect
from websockets.sync.client import connect as ws_connect

from gateway.tls import certificate_fingerprint
from tests.support import (
    REPO,
    SHARED_MAX_CONCURRENT,
    UNIT,
    Gateway,
    Stacks,
    TlsGateway,
    page_problems,
    wait_until,
)

MODEL = "orchard-demo"
RUNNER = "test-runner"
ARTIFACTS = REPO / "artifacts"
CLIENT_PAGE = "/static/orchard.js"
"""The JS-client tests run on the gateway's origin without the console's own socket."""
MS = 1000 * UNIT
"""Playwright counts in milliseconds."""

USAGE_LINE = re.compile(
    r"prompt (?P<prompt>\d+)\s+completion (?P<completion>\d+)\s+cached (?P<cached>\d+)\s+"
    r"reasoning (?P<reasoning>\d+)\s+tok/s (?P<rate>[\d,]+\.\d|n/a)\s+finish (?P<finish>\w+)"
)


@pytest.fixture(scope="module")
def gateway(stacks: Stacks) -> Gateway:
    return stacks.get()[0]


@pytest.fixture(scope="module", autouse=True)
def _expect_timeout() -> None:
    expect.set_options(timeout=15 * MS)


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page at 1280 x 800 that fails the test on any script error or console error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(15 * MS)
    problems = page_problems(page)
    yield page
    context.close()
    assert not problems, problems


def open_console(page: Page, base: str) -> None:
    served = httpx.get(f"{base}/", timeout=5 * UNIT)
    kind = served.headers.get("content-type", "")
    # Otherwise Chromium downloads the page and goto() fails with "Download is starting".
    assert kind.startswith("text/html"), f"GET / is served as {kind!r}, not text/html"
    page.goto(f"{base}/")


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / name)


def runner_state(gateway: Gateway) -> dict[str, Any]:
    (runner,) = [r for r in gateway.runners() if r["name"] == RUNNER]
    return runner


def usage_of(page: Page, message: int) -> re.Match[str]:
    """The parsed usage line under the `message`-th answer (negative counts from the end)."""
    text = page.locator(".message.assistant").nth(message).locator(".usage").inner_text()
    found = USAGE_LINE.search(text)
    assert found, f"usage line {text!r} does not match {USAGE_LINE.pattern}"
    return found


# Records the last answer's text length at each DOM change, and whether its usage line was
# showing, so the test sees the stream as the page saw it rather than by polling.
WATCH_ANSWER = """() => {
  window.answerLengths = [];
  const conversation = document.querySelector("#conversation");
  new MutationObserver(() => {
    const messages = conversation.querySelectorAll(".message.assistant");
    const last = messages[messages.length - 1];
    if (!last) return;
    window.answerLengths.push({
      length: last.querySelector(".answer").textContent.length,
      done: !last.querySelector(".usage").hidden,
    });
  }).observe(conversation, { subtree: true, childList: true, characterData: true });
}"""


def test_console_pool_view_chat_and_stop(page: Page, gateway: Gateway) -> None:
    open_console(page, gateway.base)
    expect(page.locator("#connection")).to_have_attribute("data-status", "open")
    row = check_pool_view(page, gateway)
    first = check_streamed_answer(page, gateway, row)
    screenshot(page, "console.png")
    check_stop(page, gateway, row, first)
    screenshot(page, "console-stopped.png")

    # New chat: the history is gone, so the same first message costs the same prompt.
    page.click("#new-chat")
    expect(page.locator("#conversation .message")).to_have_count(0)
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Hello, orchard!")
    page.press("#prompt", "Enter")
    expect(page.locator(".message.assistant")).to_have_attribute("data-finish", "length")
    assert usage_of(page, 0)["prompt"] == first["prompt"]


def check_pool_view(page: Page, gateway: Gateway) -> Locator:
    """The live pool view lists the runner with its numbers; returns its table row."""
    row = page.locator(f'#runners tbody tr[data-runner-name="{RUNNER}"]')
    expect(row).to_be_visible()
    hardware = runner_state(gateway)["hardware"]
    cell = row.locator("[data-col=hardware]")
    expect(cell).to_contain_text(hardware["chip"])
    expect(cell).to_contain_text(hardware["backend"])
    expect(cell).to_contain_text(f"{round(hardware['memory_bytes'] / 2**30)} GiB")
    expect(row.locator("[data-col=models]")).to_have_text(MODEL)
    expect(row.locator("[data-col=active]")).to_have_text(f"0 / {SHARED_MAX_CONCURRENT}")
    expect(row.locator("[data-col=tokens-per-second]")).to_have_text(re.compile(r"^[\d,]+\.\d$"))
    expect(page.locator("#runner-count")).to_have_text("1")
    expect(page.locator("#in-flight")).to_have_text("0")
    expect(page.locator("#queue-depth")).to_have_text("0")
    return row


def check_streamed_answer(page: Page, gateway: Gateway, row: Locator) -> re.Match[str]:
    """A first message: the answer streams in, then the usage line; returns the usage."""
    page.select_option("#model", MODEL)
    page.fill("#max-tokens", "64")
    page.evaluate(WATCH_ANSWER)
    page.fill("#prompt", "Hello, orchard!")
    page.click("#send")
    answer = page.locator(".message.assistant").last
    expect(answer).to_have_attribute("data-finish", "length")
    expect(answer.locator(".usage")).to_be_visible()
    observed: list[dict[str, Any]] = page.evaluate("window.answerLengths")
    streaming = {o["length"] for o in observed if not o["done"] and o["length"] > 0}
    assert len(streaming) >= 2, f"the answer did not grow token by token: {observed}"
    assert answer.locator(".answer").inner_text().strip()
    usage = usage_of(page, -1)
    assert usage["finish"] == "length"
    assert int(usage["completion"]) == 64  # the built-in model never ends by itself
    assert int(usage["prompt"]) > 0
    assert usage["rate"] != "n/a"
    # The runner's total follows on a later pool.state.
    expect(row.locator("[data-col=tokens-generated]")).to_have_text(
        f"{runner_state(gateway)['tokens_generated']:,}"
    )
    return usage


def check_stop(page: Page, gateway: Gateway, row: Locator, first: re.Match[str]) -> None:
    """A second, long message (the conversation so far goes with it), stopped mid-stream."""
    page.fill("#max-tokens", "1800")
    page.fill("#prompt", "Tell me more.")
    page.click("#send")
    expect(page.locator("#stop")).to_be_enabled()
    expect(row.locator("[data-col=active]")).to_have_text(f"1 / {SHARED_MAX_CONCURRENT}")
    expect(page.locator("#in-flight")).to_have_text("1")
    page.wait_for_function(  # live tokens per second while it generates
        """() => parseFloat(document.querySelector(
            '#runners tr[data-runner-name="test-runner"] [data-col=tokens-per-second]'
        ).textContent.replace(/,/g, "")) > 0"""
    )
    answer = page.locator(".message.assistant").last
    assert answer.get_attribute("data-finish") is None, "the answer ended before Stop"
    screenshot(page, "console-streaming.png")
    page.click("#stop")
    expect(answer).to_have_attribute("data-finish", "cancelled")
    expect(answer).to_have_class(re.compile(r"\bstopped\b"))
    expect(answer.locator(".badge")).to_have_text("stopped")
    usage = usage_of(page, -1)
    assert usage["finish"] == "cancelled"
    assert 0 < int(usage["completion"]) < 1800
    assert int(usage["prompt"]) > int(first["prompt"]) + 64  # the history was sent
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    wait_until(lambda: runner_state(gateway)["active"] == 0, 10, "the runner to free its slot")
    expect(row.locator("[data-col=active]")).to_have_text(f"0 / {SHARED_MAX_CONCURRENT}")


# Two requests at once on one socket, an error, and ping, through the module's public API.
CLIENT_SCRIPT = """async () => {
  const { OrchardClient } = await import("/static/orchard.js");
  const client = new OrchardClient();
  const arrivals = [];
  const run = async (content, maxTokens) => {
    const completion = client.create({
      model: "orchard-demo", messages: [{ role: "user", content }], max_tokens: maxTokens,
    });
    const chunks = [];
    for await (const chunk of completion) {  // the object itself iterates its chunks
      chunks.push(chunk);
      arrivals.push(completion.requestId);
    }
    return { requestId: completion.requestId, chunks, done: await completion.usage };
  };
  const [a, b] = await Promise.all([run("first", 12), run("second", 20)]);

  const bad = client.create({ model: "no-such-model", messages: [{ role: "user", content: "x" }] });
  let error = null, iteratorError = null;
  try { await bad.usage; } catch (err) { error = { name: err.name, error: err.error }; }
  try { for await (const _ of bad.chunks) {} } catch (err) { iteratorError = err.error.code; }

  const rtt = await client.ping();
  client.close();
  return { a, b, arrivals, error, iteratorError, rtt };
}"""


def check_stream(run: dict[str, Any], max_tokens: int) -> str:
    """The chunks of one request are a well-formed OpenAI stream; returns its text."""
    chunks = run["chunks"]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
        "refusal": None,
    }
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert run["done"]["finishReason"] == "length"
    usage = run["done"]["usage"]
    assert usage["completion_tokens"] == max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens", "audio_tokens"}
    assert set(usage["completion_tokens_details"]) == {
        "reasoning_tokens",
        "audio_tokens",
        "accepted_prediction_tokens",
        "rejected_prediction_tokens",
    }
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_js_client_concurrent_requests_error_and_ping(page: Page, gateway: Gateway) -> None:
    page.goto(f"{gateway.base}{CLIENT_PAGE}")
    result = page.evaluate(CLIENT_SCRIPT)
    a, b = result["a"], result["b"]
    assert a["requestId"] != b["requestId"]
    assert re.fullmatch(r"[0-9a-f-]{36}", a["requestId"])  # crypto.randomUUID()
    assert a["chunks"][0]["id"] != b["chunks"][0]["id"]
    assert check_stream(a, 12)
    assert check_stream(b, 20)
    # Each chunk went to its own request's iterator, and both requests streamed.
    assert sorted(set(result["arrivals"])) == sorted([a["requestId"], b["requestId"]])
    assert result["error"]["name"] == "OrchardError"
    assert result["error"]["error"]["code"] == "model_not_found"
    assert set(result["error"]["error"]) == {"message", "type", "param", "code"}
    assert result["iteratorError"] == "model_not_found"
    assert 0 < result["rtt"] < 5 * MS


# A cancel sent right behind its create (a user pressing Stop at once): every request still
# ends with exactly one `done`, whether the cancel found it queued or generating.
CANCEL_AT_ONCE_SCRIPT = """async (waitMs) => {
  const { OrchardClient } = await import("/static/orchard.js");
  const client = new OrchardClient();
  await client.ping();  // connected, so create and cancel leave back to back
  const outcomes = [];
  for (let i = 0; i < 20; i++) {
    const completion = client.create({
      model: "orchard-demo", messages: [{ role: "user", content: "hi" }], max_tokens: 200,
    });
    completion.cancel();
    const timeout = new Promise((resolve) => setTimeout(() => resolve("no done"), waitMs));
    const ended = completion.usage.then((d) => d.finishReason, (e) => `error ${e.error.code}`);
    outcomes.push(await Promise.race([ended, timeout]));
    if (outcomes[i] !== "cancelled") break;
  }
  client.close();
  return outcomes;
}"""


def test_js_client_cancel_right_after_create(page: Page, gateway: Gateway) -> None:
    page.goto(f"{gateway.base}{CLIENT_PAGE}")
    assert page.evaluate(CANCEL_AT_ONCE_SCRIPT, 5 * MS) == ["cancelled"] * 20
    wait_until(lambda: runner_state(gateway)["active"] == 0, 10, "the runner to free its slots")


# The socket drops under a request: it fails with "connection lost", a request made while
# disconnected waits and runs after the reconnect, and the pool subscription comes back.
RECONNECT_SCRIPT = """async (waitMs) => {
  const { OrchardClient } = await import("/static/orchard.js");
  const statuses = [];
  const client = new OrchardClient(undefined, { onStatus: (s) => statuses.push(s) });
  let states = 0;
  client.subscribePool(() => { states++; });
  const body = (maxTokens) => ({
    model: "orchard-demo", messages: [{ role: "user", content: "hi" }], max_tokens: maxTokens,
  });
  const long = client.create(body(1800));
  await long.chunks.next();  // it is streaming
  client.socket.close();
  const queued = client.create(body(5));
  let lost = null;
  try { await long.usage; } catch (err) { lost = err.error; }
  const statesBefore = states;
  const done = await queued.usage;
  const deadline = Date.now() + waitMs;
  while (states === statesBefore && Date.now() < deadline) {
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  client.close();
  return { lost, done, statuses, resubscribed: states > statesBefore };
}"""


def test_js_client_reconnects(page: Page, gateway: Gateway) -> None:
    page.goto(f"{gateway.base}{CLIENT_PAGE}")
    result = page.evaluate(RECONNECT_SCRIPT, 5 * MS)
    assert result["lost"]["message"] == "connection lost"
    assert result["lost"]["code"] == "connection_lost"
    assert result["done"]["finishReason"] == "length"
    assert result["done"]["usage"]["completion_tokens"] == 5
    assert result["statuses"] == ["open", "connecting", "open", "closed"]
    assert result["resubscribed"]
    # The gateway cancelled the request of the socket that went away.
    wait_until(lambda: runner_state(gateway)["active"] == 0, 10, "the runner to free its slot")


API_KEY = "console-test-key"


@pytest.fixture(scope="module")
def keyed_gateway() -> Iterator[Gateway]:
    """A gateway that wants an API key (no runner: only the socket's auth is under test)."""
    gw = Gateway("--api-key", API_KEY)
    try:
        yield gw
    finally:
        gw.stop()


def test_console_asks_for_the_api_key(page: Page, keyed_gateway: Gateway) -> None:
    open_console(page, keyed_gateway.base)
    expect(page.locator("#connection")).to_have_attribute("data-status", "refused")
    expect(page.locator("#auth")).to_be_visible()
    page.fill("#api-key", "wrong-key")
    page.click("#auth button")
    expect(page.locator("#connection")).to_have_text("refused: invalid API key")
    screenshot(page, "console-api-key.png")
    page.fill("#api-key", API_KEY)
    page.click("#auth button")
    expect(page.locator("#connection")).to_have_attribute("data-status", "open")
    expect(page.locator("#auth")).to_be_hidden()
    expect(page.locator("#no-runners")).to_be_visible()  # pool.state came, authenticated
    # The key is remembered for the next visit.
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-status", "open")
    expect(page.locator("#runner-count")).to_have_text("0")


KEYED_CLIENT_SCRIPT = """async (key) => {
  const { OrchardClient } = await import("/static/orchard.js");
  const good = new OrchardClient(undefined, { apiKey: key });
  const rtt = await good.ping();
  const goodStatus = good.status;
  good.close();
  const statuses = [];
  const bad = new OrchardClient(undefined, { apiKey: "wrong", onStatus: (s) => statuses.push(s) });
  const body = { model: "orchard-demo", messages: [{ role: "user", content: "hi" }] };
  let first = null, later = null;
  try { await bad.create(body).usage; } catch (err) { first = err.error; }
  try { await bad.create(body).usage; } catch (err) { later = err.error; }
  bad.close();
  return { rtt, goodStatus, statuses, first, later };
}"""


def test_js_client_authenticates(page: Page, keyed_gateway: Gateway) -> None:
    page.goto(f"{keyed_gateway.base}{CLIENT_PAGE}")
    result = page.evaluate(KEYED_CLIENT_SCRIPT, API_KEY)
    assert result["rtt"] > 0
    assert result["goodStatus"] == "open"
    # A wrong key is final: the request fails, and later ones at once, with no retry loop.
    assert result["statuses"] == ["refused", "closed"]
    assert result["first"] == {
        "message": "invalid API key",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert result["later"] == result["first"]


def test_console_is_served(gateway: Gateway) -> None:
    """`/` is an HTML page a browser shows (not a download), and the module is JavaScript."""
    page = httpx.get(f"{gateway.base}/", timeout=5 * UNIT)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "attachment" not in page.headers.get("content-disposition", "")
    module = httpx.get(f"{gateway.base}/static/orchard.js", timeout=5 * UNIT)
    assert module.headers["content-type"].startswith("text/javascript")


def await_a_bucket_without_first_tokens(gateway: Gateway) -> None:
    """Wait (at most a bucket's time) until the pool history's current bucket holds no first
    token for the runner: requests sent then are the only ones in the buckets they land in,
    whatever other tests sent before (the stack is shared)."""
    with ws_connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        ws.send(orjson.dumps({"type": "pool.subscribe"}).decode())
        deadline = time.monotonic() + 30 * UNIT
        while time.monotonic() < deadline:
            state = orjson.loads(ws.recv(timeout=10 * UNIT))
            if state["type"] != "pool.state":
                continue
            series = state["history"]["runners"].get(RUNNER)
            if series is None or series["ttft_p50_ms"][-1] is None:
                return
        raise AssertionError("the pool history's current bucket never came without a TTFT")


def test_console_charts_the_last_minutes(page: Page, gateway: Gateway) -> None:
    open_console(page, gateway.base)
    expect(page.locator("#connection")).to_have_attribute("data-status", "open")
    # Requests while the console watches; the gateway's TTFT is within what the client saw.
    await_a_bucket_without_first_tokens(gateway)
    slowest = 0.0
    with httpx.Client(timeout=30 * UNIT) as client:
        for i in range(3):
            started = time.perf_counter()
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Chart me {i}"}],
                "max_tokens": 12,
                "stream": True,
            }
            with client.stream("POST", f"{gateway.base}/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                slowest = max(slowest, time.perf_counter() - started)
                for _ in lines:
                    pass
    # Charted from a pool.state sent after the requests: one that counts their tokens (the
    # table and the charts are drawn from the same message).
    row = page.locator(f'#runners tbody tr[data-runner-name="{RUNNER}"]')
    expect(row.locator("[data-col=tokens-generated]")).to_have_text(
        f"{runner_state(gateway)['tokens_generated']:,}"
    )
    tps = page.locator(f'#chart-tps polyline[data-series="{RUNNER}:tokens_per_second"]')
    expect(tps).to_have_count(1)
    p50 = page.locator(f'#chart-ttft polyline[data-series="{RUNNER}:ttft_p50_ms"]')
    expect(p50.first).to_have_attribute("data-last", re.compile(r"^\d"))
    assert 0 < float(p50.first.get_attribute("data-last") or 0) <= slowest * 1000
    dashed = page.locator(f'#chart-ttft polyline[data-series="{RUNNER}:ttft_p99_ms"]').first
    assert dashed.get_attribute("stroke-dasharray") == "5 4"
    # The runner's tokens show as a rate above zero in some bucket of the chart.
    wait_until(
        lambda: any(float(y) < 136 for y in _ys(tps.get_attribute("points") or "")),
        10,
        "a token rate above zero",
    )
    legend = page.locator(f'#trend-legend li[data-name="{RUNNER}"]')
    expect(legend).to_contain_text("TTFT p50")
    # Per model: the same charts, a line per model.
    page.check('input[name="trend-by"][value="models"]')
    expect(
        page.locator(f'#chart-tps polyline[data-series="{MODEL}:tokens_per_second"]')
    ).to_have_count(1)
    expect(page.locator(f'#trend-legend li[data-name="{MODEL}"]')).to_be_visible()
    screenshot(page, "console-trends.png")


def _ys(points: str) -> list[str]:
    """The y coordinates of an SVG polyline's points (136 is the chart's zero line)."""
    return [pair.split(",")[1] for pair in points.split()]


def test_console_over_tls_shows_the_certificates_fingerprint(
    browser: Browser, tmp_path: Path
) -> None:
    gateway = TlsGateway(tmp_path / "tls")
    # The person has accepted the certificate in the browser (or trusts its authority's file).
    context = browser.new_context(ignore_https_errors=True)
    try:
        page = context.new_page()
        problems = page_problems(page)
        page.goto(f"{gateway.base}/")
        expect(page.locator("#connection")).to_have_attribute("data-status", "open")
        shown = certificate_fingerprint(gateway.ca)  # the authority, what people trust
        tls = page.locator("#tls")
        expect(tls).to_have_attribute("data-fingerprint", shown)
        expect(tls).to_have_text(f"TLS {shown[:11]}…")
        assert not problems, problems
    finally:
        context.close()
        gateway.process.stop()
