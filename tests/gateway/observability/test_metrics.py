"""`GET /metrics`: Prometheus' text format, scraped over real sockets and parsed with
prometheus-client's own parser, every figure checked against what the test did.

The module's gateway runs a scripted-engine runner (model "scripted") for requests the
`openai` SDK makes, and tests connect protocol-level fake runners (model "fake-model") where
they need exact chunks, cancels and heartbeats. Counters are compared before and after each
action, so tests do not depend on their order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import GAP_EVERY
from protocol.frames import (
    Cancel,
    Chunk,
    Download,
    FinishReason,
    Generate,
    Heartbeat,
    ModelInfo,
    ModelStatus,
    Usage,
)
from tests.gateway.gateways import FAKE_RUNNERS
from tests.support import (
    UNIT,
    FakeRunner,
    Gateway,
    async_wait_until,
    secs,
    sse_events,
    start_runner,
)

KEY = "metrics-key-41d7"
AUTH = {"Authorization": f"Bearer {KEY}"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway(*FAKE_RUNNERS)
    runner = start_runner(gw, "--engine", "scripted", "--model", "scripted", name="scripted-runner")
    try:
        gw.wait_for_runners(1)
        yield gw
    finally:
        runner.stop()
        gw.stop()


@pytest.fixture(scope="module")
def keyed() -> Iterator[Gateway]:
    """Wants an API key (for /metrics too); ends a stream after half a second of silence from
    its runner. Its tests leave it without runners."""
    gw = Gateway(
        "--api-key",
        KEY,
        "--stream-timeout",
        secs(0.5),
        "--first-token-wait",
        secs(0.2),
        *FAKE_RUNNERS,
    )
    yield gw
    gw.stop()


@pytest.fixture
async def fake(gateway: Gateway) -> AsyncIterator[FakeRunner]:
    runner = await FakeRunner.connect(gateway, name="fake-runner")
    yield runner
    await runner.close()


@pytest.fixture
async def sdk(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    base = f"{gateway.base}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        yield client


async def scrape(http: httpx.AsyncClient) -> Samples:
    resp = await http.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a series not (yet) exported."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def chat(**extra: object) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_completed_chat_requests_count_with_their_usage(
    http: httpx.AsyncClient, sdk: openai.AsyncOpenAI
) -> None:
    before = await scrape(http)
    prompt = completion = 0
    for max_tokens in (3, 5, 7):
        answer = await sdk.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens
        )
        assert answer.usage is not None
        prompt += answer.usage.prompt_tokens
        completion += answer.usage.completion_tokens
    stream = await sdk.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": "a longer question"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            prompt += chunk.usage.prompt_tokens
            completion += chunk.usage.completion_tokens
    after = await scrape(http)

    assert completion == 3 + 5 + 7 + 4
    requests = "orchard_requests_total"
    assert delta(before, after, requests, model="scripted", dialect="chat", outcome="ok") == 4
    assert delta(before, after, "orchard_prompt_tokens_total", model="scripted") == prompt
    assert delta(before, after, "orchard_completion_tokens_total", model="scripted") == completion
    assert delta(before, after, "orchard_cached_prompt_tokens_total", model="scripted") == 0
    ttft = "orchard_time_to_first_token_seconds_count"
    assert delta(before, after, ttft, model="scripted") == 4
    wait = "orchard_queue_wait_seconds_count"
    assert delta(before, after, wait, model="scripted") == 4
    # At most one gap per GAP_EVERY tokens (the runner may send several tokens in one chunk;
    # test_chunks_time_and_usage_of_one_stream counts them exactly).
    gaps = "orchard_inter_token_gap_seconds_count"
    assert 0 <= delta(before, after, gaps, model="scripted") <= completion // GAP_EVERY
    assert value(after, "orchard_requests_in_flight") == 0


GAP = 0.02
"""Seconds at least between the gateway taking in a chunk and the fake sending the next."""


async def test_chunks_time_and_usage_of_one_stream(
    fake: FakeRunner, http: httpx.AsyncClient
) -> None:
    before = await scrape(http)
    relayed: asyncio.Queue[str] = asyncio.Queue()

    async def serve() -> None:
        gen = await fake.next_request()
        assert isinstance(gen, Generate)
        for seq in range(9):
            if seq > 0:  # the client has the last one: the gateway took it in before
                assert await asyncio.wait_for(relayed.get(), 10 * UNIT) == f"t{seq - 1}"
            await asyncio.sleep(GAP)
            done: FinishReason | None = "stop" if seq == 8 else None
            usage = Usage(11, seq + 1, cached_tokens=8)
            await fake.send(Chunk(gen.request_id, seq, f"t{seq}", "", 1, usage, done))

    task = asyncio.create_task(serve())
    async with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                choices = orjson.loads(line.removeprefix("data: "))["choices"]
                if choices and choices[0]["delta"].get("content"):
                    relayed.put_nowait(choices[0]["delta"]["content"])
    await task
    after = await scrape(http)

    model = "fake-model"
    ok = {"model": model, "dialect": "chat", "outcome": "ok"}
    assert delta(before, after, "orchard_requests_total", **ok) == 1
    assert delta(before, after, "orchard_prompt_tokens_total", model=model) == 11
    assert delta(before, after, "orchard_cached_prompt_tokens_total", model=model) == 8
    assert delta(before, after, "orchard_completion_tokens_total", model=model) == 9
    assert delta(before, after, "orchard_time_to_first_token_seconds_count", model=model) == 1
    ttft = delta(before, after, "orchard_time_to_first_token_seconds_sum", model=model)
    assert GAP <= ttft < 5 * UNIT
    # Sampled: the gaps before chunks 4 and 8 (GAP_EVERY), of the 8 after the first.
    assert GAP_EVERY == 4
    assert delta(before, after, "orchard_inter_token_gap_seconds_count", model=model) == 2
    gaps = delta(before, after, "orchard_inter_token_gap_seconds_sum", model=model)
    assert 2 * GAP <= gaps < 5 * UNIT  # each chunk came GAP or more after the last
    # The 5 ms bucket cannot hold a gap of GAP or more; +Inf holds them all.
    low = "orchard_inter_token_gap_seconds_bucket"
    assert delta(before, after, low, model=model, le="0.005") == 0
    assert delta(before, after, low, model=model, le="+Inf") == 2


async def test_unknown_model_counts_as_an_error(
    http: httpx.AsyncClient, sdk: openai.AsyncOpenAI
) -> None:
    before = await scrape(http)
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    after = await scrape(http)
    refused = {"model": "unknown", "dialect": "chat", "outcome": "model_not_found"}
    assert delta(before, after, "orchard_requests_total", **refused) == 1
    # The client's made-up name never becomes a label.
    assert not any(dict(labels).get("model") == "no-such-model" for _, labels in after)


async def test_client_disconnect_counts_as_cancelled(
    gateway: Gateway, fake: FakeRunner, http: httpx.AsyncClient
) -> None:
    before = await scrape(http)
    gen_seen: asyncio.Future[Generate] = asyncio.get_running_loop().create_future()

    async def serve() -> None:
        gen = await fake.next_request()
        assert isinstance(gen, Generate)
        gen_seen.set_result(gen)
        await fake.send(FakeRunner.chunk(gen.request_id, 0, "first", prompt=6))
        cancel = await fake.next_request()
        assert cancel == Cancel(gen.request_id)
        # Two more tokens were on their way when the cancel arrived.
        usage = Usage(6, 3)
        await fake.send(Chunk(gen.request_id, 1, "late", "", 2, usage, "cancelled"))

    task = asyncio.create_task(serve())
    async with (
        httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as client,
        client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as resp,
    ):
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if "first" in line:
                break  # leave with the stream running
    await asyncio.wait_for(task, 10 * UNIT)

    model = "fake-model"
    cancelled = {"model": model, "dialect": "chat", "outcome": "cancelled"}

    async def counted() -> bool:
        return delta(before, await scrape(http), "orchard_requests_total", **cancelled) == 1

    await async_wait_until(counted, 10, "the cancelled request to be counted")
    after = await scrape(http)
    ok = {"model": model, "dialect": "chat", "outcome": "ok"}
    assert delta(before, after, "orchard_requests_total", **ok) == 0
    assert delta(before, after, "orchard_cancellations_total", model=model) == 1
    assert delta(before, after, "orchard_tokens_after_cancel_total", model=model) == 2
    assert delta(before, after, "orchard_completion_tokens_total", model=model) == 3


async def test_a_silent_runner_counts_as_a_timeout(keyed: Gateway) -> None:
    runner = await FakeRunner.connect(keyed, name="silent-runner")
    async with httpx.AsyncClient(base_url=keyed.base, timeout=10 * UNIT, headers=AUTH) as http:
        try:
            before = await scrape(http)

            async def serve() -> None:
                gen = await runner.next_request()
                assert isinstance(gen, Generate)
                await runner.send(FakeRunner.chunk(gen.request_id, 0, "first"))
                cancel = await runner.next_request()  # after the stream timeout of silence
                assert cancel == Cancel(gen.request_id)
                await runner.send(Chunk(gen.request_id, 1, "", "", 0, Usage(3, 1), "cancelled"))

            task = asyncio.create_task(serve())
            resp = await http.post("/v1/chat/completions", json=chat(stream=True))
            await asyncio.wait_for(task, 10 * UNIT)
            events = sse_events(resp.content)
            assert events[1]["choices"][0]["delta"] == {"content": "first"}
            assert (events[-2]["error"]["code"], events[-1]) == ("timeout", "[DONE]")
            after = await scrape(http)
        finally:
            await runner.close()

        async def left() -> bool:
            return value(await scrape(http), "orchard_runners_connected") == 0

        await async_wait_until(left, 10, "the silent runner to leave")
    labels = {"model": "fake-model", "dialect": "chat"}
    assert delta(before, after, "orchard_requests_total", **labels, outcome="timeout") == 1
    assert delta(before, after, "orchard_requests_total", **labels, outcome="cancelled") == 0


@pytest.mark.parametrize(
    ("dialect", "path", "body"),
    [
        ("completions", "/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("responses", "/v1/responses", {"input": "hi", "max_output_tokens": 16}),
        (
            "anthropic",
            "/v1/messages",
            {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        ),
        (
            "ollama",
            "/api/chat",
            {"stream": False, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
async def test_each_dialect_has_its_label(
    http: httpx.AsyncClient, dialect: str, path: str, body: dict[str, object]
) -> None:
    before = await scrape(http)
    resp = await http.post(path, json={"model": "scripted", **body})
    assert resp.status_code == 200, resp.text
    after = await scrape(http)
    ok = {"model": "scripted", "dialect": dialect, "outcome": "ok"}
    assert delta(before, after, "orchard_requests_total", **ok) == 1
    chat_ok = {"model": "scripted", "dialect": "chat", "outcome": "ok"}
    assert delta(before, after, "orchard_requests_total", **chat_ok) == 0


async def test_runner_gauges_follow_the_pool(gateway: Gateway, http: httpx.AsyncClient) -> None:
    before = await scrape(http)
    assert value(before, "orchard_runners_connected") == len(gateway.runners()) == 1
    runner = await FakeRunner.connect(gateway, name="kv-runner", max_concurrent=3)
    try:
        await runner.send(Heartbeat(time.time(), kv_bytes=123_456, kv_limit_bytes=9_000_000))
        labels = {"runner": "kv-runner", "runner_id": runner.welcome.runner_id}

        async def reported() -> bool:
            return value(await scrape(http), "orchard_runner_kv_cache_bytes", **labels) > 0

        await async_wait_until(reported, 10, "the heartbeat's KV figures")
        during = await scrape(http)
        assert value(during, "orchard_runners_connected") == len(gateway.runners()) == 2
        assert value(during, "orchard_runner_kv_cache_bytes", **labels) == 123_456
        assert value(during, "orchard_runner_kv_cache_limit_bytes", **labels) == 9_000_000
        assert value(during, "orchard_runner_slots", **labels) == 3
        assert delta(before, during, "orchard_runner_joins_total") == 1
    finally:
        await runner.close()

    async def left() -> bool:
        return value(await scrape(http), "orchard_runners_connected") == 1

    await async_wait_until(left, 10, "the runner to leave")
    after = await scrape(http)
    assert delta(before, after, "orchard_runner_losses_total") == 1
    assert value(after, "orchard_runner_kv_cache_bytes", **labels) == 0  # its series is gone
    assert not any(name == "orchard_runner_kv_cache_bytes" for name, _ in after)


async def test_the_event_loops_tasks_rise_with_streams_and_fall_when_they_end(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    runner = await FakeRunner.connect(
        gateway, models=("tasks-model",), name="tasks-runner", max_concurrent=8
    )
    before = value(await scrape(http), "orchard_gateway_tasks")
    assert before >= 1  # the scrape's own task at least
    clients = [httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) for _ in range(5)]
    body = {**chat(model="tasks-model"), "stream": True}
    try:
        asked = [asyncio.ensure_future(c.post("/v1/chat/completions", json=body)) for c in clients]
        generates = [await runner.next_request() for _ in clients]
        during = value(await scrape(http), "orchard_gateway_tasks")
        assert during >= before + 5, (before, during)
        for generate in generates:
            await runner.send(FakeRunner.chunk(generate.request_id, 0, "x", done=True))
        for reply in asked:
            assert (await reply).status_code == 200
    finally:
        for client in clients:
            await client.aclose()
        await runner.close()

    async def settled() -> bool:
        return value(await scrape(http), "orchard_gateway_tasks") <= before

    await async_wait_until(settled, 10, "the streams' tasks to end")


async def test_models_on_demand_their_states_downloads_and_loads(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    runner = await FakeRunner.connect(
        gateway,
        name="shelf",
        infos=(
            ModelInfo("od-a", 2048, size_bytes=3_000),
            ModelInfo("od-b", None, state="loadable"),
        ),
        memory_budget_bytes=10_000,
    )
    ids = {"runner": "shelf", "runner_id": runner.welcome.runner_id}
    try:
        before = await scrape(http)
        assert value(before, "orchard_runner_memory_budget_bytes", **ids) == 10_000
        state = "orchard_runner_model_state"
        assert value(before, state, **ids, model="od-a", state="loaded") == 1
        assert value(before, state, **ids, model="od-b", state="loadable") == 1
        assert value(before, "orchard_runner_model_bytes", **ids, model="od-a") == 3_000

        await runner.send(
            ModelStatus(ModelInfo("od-b", None, state="loading", download=Download(40, 100)))
        )

        async def downloading() -> bool:
            samples = await scrape(http)
            return value(samples, state, **ids, model="od-b", state="loading") == 1

        await async_wait_until(downloading, 10, "the download to show")
        during = await scrape(http)
        assert value(during, state, **ids, model="od-b", state="loadable") == 0  # one state
        assert value(during, "orchard_runner_model_download_bytes", **ids, model="od-b") == 40
        assert value(during, "orchard_runner_model_download_size_bytes", **ids, model="od-b") == 100

        await runner.send(ModelStatus(ModelInfo("od-b", 2048, state="loaded", size_bytes=100)))
        await runner.send(ModelStatus(ModelInfo("od-a", 2048, state="loadable", size_bytes=3_000)))
        await runner.send(ModelStatus(ModelInfo("od-a", 2048, state="loading", size_bytes=3_000)))
        failed = ModelInfo("od-a", 2048, state="loadable", size_bytes=3_000, error="disk full")
        await runner.send(ModelStatus(failed))

        async def settled() -> bool:
            samples = await scrape(http)
            return value(samples, state, **ids, model="od-a", state="loadable") == 1

        await async_wait_until(settled, 10, "the failed load to show")
        after = await scrape(http)
        loads = "orchard_model_loads_total"
        assert delta(before, after, loads, model="od-b", outcome="ok") == 1
        assert delta(before, after, loads, model="od-b", outcome="failed") == 0
        assert delta(before, after, loads, model="od-a", outcome="failed") == 1
        assert delta(before, after, loads, model="od-a", outcome="ok") == 0  # unload: no load
        assert value(after, "orchard_runner_model_download_bytes", **ids, model="od-b") == 0
        assert value(after, "orchard_runner_model_bytes", **ids, model="od-b") == 100
    finally:
        await runner.close()


async def test_process_figures_and_no_openapi_entry(http: httpx.AsyncClient) -> None:
    samples = await scrape(http)
    assert value(samples, "process_resident_memory_bytes") > 1 << 20
    assert value(samples, "process_cpu_seconds_total") > 0
    assert any(name == "python_info" for name, _ in samples)
    paths = (await http.get("/schema/openapi.json")).json()["paths"]
    assert "/v1/chat/completions" in paths
    assert "/metrics" not in paths


def test_metrics_need_the_api_key_when_one_is_set(keyed: Gateway) -> None:
    assert httpx.get(f"{keyed.base}/metrics").status_code == 401
    wrong = httpx.get(f"{keyed.base}/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    good = httpx.get(f"{keyed.base}/metrics", headers=AUTH)
    assert good.status_code == 200
    assert "orchard_runners_connected 0.0" in good.text


def test_metrics_open_leaves_only_metrics_open() -> None:
    gw = Gateway("--api-key", KEY, "--metrics-open")
    try:
        resp = httpx.get(f"{gw.base}/metrics")
        assert resp.status_code == 200
        assert "orchard_runners_connected 0.0" in resp.text
        assert httpx.get(f"{gw.base}/v1/models").status_code == 401
    finally:
        gw.stop()
