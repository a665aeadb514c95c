"""Faults over real sockets: a gateway process and scripted runner processes that get killed,
frozen, drained and restarted while clients stream.

The scripted engine's text is deterministic ("tok0 tok1 ... "), so every answer is checked
exactly: a token lost, duplicated or reordered anywhere on the way shows up as a text
mismatch. Deadlines, product timeouts and the scripted runners' paces are in `UNIT`
(ORCHARD_TEST_TIME_FACTOR).

The tests that kill, freeze, drain, restart or reconfigure nothing of a gateway share one
for the module (`fleet`); a test's own runners on it are gone when the test ends. A test
that stops or restarts a gateway starts its own (`cluster`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import openai
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from protocol.frames import Cancel, Chunk, Generate, Heartbeat, Usage
from runner.client import BACKOFF_MAX, BACKOFF_MIN
from tests.support import (
    UNIT,
    FakeRunner,
    Gateway,
    Process,
    secs,
    sse_events,
    start_runner,
    wait_until,
)

MODEL = "scripted-m"
PROMPT = [{"role": "user", "content": "hi"}]
PROMPT_TOKENS = 2  # the scripted engine's count for PROMPT: one for the role, one per word
GATEWAY_LIVENESS = 2.5
"""The gateway's --liveness-timeout (its default), in the time unit: a runner silent this long
is dropped (checked every 0.25 s; heartbeats every second)."""
RUNNER_LIVENESS = 3.0
"""The runners' --liveness-timeout (their default), in the time unit."""
SHORT_TIMEOUTS = ("--model-grace", secs(1), "--stream-timeout", secs(1))
"""The options of the shared gateway with short timeouts (the grace and stream timeout tests)."""
BULK = "bulk-m"
"""The model of the module's bulk runners (4 of 64 slots, as fast as they go)."""
ONE_SLOT = "one-slot"
"""The model, and the name, of the module's runner of one slot at 20 tokens per second."""

pytestmark = pytest.mark.timeout(int(120 * UNIT))

T = TypeVar("T")


def expected(n: int) -> str:
    """The scripted engine's text for n tokens."""
    return "".join(f"tok{i} " for i in range(n))


def body(tokens: int, *, model: str = MODEL, stream: bool = True, **extra: Any) -> dict[str, Any]:
    req: dict[str, Any] = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": tokens,
        "stream": stream,
        **extra,
    }
    if stream:
        req.setdefault("stream_options", {"include_usage": True})
    return req


# --- processes ------------------------------------------------------------------------------


class GatewayAt(Gateway):
    """A gateway on a given port: where the runners of a gateway that went away expect one."""

    def __init__(self, port: int, *extra: str) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.process = Process(["gateway", "--port", str(port), "--log-level", "warning", *extra])
        try:
            wait_until(self._healthy, 20, "the gateway to start")
        except BaseException:
            self.process.stop()  # never leave an orphan behind
            raise


def fault_gateway(*extra: str, port: int | None = None) -> Gateway:
    """A gateway with the liveness timeout in the time unit (and `extra` options)."""
    options = ("--liveness-timeout", secs(GATEWAY_LIVENESS), *extra)
    return Gateway(*options) if port is None else GatewayAt(port, *options)


def scripted_runner(
    gw: Gateway, name: str, *, model: str = MODEL, tps: float = 0.0, max_concurrent: int = 8
) -> Process:
    """A scripted runner: `tps` tokens per second per stream in the time unit (0: as fast as
    it can)."""
    return start_runner(
        gw,
        "--engine",
        "scripted",
        "--model",
        model,
        "--tokens-per-second",
        f"{tps / UNIT:g}",
        "--max-concurrent",
        str(max_concurrent),
        "--liveness-timeout",
        secs(RUNNER_LIVENESS),
        name=name,
    )


def _wait_listed(gw: Gateway, procs: dict[str, Process]) -> None:
    """Wait until every runner of `procs` (by name) is listed; fail at once if one exited."""

    def listed() -> bool:
        for name, proc in procs.items():
            if not proc.alive():
                raise AssertionError(f"runner {name} exited:\n{proc.stop()}")
        return set(procs) <= {r["name"] for r in gw.runners()}

    wait_until(listed, 60, f"runner(s) {', '.join(procs)}")


def printed(proc: Process) -> str:
    """What a running process has printed so far. (`os.pread`: the log file's offset is
    shared with the process, which writes at it.)"""
    fd = proc.log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _report(proc: Process) -> None:
    """Stop `proc` (resumed first if frozen) and write its output to stderr, which pytest
    shows when a test fails."""
    if proc.alive():
        proc.proc.send_signal(signal.SIGCONT)
    output = proc.stop()
    sys.stderr.write(f"--- orchard {' '.join(proc.args)} (rc {proc.proc.returncode})\n")
    sys.stderr.write(output)


class Fleet:
    """The module's gateways, one per set of options (started on first use), and sets of
    scripted runners on the default one that live as long, each serving a model of its own
    (so that no other test's requests reach them). Tests on them leave them as they found
    them: `settle`, after each test, waits for every runner a test added to be gone and for
    nothing to be running or queued."""

    def __init__(self) -> None:
        self._gateways: dict[tuple[str, ...], Gateway] = {}
        self._sets: dict[str, tuple[tuple[int, float, int], list[str]]] = {}
        self._processes: list[Process] = []

    def gateway(self, *options: str) -> Gateway:
        gw = self._gateways.get(options)
        if gw is None:
            gw = fault_gateway(*options)
            self._processes.append(gw.process)
            self._gateways[options] = gw
        assert gw.process.alive(), f"a test stopped a shared gateway:\n{gw.stop()}"
        return gw

    def runners(
        self, model: str, count: int, *, tps: float = 0.0, max_concurrent: int = 8
    ) -> list[str]:
        """The names of the set of runners serving `model` (`model` itself for one, else
        `model-0`, ...): started on first use, on the default gateway."""
        config = (count, tps, max_concurrent)
        if model in self._sets:
            started, names = self._sets[model]
            assert started == config, f"runners of {model} asked for as {config}, not {started}"
            return names
        gw = self.gateway()
        names = [model] if count == 1 else [f"{model}-{i}" for i in range(count)]
        procs = {
            name: scripted_runner(gw, name, model=model, tps=tps, max_concurrent=max_concurrent)
            for name in names
        }
        self._processes += procs.values()
        _wait_listed(gw, procs)
        self._sets[model] = (config, names)
        return names

    def settle(self) -> None:
        """Wait until each gateway lists only the fleet's runners, none busy, nothing queued."""
        ours = {name for _, names in self._sets.values() for name in names}
        for gw in self._gateways.values():

            def settled(gw: Gateway = gw) -> bool:
                state = httpx.get(f"{gw.base}/v1/runners", timeout=5 * UNIT).json()
                found = state["data"]
                return (
                    {r["name"] for r in found} <= ours
                    and all(r["active"] == 0 for r in found)
                    and state["queue_depth"] == 0
                )

            wait_until(settled, 10, "the shared gateway to be left as it was found")

    def close(self) -> None:
        for proc in reversed(self._processes):
            _report(proc)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(autouse=True)
def _settled(fleet: Fleet) -> Iterator[None]:
    """Set up before, so torn down after, every other fixture of a test."""
    yield
    fleet.settle()


@pytest.fixture
def gateway(fleet: Fleet) -> Gateway:
    """The module's default gateway."""
    return fleet.gateway()


class Cluster:
    """The processes of one test (its own gateways, and its own runners on any gateway); all
    stopped at teardown (frozen ones resumed first) and their output written to stderr."""

    def __init__(self) -> None:
        self.processes: list[Process] = []
        self.named: dict[str, Process] = {}

    def gateway(self, *extra: str, port: int | None = None) -> Gateway:
        gw = fault_gateway(*extra, port=port)
        self.processes.append(gw.process)
        return gw

    def runner(
        self,
        gw: Gateway,
        name: str,
        *,
        model: str = MODEL,
        tps: float = 0.0,
        max_concurrent: int = 8,
    ) -> Process:
        """A scripted runner (see `scripted_runner`)."""
        proc = scripted_runner(gw, name, model=model, tps=tps, max_concurrent=max_concurrent)
        self.processes.append(proc)
        self.named[name] = proc
        return proc

    def wait_listed(self, gw: Gateway, *names: str) -> None:
        """Wait for the test's runners `names` to be listed on `gw`."""
        _wait_listed(gw, {name: self.named[name] for name in names})

    def close(self) -> None:
        for proc in reversed(self.processes):
            _report(proc)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=30 * UNIT, limits=limits) as client:
        yield client


async def exited(proc: Process, seconds: float) -> int:
    """The exit status of a process expected to end within `seconds`."""
    return await asyncio.to_thread(proc.proc.wait, seconds * UNIT)


def kill(proc: Process) -> None:
    proc.proc.kill()
    proc.proc.wait()


# --- HTTP and WebSocket clients -----------------------------------------------------------


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], seconds: float, what: str
) -> float:
    """Poll `check` until true (an unreachable gateway counts as false); the seconds taken."""
    started = time.monotonic()
    deadline = started + seconds * UNIT
    while time.monotonic() < deadline:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {seconds * UNIT:.1f} s waiting for {what}")


async def pool_state(gw: Gateway) -> dict[str, Any]:
    """`/v1/runners` (on a fresh connection: the gateway may have restarted)."""
    async with httpx.AsyncClient(timeout=5 * UNIT) as client:
        resp = await client.get(f"{gw.base}/v1/runners")
    state: dict[str, Any] = resp.json()
    return state


async def runners(gw: Gateway) -> dict[str, dict[str, Any]]:
    """The runners of `/v1/runners` by name."""
    return {r["name"]: r for r in (await pool_state(gw))["data"]}


async def runner(gw: Gateway, name: str) -> dict[str, Any]:
    return (await runners(gw))[name]


async def listed(gw: Gateway, *names: str) -> bool:
    """Whether every one of `names` is listed (none given: whether the pool is empty)."""
    present = set(await runners(gw))
    return present >= set(names) if names else not present


async def absent(gw: Gateway, name: str) -> bool:
    return name not in await runners(gw)


async def runner_is(gw: Gateway, name: str, check: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether runner `name` is listed and passes `check`."""
    info = (await runners(gw)).get(name)
    return info is not None and check(info)


@dataclasses.dataclass
class Reply:
    """What a client saw of one chat completion."""

    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    """`data: [DONE]` seen."""
    after_done: int = 0
    """Events after `[DONE]` (must be 0)."""
    first_token: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    progressed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set at each piece of text (cleared by whoever waits for the next)."""
    ended_at: float = 0.0

    async def seen(self, tokens: int) -> None:
        """Wait until `tokens` scripted tokens of text have come."""
        while self.text.count("tok") < tokens:
            self.progressed.clear()
            await self.progressed.wait()

    def assert_complete(self, tokens: int) -> None:
        """A normal, whole answer of `tokens` scripted tokens."""
        assert self.status == 200, (self.status, self.error)
        assert self.error is None, self.error
        assert self.text == expected(tokens)
        assert self.finish_reason == "length"
        assert self.usage is not None
        assert self.usage["completion_tokens"] == tokens
        assert self.usage["prompt_tokens"] == PROMPT_TOKENS
        assert self.done
        assert self.after_done == 0

    def assert_failed_mid_stream(self, code: str) -> None:
        """An SSE error event with `code` after some (exact, in-order) text, then [DONE]."""
        assert self.status == 200
        assert self.error is not None
        assert self.error["code"] == code, self.error
        assert self.text
        assert expected(10_000).startswith(self.text), self.text[-100:]
        assert self.finish_reason is None
        assert self.done
        assert self.after_done == 0


async def stream_chat(
    gw: Gateway, http: httpx.AsyncClient, req: dict[str, Any], reply: Reply
) -> Reply:
    """Stream one chat completion over SSE into `reply` (created by the caller, so that it can
    watch `first_token` while the stream runs)."""
    async with http.stream("POST", f"{gw.base}/v1/chat/completions", json=req) as resp:
        reply.status = resp.status_code
        if resp.status_code != 200:
            reply.error = orjson.loads(await resp.aread())["error"]
            reply.ended_at = time.monotonic()
            return reply
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if reply.done:
                reply.after_done += 1
            elif payload == "[DONE]":
                reply.done = True
            else:
                _absorb(reply, orjson.loads(payload))
    reply.ended_at = time.monotonic()
    return reply


def _absorb(reply: Reply, event: dict[str, Any]) -> None:
    if "error" in event:
        reply.error = event["error"]
        return
    if event.get("usage"):
        reply.usage = event["usage"]
    for choice in event["choices"]:
        if content := choice["delta"].get("content"):
            reply.text += content
            reply.first_token.set()
            reply.progressed.set()
        if choice["finish_reason"]:
            reply.finish_reason = choice["finish_reason"]


class Tasks:
    """Background client tasks and connections of one test: at teardown the tasks are
    cancelled and the connections closed, even when the test failed half-way."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []
        self.closers: list[Callable[[], Awaitable[None]]] = []

    def closing(self, close: Callable[[], Awaitable[None]]) -> None:
        self.closers.append(close)

    def start(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self.tasks.append(task)
        return task

    def streams(
        self, gw: Gateway, http: httpx.AsyncClient, req: dict[str, Any], count: int
    ) -> list[Reply]:
        replies = [Reply() for _ in range(count)]
        for reply in replies:
            self.start(stream_chat(gw, http, req, reply))
        return replies

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for close in reversed(self.closers):
            await close()


@pytest.fixture
async def tasks() -> AsyncIterator[Tasks]:
    t = Tasks()
    try:
        yield t
    finally:
        await t.close()


async def first_tokens(replies: list[Reply], seconds: float) -> None:
    async with asyncio.timeout(seconds * UNIT):
        for reply in replies:
            await reply.first_token.wait()


async def ended(replies: list[Reply], seconds: float) -> None:
    await eventually(lambda: all(r.ended_at for r in replies), seconds, "the streams to end")


async def ws_send(ws: ClientConnection, obj: dict[str, Any]) -> None:
    await ws.send(orjson.dumps(obj), text=True)


async def ws_recv(ws: ClientConnection) -> dict[str, Any]:
    msg: dict[str, Any] = orjson.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
    return msg


def ws_create(rid: str, tokens: int, model: str = MODEL) -> dict[str, Any]:
    return {
        "type": "chat.completions.create",
        "request_id": rid,
        "body": {"model": model, "messages": PROMPT, "max_tokens": tokens},
    }


def ws_content(msg: dict[str, Any]) -> str:
    choices = msg["chunk"]["choices"]
    return "".join(c["delta"].get("content") or "" for c in choices)


# --- a runner that dies ---------------------------------------------------------------------


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
    await _generate(fake)  # the fake has the most free slots
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
    tasks.start(_heartbeats(fake))
    ws = await connect(f"ws://127.0.0.1:{gw.port}/v1/ws")
    tasks.closing(ws.close)
    generates: list[Generate] = []
    last_words: list[float] = []
    """When each request's one chunk was sent (just before)."""

    async def first_chunk() -> None:
        generate = await _generate(fake)
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
    cancels = {await _cancelled(fake) for _ in generates}
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


async def _cancelled(fake: FakeRunner, seconds: float = 1) -> str:
    """The request id of the next Cancel the fake runner gets within `seconds`."""
    try:
        frame = await asyncio.wait_for(fake.next_request(), seconds * UNIT)
    except TimeoutError:
        raise AssertionError(f"the runner got no Cancel within {seconds} s") from None
    assert isinstance(frame, Cancel), frame
    return frame.request_id


async def _generate(fake: FakeRunner) -> Generate:
    """The next Generate the fake runner gets (within 5 s: heartbeats would keep
    `next_request` waiting forever)."""
    try:
        frame = await asyncio.wait_for(fake.next_request(), 5 * UNIT)
    except TimeoutError:
        raise AssertionError("the runner got no Generate within 5 s") from None
    assert isinstance(frame, Generate), frame
    return frame


async def _heartbeats(fake: FakeRunner) -> None:
    while True:
        await fake.send(Heartbeat(time.time()))
        await asyncio.sleep(GATEWAY_LIVENESS / 5 * UNIT)


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


# --- cancellation ---------------------------------------------------------------------------


@pytest.fixture
def one_slot(fleet: Fleet) -> str:
    """The module's runner of one slot at 20 tokens per second (its name and model)."""
    (name,) = fleet.runners(ONE_SLOT, 1, tps=20, max_concurrent=1)
    return name


async def test_sse_disconnect_stops_generation_and_frees_the_slot(
    gateway: Gateway, one_slot: str, http: httpx.AsyncClient
) -> None:
    gw = gateway
    before = await runner(gw, one_slot)

    req = body(1000, model=one_slot)
    async with http.stream("POST", f"{gw.base}/v1/chat/completions", json=req) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += '"content":"tok' in line
            if seen == 3:
                break
    # The connection is closed (the body was not read to its end); the slot must be free
    # for the next request at once.
    started = time.monotonic()
    nxt = await asyncio.wait_for(
        http.post(f"{gw.base}/v1/chat/completions", json=body(3, model=one_slot, stream=False)),
        5 * UNIT,
    )
    assert nxt.status_code == 200
    assert nxt.json()["choices"][0]["message"]["content"] == expected(3)
    assert time.monotonic() - started < 1 * UNIT

    await _assert_stopped(gw, before, cancelled=1)


async def _assert_stopped(gw: Gateway, before: dict[str, Any], *, cancelled: int) -> None:
    """The runner (as it was `before` the test) is idle, generated at most 2 tokens per
    cancelled request after the cancel, and generates nothing more."""
    name = before["name"]
    await eventually(lambda: runner_is(gw, name, lambda r: r["active"] == 0), 1, "idle")
    info = await runner(gw, name)
    late = info["tokens_after_cancel"] - before["tokens_after_cancel"]
    assert late <= 2 * cancelled, info
    await asyncio.sleep(0.3 * UNIT)  # 6 tokens' time: none may come
    assert (await runner(gw, name))["tokens_generated"] == info["tokens_generated"]


async def test_websocket_cancel_and_close_stop_generation(gateway: Gateway, one_slot: str) -> None:
    gw = gateway
    before = await runner(gw, one_slot)
    url = f"ws://127.0.0.1:{gw.port}/v1/ws"

    async with connect(url) as ws:
        await ws_send(ws, ws_create("long", 1000, model=one_slot))
        text = ""
        while text.count("tok") < 3:
            msg = await ws_recv(ws)
            assert msg["type"] == "chunk", msg
            text += ws_content(msg)
        await ws_send(ws, {"type": "cancel", "request_id": "long"})
        # The next request is sent at once; the one slot must free for it.
        started = time.monotonic()
        await ws_send(ws, ws_create("next", 3, model=one_slot))
        done: dict[str, dict[str, Any]] = {}
        texts = {"long": text, "next": ""}
        while len(done) < 2:
            msg = await ws_recv(ws)
            assert msg["type"] in ("chunk", "done"), msg
            if msg["type"] == "chunk":
                texts[msg["request_id"]] += ws_content(msg)
            else:
                done[msg["request_id"]] = msg
        assert time.monotonic() - started < 1 * UNIT
        assert done["long"]["finish_reason"] == "cancelled"
        assert expected(1000).startswith(texts["long"])
        # The usage of what was really generated: every token of it was relayed.
        assert done["long"]["usage"]["completion_tokens"] == texts["long"].count("tok")
        assert done["next"]["finish_reason"] == "length"
        assert texts["next"] == expected(3)
    await _assert_stopped(gw, before, cancelled=1)

    # Closing the socket cancels what it carried.
    async with connect(url) as ws:
        await ws_send(ws, ws_create("orphan", 1000, model=one_slot))
        text = ""
        while "tok2 " not in text:
            msg = await ws_recv(ws)
            text += ws_content(msg) if msg["type"] == "chunk" else ""
    await _assert_stopped(gw, before, cancelled=2)


# --- a stalled client -----------------------------------------------------------------------


async def test_websocket_client_too_slow_is_closed_4010(gateway: Gateway, tasks: Tasks) -> None:
    gw = gateway
    fake = await FakeRunner.connect(gw)
    tasks.closing(fake.close)
    tasks.start(_heartbeats(fake))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
    # max_queue=1: the client library reads the socket only as fast as the test takes messages.
    ws = await connect(f"ws://127.0.0.1:{gw.port}/v1/ws", sock=sock, max_size=None, max_queue=1)
    tasks.closing(ws.close)
    await ws_send(ws, ws_create("flood", 10_000, model="fake-model"))
    rid = (await _generate(fake)).request_id

    # The runner answers far faster than the client reads: 64 KiB of text per chunk, about
    # one per millisecond, against a client taking one message every 20 ms.
    stop = asyncio.Event()
    sent = [0]

    async def flood() -> None:
        text = "x" * 65536
        while not stop.is_set():
            seq = sent[0]
            await fake.send(Chunk(rid, seq, text, "", 1, Usage(PROMPT_TOKENS, seq + 1), None))
            sent[0] += 1
            await asyncio.sleep(0.001)

    async def slow_reader() -> int | None:
        try:
            while True:
                await ws.recv()
                await asyncio.sleep(0.02)
        except ConnectionClosed as closed:
            return closed.rcvd.code if closed.rcvd is not None else None

    reader = tasks.start(slow_reader())
    flooding = tasks.start(flood())
    started = time.monotonic()
    cancelled = await _cancelled(fake, 5)  # once the client's backlog passes 4 MiB
    took = time.monotonic() - started
    stop.set()
    await flooding
    assert cancelled == rid
    assert sent[0] * 65536 > 4 << 20
    assert took < 3 * UNIT, f"cancelled after {took:.1f} s, {sent[0]} chunks"
    await fake.send(Chunk(rid, sent[0], "", "", 0, Usage(PROMPT_TOKENS, sent[0]), "cancelled"))
    await eventually(lambda: runner_is(gw, "fake", lambda r: r["active"] == 0), 2, "idle")
    # The slow client, reading on, finds its socket closed as too slow.
    assert await asyncio.wait_for(reader, 5 * UNIT) == 4010


def _stalled_request(gw: Gateway, req: dict[str, Any]) -> socket.socket:
    """Send a streaming request on a raw socket with a tiny receive buffer, and read nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", gw.port))
    payload = orjson.dumps(req)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _send_buffer_max() -> int:
    """The most a TCP socket's send buffer grows to on this machine (Linux: tcp_wmem's
    maximum; macOS: net.inet.tcp.autosndbufmax)."""
    wmem = Path("/proc/sys/net/ipv4/tcp_wmem")
    if wmem.exists():
        return int(wmem.read_text().split()[2])
    found = subprocess.run(
        ["sysctl", "-n", "net.inet.tcp.autosndbufmax"], capture_output=True, check=True, text=True
    )
    return int(found.stdout)


def _read_to_end(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
    return bytes(data)


def _dechunk(body: bytes) -> bytes:
    """Decode an HTTP/1.1 chunked body."""
    out = bytearray()
    pos = 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        pos = end + 2
        if size == 0:
            return bytes(out)
        out += body[pos : pos + size]
        pos += size + 2


PACED_TOKENS = 100
"""Tokens of the firehose runner's other request, and of the stalled one's paced tail."""
FLOOD_TOKENS = 1000
"""max_tokens of the request the firehose runner floods: BIG_CHUNKS chunks of 64 KiB, then
PACED_TOKENS paced tokens."""
BIG_CHUNKS = 128
FLOOD_BYTES = BIG_CHUNKS * 65536
"""8 MiB: more than the kernel's socket buffers hold (checked) and the transport's."""


@dataclasses.dataclass
class Stalled:
    """The flooded request's progress on the firehose runner."""

    flooded: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Its 8 MiB are sent; its paced tail begins."""
    release: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Its last token may go: until then it stays in flight on the runner's socket."""
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Its last token is sent."""


async def _firehose(fake: FakeRunner, stalled: Stalled, sibling: Reply) -> None:
    """Serve the fake runner's requests: the flooded one (see FLOOD_TOKENS and `Stalled`);
    any other in lock step with `sibling`'s client: each token sent once the client has the
    one before."""
    handlers: set[asyncio.Task[None]] = set()

    async def token(rid: str, seq: int, i: int) -> None:
        last = i == PACED_TOKENS - 1
        usage = Usage(PROMPT_TOKENS, seq + 1)
        await fake.send(Chunk(rid, seq, f"tok{i} ", "", 1, usage, "length" if last else None))

    async def flood(rid: str) -> None:
        text = "x" * 65536
        for seq in range(BIG_CHUNKS):
            await fake.send(Chunk(rid, seq, text, "", 1, Usage(PROMPT_TOKENS, seq + 1), None))
        stalled.flooded.set()
        for i in range(PACED_TOKENS):
            if i == PACED_TOKENS - 1:
                await stalled.release.wait()
            await asyncio.sleep(0.01)
            await token(rid, BIG_CHUNKS + i, i)
        stalled.ended.set()

    async def lock_step(rid: str) -> None:
        for i in range(PACED_TOKENS):
            await sibling.seen(i)
            await token(rid, i, i)

    while True:
        try:
            frame = await fake.next_request()
        except TimeoutError:
            continue
        assert isinstance(frame, Generate), frame
        rid = frame.request_id
        work = flood(rid) if frame.max_tokens == FLOOD_TOKENS else lock_step(rid)
        task = asyncio.create_task(work)
        handlers.add(task)
        task.add_done_callback(handlers.discard)


async def test_stalled_client_holds_up_no_one(
    gateway: Gateway, fleet: Fleet, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = gateway
    fleet.runners(BULK, 4, max_concurrent=64)
    fake = await FakeRunner.connect(gw, models=("firehose",), name="firehose")
    tasks.closing(fake.close)
    tasks.start(_heartbeats(fake))
    stalled, sibling = Stalled(), Reply()
    tasks.start(_firehose(fake, stalled, sibling))

    # A client that reads nothing: the firehose runner sends it 8 MiB at once, then a paced
    # tail, all but its last token. The kernel holds at most the gateway's send buffer and
    # the client's receive buffer of it: the gateway holds the rest.
    sock = _stalled_request(gw, body(FLOOD_TOKENS, model="firehose"))
    try:
        held = _send_buffer_max() + sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert held < FLOOD_BYTES, f"the kernel could hold the flood here ({held} bytes)"
        async with asyncio.timeout(10 * UNIT):
            await stalled.flooded.wait()
        # Meanwhile, another request on the same runner: its tokens come behind the flood
        # on the runner's socket, each sent only once its client has the one before. And
        # 20 requests on other runners. All complete while the stalled client reads nothing
        # and its request is still in flight.
        tasks.start(stream_chat(gw, http, body(PACED_TOKENS, model="firehose"), sibling))
        await first_tokens([sibling], 5)
        others = tasks.streams(gw, http, body(100, model=BULK), 20)
        # (100 round trips take a second or two, even on a busy machine: the bound fails a
        # link that holds each frame back a tenth of a second.)
        await ended([sibling, *others], 10)
        sibling.assert_complete(PACED_TOKENS)
        for reply in others:
            reply.assert_complete(100)
        stalled.release.set()
        async with asyncio.timeout(10 * UNIT):
            await stalled.ended.wait()
        raw = await asyncio.to_thread(_read_to_end, sock, 30 * UNIT)
    finally:
        sock.close()

    # The stalled client loses nothing: it gets the whole text, in fewer, bigger chunks.
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = sse_events(_dechunk(rest))
    assert events[-1] == "[DONE]"
    texts = [c["delta"].get("content") or "" for e in events[:-1] for c in e.get("choices", [])]
    assert "".join(texts) == "x" * FLOOD_BYTES + expected(PACED_TOKENS)
    assert events[-2]["usage"]["completion_tokens"] == BIG_CHUNKS + PACED_TOKENS
    assert sum(map(bool, texts)) < BIG_CHUNKS + PACED_TOKENS, "no chunks merged"
    sys.stderr.write(f"stalled client: {len(events)} events\n")


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


# --- load -----------------------------------------------------------------------------------


async def test_256_concurrent_streams_exact(
    gateway: Gateway, fleet: Fleet, http: httpx.AsyncClient
) -> None:
    gw = gateway
    bulk = fleet.runners(BULK, 4, max_concurrent=64)
    before = await runners(gw)
    tokens, streams = 50, 256

    started = time.monotonic()
    async with asyncio.timeout(60 * UNIT):
        replies = await asyncio.gather(
            *(stream_chat(gw, http, body(tokens, model=BULK), Reply()) for _ in range(streams))
        )
    sys.stderr.write(f"{streams} streams in {time.monotonic() - started:.2f} s\n")
    for reply in replies:
        reply.assert_complete(tokens)
    after = await runners(gw)
    made = sum(after[n]["tokens_generated"] - before[n]["tokens_generated"] for n in bulk)
    assert made == tokens * streams
    assert all(after[n]["active"] == 0 for n in bulk)
