"""Faults over real sockets, a runner that dies: killed mid-stream or after its tokens (SSE,
non-streamed, WebSocket), dying or closing before its first token (the request fails over),
its model in the grace period and after it, and a stream timeout ending a silent stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from websockets.asyncio.client import connect

from protocol.frames import Generate
from tests.e2e.faults.harness import (
    PROMPT_TOKENS,
    Cluster,
    Fleet,
    Tasks,
    absent,
    body,
    ended,
    eventually,
    expected,
    first_tokens,
    kill,
    listed,
    next_cancel,
    next_generate,
    pool_state,
    runner,
    runner_is,
    runners,
    send_heartbeats,
    ws_content,
    ws_create,
    ws_recv,
    ws_send,
)
from tests.support import UNIT, FakeRunner, Gateway, secs

SHORT_TIMEOUTS = ("--model-grace", secs(1), "--stream-timeout", secs(1))
"""The options of the shared gateway with short timeouts (the grace and stream timeout tests)."""

pytestmark = pytest.mark.timeout(int(120 * UNIT))


async def test_runner_killed_mid_stream(
    gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = gateway
    doomed = cluster.runner(gw, "doomed", tps=20, max_concurrent=2)
    cluster.runner(gw, "survivor", tps=20, max_concurrent=2)
    cluster.wait_listed(gw, "doomed", "survivor")
    tokens = 40  # 2 s per stream

    # Two streams on each runner (most free slots first), all past their first token...
    running = tasks.streams(gw, http, body(tokens), 4)
    await first_tokens(running, 5)
    state = await runners(gw)
    assert (state["doomed"]["active"], state["survivor"]["active"]) == (2, 2)
    # ...and two more waiting in the queue.
    queued = tasks.streams(gw, http, body(tokens), 2)
    await eventually(lambda: _queued(gw, 2), 2, "two queued requests")

    kill(doomed)
    killed_at = time.monotonic()
    await eventually(
        lambda: sum(r.ended_at > 0 for r in running) >= 2, 2, "the killed runner's streams to end"
    )
    failed = [r for r in running if r.error is not None]
    assert len(failed) == 2, [r.error for r in running]
    for reply in failed:
        reply.assert_failed_mid_stream("runner_lost")
        assert reply.ended_at - killed_at < 2 * UNIT
    left = 3 - (time.monotonic() - killed_at) / UNIT
    await eventually(lambda: absent(gw, "doomed"), left, "the killed runner to be unlisted")

    # The survivor's own streams, and the queued requests after them, complete normally.
    await ended([*running, *queued], 15)
    for reply in [r for r in running if r.error is None] + queued:
        reply.assert_complete(tokens)
    assert (await runners(gw))["survivor"]["requests_served"] == 4


async def _queued(gw: Gateway, depth: int) -> bool:
    return bool((await pool_state(gw))["queue_depth"] == depth)


async def test_runner_lost_after_tokens_non_streaming_and_websocket(
    gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = gateway
    doomed = cluster.runner(gw, "doomed", tps=10, max_concurrent=4)
    cluster.wait_listed(gw, "doomed")

    plain = tasks.start(http.post(f"{gw.base}/v1/chat/completions", json=body(100, stream=False)))
    async with connect(f"ws://127.0.0.1:{gw.port}/v1/ws") as ws:
        await ws_send(ws, ws_create("w1", 100))
        msg = await ws_recv(ws)
        while msg["type"] != "chunk" or not ws_content(msg):
            msg = await ws_recv(ws)
        # Both requests are past their first tokens (they run side by side at one pace).
        await eventually(
            lambda: runner_is(gw, "doomed", lambda r: r["tokens_generated"] >= 8), 3, "tokens"
        )
        kill(doomed)
        killed_at = time.monotonic()
        while msg["type"] == "chunk":
            msg = await ws_recv(ws)
        assert msg["type"] == "error", msg
        assert msg["request_id"] == "w1"
        assert msg["error"]["code"] == "runner_lost"
        assert time.monotonic() - killed_at < 2 * UNIT

    resp = await asyncio.wait_for(plain, 2 * UNIT)
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "runner_lost"
    assert resp.json()["error"]["type"] == "server_error"


async def test_failover_when_runner_dies_before_first_token(
    gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = gateway
    # The slow runner has the most free slots, so it gets both requests; its first token
    # is 5 s away, and it is killed before then.
    slow = cluster.runner(gw, "slow", tps=0.2, max_concurrent=8)
    cluster.runner(gw, "fast", tps=0, max_concurrent=2)
    cluster.wait_listed(gw, "slow", "fast")

    (streamed,) = tasks.streams(gw, http, body(10), 1)
    plain = tasks.start(http.post(f"{gw.base}/v1/chat/completions", json=body(10, stream=False)))
    await eventually(
        lambda: runner_is(gw, "slow", lambda r: r["active"] == 2), 3, "both requests on slow"
    )
    kill(slow)

    await ended([streamed], 5)
    streamed.assert_complete(10)
    resp = await asyncio.wait_for(plain, 5 * UNIT)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["choices"][0]["message"]["content"] == expected(10)
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 10
    assert data["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert (await runner(gw, "fast"))["requests_served"] == 2


async def test_failover_when_runner_closes_after_generate(
    gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = gateway
    cluster.runner(gw, "real", model="fake-model", max_concurrent=1)
    cluster.wait_listed(gw, "real")
    fake = await FakeRunner.connect(gw, models=("fake-model",), max_concurrent=8, name="fake")
    tasks.closing(fake.close)
    await eventually(lambda: listed(gw, "real", "fake"), 2, "the fake runner")

    (reply,) = tasks.streams(gw, http, body(7, model="fake-model"), 1)
    await next_generate(fake)  # the fake has the most free slots
    await fake.close()  # gone without a token

    await ended([reply], 5)
    reply.assert_complete(7)
    assert (await runner(gw, "real"))["requests_served"] == 1


async def test_model_unavailable_in_grace_period_and_404_for_unknown(
    gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient
) -> None:
    gw = gateway  # default grace: 30 s
    only = cluster.runner(gw, "only", model="ephemeral")
    cluster.wait_listed(gw, "only")
    url = f"{gw.base}/v1/chat/completions"
    ok = await http.post(url, json=body(3, model="ephemeral", stream=False))
    assert ok.status_code == 200

    kill(only)
    await eventually(lambda: absent(gw, "only"), 3, "the runner to be dropped")
    for stream in (False, True):
        resp = await http.post(url, json=body(3, model="ephemeral", stream=stream))
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "model_unavailable"
        assert int(resp.headers["retry-after"]) >= 1

    resp = await http.post(url, json=body(3, model="never-seen", stream=False))
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


@pytest.fixture
def short_gateway(fleet: Fleet) -> Gateway:
    """The module's gateway with a model grace and a stream timeout of one time unit."""
    return fleet.gateway(*SHORT_TIMEOUTS)


async def test_model_grace_expires_into_404(
    short_gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient
) -> None:
    gw = short_gateway  # --model-grace: 1 unit
    only = cluster.runner(gw, "only", model="ephemeral")
    cluster.wait_listed(gw, "only")
    kill(only)
    url = f"{gw.base}/v1/chat/completions"
    await eventually(lambda: absent(gw, "only"), 3, "the runner to be dropped")
    resp = await http.post(url, json=body(3, model="ephemeral", stream=False))
    assert resp.status_code == 503

    async def forgotten() -> bool:
        resp = await http.post(url, json=body(3, model="ephemeral", stream=False))
        if resp.status_code == 503:
            return False
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "model_not_found"
        return True

    await eventually(forgotten, 3, "the model's grace to expire")


async def test_stream_timeout_ends_a_silent_stream(
    short_gateway: Gateway, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = short_gateway  # --stream-timeout: 1 unit
    fake = await FakeRunner.connect(gw)
    tasks.closing(fake.close)
    # The fake runner stays alive (heartbeats) but, after one chunk, says nothing more
    # about its requests: one over SSE, one non-streaming, one on the WebSocket API.
    tasks.start(send_heartbeats(fake))
    ws = await connect(f"ws://127.0.0.1:{gw.port}/v1/ws")
    tasks.closing(ws.close)
    generates: list[Generate] = []
    last_words: list[float] = []
    """When each request's one chunk was sent (just before)."""

    async def first_chunk() -> None:
        generate = await next_generate(fake)
        generates.append(generate)
        last_words.append(time.monotonic())
        await fake.send(FakeRunner.chunk(generate.request_id, 0, "tok0 "))

    (sse,) = tasks.streams(gw, http, body(5, model="fake-model"), 1)
    await first_chunk()
    plain = tasks.start(
        http.post(f"{gw.base}/v1/chat/completions", json=body(5, model="fake-model", stream=False))
    )
    await first_chunk()
    await ws_send(ws, ws_create("w", 5, model="fake-model"))
    await first_chunk()
    started = time.monotonic()

    msg = await ws_recv(ws)
    while msg["type"] == "chunk":
        msg = await ws_recv(ws)
    ws_ended = time.monotonic()
    assert msg["type"] == "error", msg
    assert msg["error"]["code"] == "timeout"
    resp = await asyncio.wait_for(plain, 2.5 * UNIT)
    plain_ended = time.monotonic()
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "timeout"
    # The gateway gave up on all three, and tells the runner to stop them (freeing slots).
    cancels = {await next_cancel(fake) for _ in generates}
    assert cancels == {g.request_id for g in generates}, "a timed-out request not cancelled"

    await ended([sse], max(2.5 - (time.monotonic() - started) / UNIT, 0.05))
    assert sse.text == "tok0 "
    assert sse.error is not None
    assert sse.error["code"] == "timeout"
    assert sse.done
    # None of them ended before its runner had been silent for the timeout (a timer's
    # granularity aside).
    waited = [sse.ended_at, plain_ended, ws_ended]
    for said, gave_up in zip(last_words, waited, strict=True):
        assert gave_up - said >= 0.99 * UNIT, (last_words, waited)
