"""Faults over real sockets, processes frozen, restarted and drained: a frozen runner dropped
then rejoining, a gateway killed and restarted getting every runner back (503 until then),
and SIGTERM draining a runner or a gateway while clients stream."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
from typing import Any, cast

import httpx
import openai
import pytest

from runner.client import BACKOFF_MAX, BACKOFF_MIN
from tests.e2e.faults.harness import (
    MODEL,
    PROMPT,
    Cluster,
    Reply,
    Tasks,
    absent,
    body,
    ended,
    eventually,
    expected,
    first_tokens,
    kill,
    listed,
    runner,
    runner_is,
    stream_chat,
)
from tests.support import UNIT, Gateway, Process, secs

pytestmark = pytest.mark.timeout(int(120 * UNIT))


def printed(proc: Process) -> str:
    """What a running process has printed so far. (`os.pread`: the log file's offset is
    shared with the process, which writes at it.)"""
    fd = proc.log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


async def exited(proc: Process, seconds: float) -> int:
    """The exit status of a process expected to end within `seconds`."""
    return await asyncio.to_thread(proc.proc.wait, seconds * UNIT)


# --- a frozen runner, a restarted gateway -------------------------------------------------


async def test_sigstopped_runner_is_dropped_then_rejoins(
    gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient
) -> None:
    # With 2.5 units of silence allowed, checked every 0.25 s, a frozen runner is gone
    # within 3 units.
    gw = gateway
    frozen = cluster.runner(gw, "frozen", model="solo")
    cluster.runner(gw, "steady")
    cluster.wait_listed(gw, "frozen", "steady")

    frozen.proc.send_signal(signal.SIGSTOP)
    await eventually(lambda: absent(gw, "frozen"), 3, "the frozen runner to be dropped")
    assert await listed(gw, "steady")

    frozen.proc.send_signal(signal.SIGCONT)
    await eventually(lambda: listed(gw, "frozen"), 3, "the runner to rejoin")
    reply = await stream_chat(gw, http, body(5, model="solo"), Reply())
    reply.assert_complete(5)


REFUSALS_TO_THE_CAP = math.ceil(math.log2(BACKOFF_MAX / BACKOFF_MIN))
"""Refused reconnections after which a runner's next pause is the backoff's cap: its pause
doubles from BACKOFF_MIN at each."""


async def test_gateway_killed_and_restarted_gets_all_runners_back(cluster: Cluster) -> None:
    gw = cluster.gateway()
    procs = [cluster.runner(gw, f"r{i}") for i in range(3)]
    cluster.wait_listed(gw, "r0", "r1", "r2")

    kill(gw.process)
    # Away until every runner's backoff has reached its cap (2 s, from 0.1 s doubling).
    await eventually(
        lambda: all(
            printed(proc).count("Connection refused") >= REFUSALS_TO_THE_CAP for proc in procs
        ),
        10,
        "the runners' backoff to reach its cap",
    )
    back = cluster.gateway(port=gw.port)
    took = await eventually(lambda: listed(back, "r0", "r1", "r2"), 3, "the runners to return")
    sys.stderr.write(f"runners back {took:.2f} s after the gateway\n")
    async with httpx.AsyncClient(timeout=10 * UNIT) as http:
        reply = await stream_chat(back, http, body(5), Reply())
    reply.assert_complete(5)


async def test_a_restarted_gateway_answers_503_until_its_runners_are_back(
    cluster: Cluster,
) -> None:
    """Within its start grace a gateway does not know which models will come back: a model no
    runner has registered yet is 503 model_unavailable with Retry-After (which OpenAI's SDKs
    retry), not a 404 (which they do not); after the grace, a model nobody serves is 404."""
    gw = cluster.gateway()
    away = cluster.runner(gw, "away")
    cluster.wait_listed(gw, "away")
    kill(gw.process)
    away.proc.send_signal(signal.SIGSTOP)  # kept from reconnecting until the test says so
    back = cluster.gateway("--start-grace", secs(3), port=gw.port)
    url = f"{back.base}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=10 * UNIT) as http:
        for model in (MODEL, "nobody"):
            early = await http.post(url, json=body(3, model=model, stream=False))
            assert (early.status_code, early.headers.get("retry-after")) == (503, "1")
            assert early.json()["error"]["code"] == "model_unavailable"

        # An SDK client asking now gets its answer once the runner is back: it retries 503s.
        async with openai.AsyncOpenAI(
            base_url=f"{back.base}/v1", api_key="-", max_retries=8
        ) as sdk:
            asked = asyncio.ensure_future(
                sdk.chat.completions.create(model=MODEL, messages=cast(Any, PROMPT), max_tokens=3)
            )
            await asyncio.sleep(0.2 * UNIT)
            away.proc.send_signal(signal.SIGCONT)
            answer = await asyncio.wait_for(asked, 20 * UNIT)
        assert answer.choices[0].message.content == expected(3)

        async def not_found() -> bool:
            resp = await http.post(url, json=body(3, model="nobody", stream=False))
            if resp.status_code == 503:
                return False
            assert resp.status_code == 404, resp.text
            assert resp.json()["error"]["code"] == "model_not_found"
            return True

        await eventually(not_found, 5, "the start grace to end")


# --- drain ----------------------------------------------------------------------------------


async def test_sigterm_runner_drains(
    gateway: Gateway, cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = gateway
    # The draining runner has the most free slots, so it gets both first requests.
    leaving = cluster.runner(gw, "leaving", tps=20, max_concurrent=4)
    cluster.runner(gw, "staying", tps=20, max_concurrent=2)
    cluster.wait_listed(gw, "leaving", "staying")
    tokens = 40  # 2 s per stream

    in_flight = tasks.streams(gw, http, body(tokens), 2)
    await first_tokens(in_flight, 5)
    assert (await runner(gw, "leaving"))["active"] == 2

    leaving.proc.send_signal(signal.SIGTERM)
    await eventually(
        lambda: runner_is(gw, "leaving", lambda r: r.get("draining") is True), 1, "draining"
    )
    (during,) = tasks.streams(gw, http, body(5), 1)
    await ended([during], 5)
    during.assert_complete(5)
    assert (await runner(gw, "staying"))["requests_served"] == 1

    await ended(in_flight, 10)
    for reply in in_flight:
        reply.assert_complete(tokens)
    assert await exited(leaving, 10) == 0
    assert await absent(gw, "leaving")


async def _turning_away(gw: Gateway) -> bool:
    """Whether the gateway turns new clients away: /health says it drains, or nothing
    listens any more."""
    async with httpx.AsyncClient(timeout=5 * UNIT) as fresh:
        try:
            health = await fresh.get(f"{gw.base}/health")
        except httpx.ConnectError:
            return True
    return health.status_code == 503


async def test_sigterm_gateway_drains_then_runners_move_on(
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    cluster.runner(gw, "runner", tps=20)
    cluster.wait_listed(gw, "runner")
    tokens = 40  # 2 s

    (in_flight,) = tasks.streams(gw, http, body(tokens), 1)
    await first_tokens([in_flight], 5)
    gw.process.proc.send_signal(signal.SIGTERM)
    await eventually(lambda: _turning_away(gw), 5, "the gateway to drain")

    # A new request (on a new connection) is refused: 503 shutting_down, or no connection.
    async with httpx.AsyncClient(timeout=5 * UNIT) as fresh:
        try:
            resp = await fresh.post(f"{gw.base}/v1/chat/completions", json=body(3, stream=False))
        except httpx.ConnectError:
            pass
        else:
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "shutting_down"
            health = await fresh.get(f"{gw.base}/health")  # probes see the drain
            assert health.status_code == 503
            assert health.json()["status"] == "draining"

    await ended([in_flight], 10)
    in_flight.assert_complete(tokens)
    assert await exited(gw.process, 10) == 0

    # The runner reconnects to the next gateway on that address.
    nxt = cluster.gateway(port=gw.port)
    await eventually(lambda: listed(nxt, "runner"), 3, "the runner to return")
