"""Faults over real sockets: a gateway process and scripted runner processes that get killed,
frozen, drained and restarted while clients stream.

The scripted engine's text is deterministic ("tok0 tok1 ... "), so every answer is checked
exactly: a token lost, duplicated or reordered anywhere on the way shows up as a text
mismatch. Deadlines are multiples of `UNIT` (ORCHARD_TEST_TIME_FACTOR).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from protocol.frames import Cancel, Chunk, Generate, Heartbeat, Usage
from tests.support import (
    UNIT,
    FakeRunner,
    Gateway,
    Process,
    sse_events,
    start_runner,
    wait_until,
)

MODEL = "scripted-m"
PROMPT = [{"role": "user", "content": "hi"}]
PROMPT_TOKENS = 2  # the scripted engine's count for PROMPT: one for the role, one per word

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


class Cluster:
    """The processes of one test; all stopped at teardown (frozen ones resumed first) and
    their output written to stderr, which pytest shows when the test fails."""

    def __init__(self) -> None:
        self.processes: list[Process] = []

    def gateway(self, *extra: str, port: int | None = None) -> Gateway:
        gw = Gateway(*extra) if port is None else GatewayAt(port, *extra)
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
        """A scripted runner: `tps` tokens per second per stream (0: as fast as it can)."""
        proc = start_runner(
            gw,
            "--engine",
            "scripted",
            "--model",
            model,
            "--tokens-per-second",
            str(tps),
            "--max-concurrent",
            str(max_concurrent),
            name=name,
        )
        self.processes.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.processes):
            if proc.alive():
                proc.proc.send_signal(signal.SIGCONT)
            output = proc.stop()
            sys.stderr.write(f"--- orchard {' '.join(proc.args)} (rc {proc.proc.returncode})\n")
            sys.stderr.write(output)


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
    ended_at: float = 0.0

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
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    doomed = cluster.runner(gw, "doomed", tps=20, max_concurrent=2)
    cluster.runner(gw, "survivor", tps=20, max_concurrent=2)
    gw.wait_for_runners(2)
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
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    doomed = cluster.runner(gw, "doomed", tps=10, max_concurrent=4)
    gw.wait_for_runners(1)

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
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    # The slow runner has the most free slots, so it gets both requests; its first token
    # is 2 s away, and it is killed before then.
    slow = cluster.runner(gw, "slow", tps=0.5, max_concurrent=8)
    cluster.runner(gw, "fast", tps=0, max_concurrent=2)
    gw.wait_for_runners(2)

    (streamed,) = tasks.streams(gw, http, body(10), 1)
    plain = tasks.start(http.post(f"{gw.base}/v1/chat/completions", json=body(10, stream=False)))
    await eventually(
        lambda: runner_is(gw, "slow", lambda r: r["active"] == 2), 1.5, "both requests on slow"
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
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    cluster.runner(gw, "real", model="fake-model", max_concurrent=1)
    gw.wait_for_runners(1)
    fake = await FakeRunner.connect(gw, models=("fake-model",), max_concurrent=8, name="fake")
    await eventually(lambda: listed(gw, "real", "fake"), 2, "the fake runner")

    (reply,) = tasks.streams(gw, http, body(7, model="fake-model"), 1)
    await _generate(fake)  # the fake has the most free slots
    await fake.close()  # gone without a token

    await ended([reply], 5)
    reply.assert_complete(7)


async def test_model_unavailable_in_grace_period_and_404_for_unknown(
    cluster: Cluster, http: httpx.AsyncClient
) -> None:
    gw = cluster.gateway()  # default grace: 30 s
    only = cluster.runner(gw, "only", model="ephemeral")
    gw.wait_for_runners(1)
    url = f"{gw.base}/v1/chat/completions"
    ok = await http.post(url, json=body(3, model="ephemeral", stream=False))
    assert ok.status_code == 200

    kill(only)
    await eventually(lambda: listed(gw), 3, "the runner to be dropped")
    for stream in (False, True):
        resp = await http.post(url, json=body(3, model="ephemeral", stream=stream))
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "model_unavailable"
        assert int(resp.headers["retry-after"]) >= 1

    resp = await http.post(url, json=body(3, model="never-seen", stream=False))
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


async def test_model_grace_expires_into_404(cluster: Cluster, http: httpx.AsyncClient) -> None:
    gw = cluster.gateway("--model-grace", "1")
    only = cluster.runner(gw, "only", model="ephemeral")
    gw.wait_for_runners(1)
    kill(only)
    url = f"{gw.base}/v1/chat/completions"
    await eventually(lambda: listed(gw), 3, "the runner to be dropped")
    resp = await http.post(url, json=body(3, model="ephemeral", stream=False))
    assert resp.status_code == 503
    await asyncio.sleep(1.5)
    resp = await http.post(url, json=body(3, model="ephemeral", stream=False))
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


async def test_stream_timeout_ends_a_silent_stream(
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway("--stream-timeout", "1")
    fake = await FakeRunner.connect(gw)
    tasks.closing(fake.close)
    # The fake runner stays alive (heartbeats) but, after one chunk, says nothing more
    # about its requests: one over SSE, one non-streaming, one on the WebSocket API.
    tasks.start(_heartbeats(fake))
    ws = await connect(f"ws://127.0.0.1:{gw.port}/v1/ws")
    tasks.closing(ws.close)
    generates: list[Generate] = []

    async def first_chunk() -> None:
        generate = await _generate(fake)
        generates.append(generate)
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
    assert msg["type"] == "error", msg
    assert msg["error"]["code"] == "timeout"
    resp = await asyncio.wait_for(plain, 2.5 * UNIT)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "timeout"
    # The gateway gave up on all three, and tells the runner to stop them (freeing slots).
    cancels = {await _cancelled(fake) for _ in generates}
    assert cancels == {g.request_id for g in generates}, "a timed-out request not cancelled"

    await ended([sse], 2.5 - (time.monotonic() - started) / UNIT)
    assert sse.ended_at - started >= 0.9
    assert sse.text == "tok0 "
    assert sse.error is not None
    assert sse.error["code"] == "timeout"
    assert sse.done


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
        await asyncio.sleep(0.5)


# --- a frozen runner, a restarted gateway -------------------------------------------------


async def test_sigstopped_runner_is_dropped_then_rejoins(
    cluster: Cluster, http: httpx.AsyncClient
) -> None:
    # With the defaults (2.5 s of silence, checked every 0.25 s) a frozen runner is gone
    # within 3 s.
    gw = cluster.gateway()
    frozen = cluster.runner(gw, "frozen", model="solo")
    cluster.runner(gw, "steady")
    gw.wait_for_runners(2)

    frozen.proc.send_signal(signal.SIGSTOP)
    await eventually(lambda: absent(gw, "frozen"), 3, "the frozen runner to be dropped")
    assert await listed(gw, "steady")

    frozen.proc.send_signal(signal.SIGCONT)
    await eventually(lambda: listed(gw, "frozen"), 3, "the runner to rejoin")
    reply = await stream_chat(gw, http, body(5, model="solo"), Reply())
    reply.assert_complete(5)


async def test_gateway_killed_and_restarted_gets_all_runners_back(cluster: Cluster) -> None:
    gw = cluster.gateway()
    for i in range(3):
        cluster.runner(gw, f"r{i}")
    gw.wait_for_runners(3)

    kill(gw.process)
    # Away long enough for the runners' backoff (0.1 s doubling) to reach its 2 s cap.
    await asyncio.sleep(4)
    back = cluster.gateway(port=gw.port)
    took = await eventually(lambda: listed(back, "r0", "r1", "r2"), 3, "the runners to return")
    sys.stderr.write(f"runners back {took:.2f} s after the gateway\n")
    async with httpx.AsyncClient(timeout=10 * UNIT) as http:
        reply = await stream_chat(back, http, body(5), Reply())
    reply.assert_complete(5)


# --- cancellation ---------------------------------------------------------------------------


async def test_sse_disconnect_stops_generation_and_frees_the_slot(
    cluster: Cluster, http: httpx.AsyncClient
) -> None:
    gw = cluster.gateway()
    cluster.runner(gw, "one-slot", tps=20, max_concurrent=1)
    gw.wait_for_runners(1)

    async with http.stream("POST", f"{gw.base}/v1/chat/completions", json=body(1000)) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += '"content":"tok' in line
            if seen == 3:
                break
    # The connection is closed (the body was not read to its end); the slot must be free
    # for the next request at once.
    started = time.monotonic()
    nxt = await asyncio.wait_for(
        http.post(f"{gw.base}/v1/chat/completions", json=body(3, stream=False)), 5 * UNIT
    )
    assert nxt.status_code == 200
    assert nxt.json()["choices"][0]["message"]["content"] == expected(3)
    assert time.monotonic() - started < 1 * UNIT

    await _assert_stopped(gw, cancelled=1)


async def _assert_stopped(gw: Gateway, *, cancelled: int) -> None:
    """The runner is idle, generated at most 2 tokens per cancelled request after the
    cancel, and generates nothing more."""
    await eventually(lambda: runner_is(gw, "one-slot", lambda r: r["active"] == 0), 1, "idle")
    info = await runner(gw, "one-slot")
    assert info["tokens_after_cancel"] <= 2 * cancelled, info
    await asyncio.sleep(0.3)
    assert (await runner(gw, "one-slot"))["tokens_generated"] == info["tokens_generated"]


async def test_websocket_cancel_and_close_stop_generation(cluster: Cluster) -> None:
    gw = cluster.gateway()
    cluster.runner(gw, "one-slot", tps=20, max_concurrent=1)
    gw.wait_for_runners(1)
    url = f"ws://127.0.0.1:{gw.port}/v1/ws"

    async with connect(url) as ws:
        await ws_send(ws, ws_create("long", 1000))
        text = ""
        while text.count("tok") < 3:
            msg = await ws_recv(ws)
            assert msg["type"] == "chunk", msg
            text += ws_content(msg)
        await ws_send(ws, {"type": "cancel", "request_id": "long"})
        # The next request is sent at once; the one slot must free for it.
        started = time.monotonic()
        await ws_send(ws, ws_create("next", 3))
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
    await _assert_stopped(gw, cancelled=1)

    # Closing the socket cancels what it carried.
    async with connect(url) as ws:
        await ws_send(ws, ws_create("orphan", 1000))
        text = ""
        while "tok2 " not in text:
            msg = await ws_recv(ws)
            text += ws_content(msg) if msg["type"] == "chunk" else ""
    await _assert_stopped(gw, cancelled=2)


# --- a stalled client -----------------------------------------------------------------------


async def test_websocket_client_too_slow_is_closed_4010(cluster: Cluster, tasks: Tasks) -> None:
    gw = cluster.gateway()
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


async def _timed_batch(gw: Gateway, http: httpx.AsyncClient, tokens: int, count: int) -> float:
    """Run `count` streams of `tokens` scripted tokens at once; the seconds until the last ends."""
    started = time.monotonic()
    replies = await asyncio.gather(
        *(stream_chat(gw, http, body(tokens), Reply()) for _ in range(count))
    )
    for reply in replies:
        reply.assert_complete(tokens)
    return max(r.ended_at for r in replies) - started


async def _timed_sibling(gw: Gateway, http: httpx.AsyncClient) -> float:
    """One stream of the firehose runner's paced kind; the seconds it takes."""
    started = time.monotonic()
    reply = await stream_chat(gw, http, body(PACED_TOKENS, model="firehose"), Reply())
    reply.assert_complete(PACED_TOKENS)
    return reply.ended_at - started


PACED_TOKENS = 100
"""Tokens of a firehose-runner request answered at 100 per second."""
FLOOD_TOKENS = 1000
"""max_tokens of the request the firehose runner floods: BIG_CHUNKS chunks of 64 KiB, then
PACED_TOKENS paced tokens once told to."""
BIG_CHUNKS = 128  # 8 MiB: more than the kernel's socket buffers and the transport's hold


async def _firehose(fake: FakeRunner, flooded: asyncio.Event, trickle: asyncio.Event) -> None:
    """Serve the fake runner's requests (see PACED_TOKENS and FLOOD_TOKENS)."""
    handlers: set[asyncio.Task[None]] = set()

    async def paced(rid: str, first_seq: int) -> None:
        for i in range(PACED_TOKENS):
            await asyncio.sleep(0.01)
            seq = first_seq + i
            last = i == PACED_TOKENS - 1
            usage = Usage(PROMPT_TOKENS, seq + 1)
            await fake.send(Chunk(rid, seq, f"tok{i} ", "", 1, usage, "length" if last else None))

    async def flood(rid: str) -> None:
        text = "x" * 65536
        for seq in range(BIG_CHUNKS):
            await fake.send(Chunk(rid, seq, text, "", 1, Usage(PROMPT_TOKENS, seq + 1), None))
        flooded.set()
        await trickle.wait()
        await paced(rid, BIG_CHUNKS)

    while True:
        try:
            frame = await fake.next_request()
        except TimeoutError:
            continue
        assert isinstance(frame, Generate), frame
        rid = frame.request_id
        work = flood(rid) if frame.max_tokens == FLOOD_TOKENS else paced(rid, 0)
        task = asyncio.create_task(work)
        handlers.add(task)
        task.add_done_callback(handlers.discard)


async def test_stalled_client_slows_no_one(
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    for i in range(2):
        cluster.runner(gw, f"paced-{i}", tps=100, max_concurrent=32)
    gw.wait_for_runners(2)
    fake = await FakeRunner.connect(gw, models=("firehose",), name="firehose")
    tasks.closing(fake.close)
    tasks.start(_heartbeats(fake))
    flooded, trickle = asyncio.Event(), asyncio.Event()
    tasks.start(_firehose(fake, flooded, trickle))
    tokens, clients = 100, 20  # 1 s per stream

    async def round_() -> tuple[float, float]:
        batch = tasks.start(_timed_batch(gw, http, tokens, clients))
        sibling = tasks.start(_timed_sibling(gw, http))
        return await batch, await sibling

    await round_()  # warm-up
    alone = await round_()

    # A client that reads nothing: the firehose runner sends it 8 MiB at once, then tokens
    # at the same time as it serves another request (the sibling) and the 20 run elsewhere.
    sock = _stalled_request(gw, body(FLOOD_TOKENS, model="firehose"))
    try:
        async with asyncio.timeout(10 * UNIT):
            await flooded.wait()
        await asyncio.sleep(0.5)
        trickle.set()
        beside = await round_()
        raw = await asyncio.to_thread(_read_to_end, sock, 30 * UNIT)
    finally:
        sock.close()
    sys.stderr.write(f"{clients} streams, sibling: alone {alone}, beside a stall {beside}\n")
    assert beside[0] <= 1.5 * alone[0], f"other clients slowed: {alone[0]:.2f} → {beside[0]:.2f}"
    assert beside[1] <= 1.5 * alone[1], f"same runner slowed: {alone[1]:.2f} → {beside[1]:.2f}"

    # The stalled client loses nothing: it gets the whole text, in fewer, bigger chunks.
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = sse_events(_dechunk(rest))
    assert events[-1] == "[DONE]"
    text = "".join(
        c["delta"].get("content") or "" for e in events[:-1] for c in e.get("choices", [])
    )
    assert text == "x" * (65536 * BIG_CHUNKS) + expected(PACED_TOKENS)
    assert events[-2]["usage"]["completion_tokens"] == BIG_CHUNKS + PACED_TOKENS
    sys.stderr.write(f"stalled client: {len(events)} events\n")


# --- drain ----------------------------------------------------------------------------------


async def test_sigterm_runner_drains(
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    # The draining runner has the most free slots, so it gets both first requests.
    leaving = cluster.runner(gw, "leaving", tps=20, max_concurrent=4)
    cluster.runner(gw, "staying", tps=20, max_concurrent=2)
    gw.wait_for_runners(2)
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


async def test_sigterm_gateway_drains_then_runners_move_on(
    cluster: Cluster, http: httpx.AsyncClient, tasks: Tasks
) -> None:
    gw = cluster.gateway()
    cluster.runner(gw, "runner", tps=20)
    gw.wait_for_runners(1)
    tokens = 40  # 2 s

    (in_flight,) = tasks.streams(gw, http, body(tokens), 1)
    await first_tokens([in_flight], 5)
    gw.process.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)

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


async def test_256_concurrent_streams_exact(cluster: Cluster, http: httpx.AsyncClient) -> None:
    gw = cluster.gateway()
    for i in range(4):
        cluster.runner(gw, f"load-{i}", max_concurrent=64)
    gw.wait_for_runners(4)
    tokens, streams = 50, 256

    started = time.monotonic()
    async with asyncio.timeout(60 * UNIT):
        replies = await asyncio.gather(
            *(stream_chat(gw, http, body(tokens), Reply()) for _ in range(streams))
        )
    sys.stderr.write(f"{streams} streams in {time.monotonic() - started:.2f} s\n")
    for reply in replies:
        reply.assert_complete(tokens)
    state = await runners(gw)
    assert sum(r["tokens_generated"] for r in state.values()) == tokens * streams
    assert all(r["active"] == 0 for r in state.values())
