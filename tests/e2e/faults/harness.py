"""What the fault modules (tests/e2e/faults/) share: the scripted runners' model and text, the
processes (gateways and scripted runners: the package's `Fleet` and a test's own `Cluster`),
and the clients that watch them (SSE streams read into a `Reply`, the pool's state, WebSocket
messages, a fake runner's next frame).

The scripted engine's text is deterministic ("tok0 tok1 ... "), so every answer is checked
exactly: a token lost, duplicated or reordered anywhere on the way shows up as a text
mismatch. Deadlines, product timeouts and the scripted runners' paces are in `UNIT`
(ORCHARD_TEST_TIME_FACTOR).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import httpx
import orjson
from websockets.asyncio.client import ClientConnection

from protocol.frames import Cancel, Generate, Heartbeat
from tests.support import UNIT, FakeRunner, Gateway, Process, secs, start_runner, wait_until

MODEL = "scripted-m"
PROMPT = [{"role": "user", "content": "hi"}]
PROMPT_TOKENS = 2  # the scripted engine's count for PROMPT: one for the role, one per word
GATEWAY_LIVENESS = 2.5
"""The gateway's --liveness-timeout (its default), in the time unit: a runner silent this long
is dropped (checked every 0.25 s; heartbeats every second)."""
RUNNER_LIVENESS = 3.0
"""The runners' --liveness-timeout (their default), in the time unit."""

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


def _report(proc: Process) -> None:
    """Stop `proc` (resumed first if frozen) and write its output to stderr, which pytest
    shows when a test fails."""
    if proc.alive():
        proc.proc.send_signal(signal.SIGCONT)
    output = proc.stop()
    sys.stderr.write(f"--- orchard {' '.join(proc.args)} (rc {proc.proc.returncode})\n")
    sys.stderr.write(output)


class Fleet:
    """The package's gateways, one per set of options (started on first use), and sets of
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


async def next_cancel(fake: FakeRunner, seconds: float = 1) -> str:
    """The request id of the next Cancel the fake runner gets within `seconds`."""
    try:
        frame = await asyncio.wait_for(fake.next_request(), seconds * UNIT)
    except TimeoutError:
        raise AssertionError(f"the runner got no Cancel within {seconds} s") from None
    assert isinstance(frame, Cancel), frame
    return frame.request_id


async def next_generate(fake: FakeRunner) -> Generate:
    """The next Generate the fake runner gets (within 5 s: heartbeats would keep
    `next_request` waiting forever)."""
    try:
        frame = await asyncio.wait_for(fake.next_request(), 5 * UNIT)
    except TimeoutError:
        raise AssertionError("the runner got no Generate within 5 s") from None
    assert isinstance(frame, Generate), frame
    return frame


async def send_heartbeats(fake: FakeRunner) -> None:
    while True:
        await fake.send(Heartbeat(time.time()))
        await asyncio.sleep(GATEWAY_LIVENESS / 5 * UNIT)
