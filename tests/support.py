"""Shared test doubles and helpers: real processes on real sockets, and a protocol-level
fake runner for the cases a real engine cannot produce (errors mid-stream, rogue frames).

Timeouts are multiples of `UNIT` seconds; raise ORCHARD_TEST_TIME_FACTOR on a slow machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect

from protocol.codec import decode_gateway_frame, encode
from protocol.frames import (
    PROTOCOL_VERSION,
    Cancel,
    Chunk,
    Generate,
    Hardware,
    Heartbeat,
    Hello,
    ModelInfo,
    Usage,
    Welcome,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Page

UNIT = float(os.environ.get("ORCHARD_TEST_TIME_FACTOR", "1"))
"""The tests' time unit in seconds. Every wait of a test and every product timeout it sets is
a multiple of it, so that raising ORCHARD_TEST_TIME_FACTOR on a busy machine stretches both."""
REPO = Path(__file__).resolve().parent.parent


def secs(seconds: float) -> str:
    """A product timeout for a command line (`--stream-timeout`, `--liveness-timeout`, ...):
    `seconds` in the tests' time unit, so that a busy machine stretches it with the tests'
    own waits."""
    return f"{seconds * UNIT:g}"


def weights_bytes(directory: Path) -> int:
    """What the model's weights in `directory` (model.safetensors) take in memory."""
    import mlx.core as mx  # only for the tests that ask

    weights = cast("dict[str, mx.array]", mx.load(str(directory / "model.safetensors")))
    return sum(int(array.nbytes) for array in weights.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout * UNIT
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout * UNIT:.1f} s waiting for {what}")


def orchard_command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m orchard ARGS` run to its end from the repository, its output captured: for
    commands that are to refuse to start (exit status 2, one line on stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "orchard", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout * UNIT,
        check=False,
    )


async def async_wait_until(check: Callable[[], Awaitable[bool]], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds * UNIT
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {seconds * UNIT:.1f} s waiting for {what}")


async def recv_until_closed(ws: ClientConnection) -> None:
    """Read (and drop) frames until the peer closes; raises ConnectionClosed."""
    while True:
        await ws.recv()


class Process:
    """An `orchard` subcommand in its own process, stopped with SIGTERM (then SIGKILL)."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, *, netns: str | None = None
    ) -> None:
        self.args = args
        self._printed = ""
        self.state_dir: str | None = None
        """A gateway's own state directory (its stores' file and lock), removed at its stop:
        gateways of parallel tests never share one, and none writes ~/.orchard/state."""
        if args[0] in ("gateway", "serve") and "ORCHARD_STATE_DIR" not in (env or {}):
            self.state_dir = tempfile.mkdtemp(prefix="orchard-state-")
            env = {**(env or {}), "ORCHARD_STATE_DIR": self.state_dir}
        # A file, not a pipe: a chatty process must never block on a full pipe.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in stop()
        # In a network namespace: `ip netns exec` execs the command, so the pid is its own.
        inside = ["ip", "netns", "exec", netns] if netns else []
        self.proc = subprocess.Popen(
            [*inside, sys.executable, "-m", "orchard", *args],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> str:
        """Stop the process; returns what it printed (for failure messages). Stopping it
        again returns the same."""
        if self.log.closed:
            return self._printed
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10 * UNIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with self.log:
            self.log.seek(0)
            self._printed = self.log.read().decode(errors="replace")
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return self._printed

    def alive(self) -> bool:
        return self.proc.poll() is None


class Gateway:
    """A gateway process on a free port."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # No start grace unless a test asks for one: tests ask a fresh gateway for models no
        # runner serves and expect the 404 at once.
        grace = () if "--start-grace" in extra else ("--start-grace", "0")
        self.process = Process(
            ["gateway", "--port", str(self.port), "--log-level", "warning", *grace, *extra],
            env=env,
        )
        try:
            wait_until(self._healthy, 60, "the gateway to start")
        except BaseException:
            self.process.stop()  # never leave an orphan behind
            raise

    def _healthy(self) -> bool:
        if not self.process.alive():
            raise AssertionError(f"gateway exited:\n{self.process.stop()}")
        try:
            return httpx.get(f"{self.base}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def runners(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = httpx.get(f"{self.base}/v1/runners", timeout=5).json()["data"]
        return data

    def wait_for_runners(self, count: int, timeout: float = 60) -> None:
        wait_until(lambda: len(self.runners()) >= count, timeout, f"{count} runner(s)")

    def stop(self) -> str:
        return self.process.stop()


def start_runner(
    gateway: Gateway, *extra: str, name: str = "test-runner", env: dict[str, str] | None = None
) -> Process:
    return Process(
        ["runner", "--gateway", gateway.base, "--name", name, "--log-level", "warning", *extra],
        env=env,
    )


@contextlib.contextmanager
def gateway_with_runner(*runner_args: str) -> Iterator[tuple[Gateway, Process]]:
    gw = Gateway()
    runner = start_runner(gw, *runner_args)
    try:
        gw.wait_for_runners(1)
        yield gw, runner
    finally:
        runner.stop()
        gw.stop()


SHARED_MODEL = "orchard-demo"
KV_LIMIT = 256 * 1024 * 1024
"""The shared batched stack's --max-kv-bytes (test_openai_e2e reads it back)."""
SHARED_MAX_CONCURRENT = 8
STACK_ARGS: dict[str, tuple[str, ...]] = {
    "mlx": ("--engine", "mlx"),
    "mlx-batched": ("--engine", "mlx-batched", "--max-kv-bytes", str(KV_LIMIT)),
}
"""Each shared stack's runner arguments besides the model and --max-concurrent, by engine."""


class Stacks:
    """Gateways with a real runner on the built-in model, shared by the whole run, one per
    engine (tests/e2e/conftest.py's `stacks`): started on first use, started again if a
    process of one died."""

    def __init__(self) -> None:
        self._stacks: dict[str, tuple[Gateway, Process]] = {}

    def get(self, engine: str = "mlx-batched") -> tuple[Gateway, Process]:
        stack = self._stacks.get(engine)
        if stack is not None and not self._healthy(*stack):
            self._stop(*self._stacks.pop(engine))
            stack = None
        if stack is None:
            stack = self._start(engine)
            self._stacks[engine] = stack
        return stack

    @staticmethod
    def _start(engine: str) -> tuple[Gateway, Process]:
        gateway = Gateway()
        runner = start_runner(
            gateway,
            "--model",
            SHARED_MODEL,
            "--max-concurrent",
            str(SHARED_MAX_CONCURRENT),
            *STACK_ARGS[engine],
        )
        try:
            gateway.wait_for_runners(1)
        except BaseException:
            Stacks._stop(gateway, runner)
            raise
        return gateway, runner

    @staticmethod
    def _healthy(gateway: Gateway, runner: Process) -> bool:
        if not (gateway.process.alive() and runner.alive()):
            return False
        try:
            return len(gateway.runners()) == 1
        except httpx.HTTPError:
            return False

    @staticmethod
    def _stop(gateway: Gateway, runner: Process) -> None:
        runner.stop()
        gateway.stop()

    def close(self) -> None:
        for gateway, runner in self._stacks.values():
            self._stop(gateway, runner)
        self._stacks.clear()


def on_the_wire(body: dict[str, Any]) -> Any:
    """A response body as a client reads it: serialised as the gateway does (orjson, which
    embeds a tool call's arguments as the model wrote them), then parsed."""
    return orjson.loads(orjson.dumps(body))


def sse_events(body: bytes) -> list[Any]:
    """Parse an SSE body into its data payloads (JSON objects, or the string "[DONE]")."""
    events: list[Any] = []
    assert body.endswith(b"\n\n"), body[-50:]
    for block in body.split(b"\n\n")[:-1]:
        if block.startswith(b":"):
            continue
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


# --- headless Chromium ------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
"""Debian's, installed by `just browser`; the browser Playwright would download is never used."""
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    """Headless Chromium driven by Playwright (for a module's `browser` fixture); fails the
    test where it is not installed. Playwright is imported here, only by the browser tests."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: these tests drive Debian's chromium. "
            "Run `just browser` (as root: apt-get update && apt-get install -y chromium)."
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def page_problems(page: Page) -> list[str]:
    """A list that collects the page's script errors and console errors and warnings as they
    happen (a page fixture asserts it is empty when the test is done)."""
    problems: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        # Chromium asks for /favicon.ico when it shows a bare script; that 404 is no fault.
        if msg.type in ("error", "warning") and not msg.location["url"].endswith("/favicon.ico"):
            problems.append(f"console {msg.type}: {msg.text} ({msg.location['url']})")

    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", on_console)
    return problems


# --- a protocol-level fake runner -------------------------------------------------------

HARDWARE = Hardware("test chip", 1, 1 << 30, "none", "test")


class FakeRunner:
    """Speaks the runner protocol by hand, so a test can send exactly the frames it wants."""

    def __init__(self, ws: ClientConnection, welcome: Welcome) -> None:
        self.ws = ws
        self.welcome = welcome

    @classmethod
    async def connect(
        cls,
        gateway: Gateway,
        *,
        models: tuple[str, ...] = ("fake-model",),
        max_concurrent: int = 4,
        name: str = "fake",
        headers: dict[str, str] | None = None,
        infos: tuple[ModelInfo, ...] | None = None,
        memory_budget_bytes: int | None = None,
    ) -> FakeRunner:
        """`infos`, when given, is the hello's model list as it is (states, sizes); else
        `models`, each loaded."""
        ws = await connect(
            f"ws://127.0.0.1:{gateway.port}/v1/runner/ws",
            compression=None,
            additional_headers=headers,
        )
        hello = Hello(
            PROTOCOL_VERSION,
            name,
            infos if infos is not None else tuple(ModelInfo(m, 4096) for m in models),
            max_concurrent,
            HARDWARE,
            memory_budget_bytes,
        )
        await ws.send(encode(hello), text=True)
        welcome = decode_gateway_frame(await ws.recv())
        assert isinstance(welcome, Welcome)
        return cls(ws, welcome)

    async def next_request(self) -> Generate | Cancel:
        """The next Generate or Cancel; the gateway's heartbeats are answered meanwhile.

        TimeoutError after 10 s of nothing. (`asyncio.timeout`, not `wait_for`: on Python 3.11
        `wait_for` swallows a cancellation that lands as a frame arrives, and a caller looping
        on this would then never end.)"""
        while True:
            async with asyncio.timeout(10 * UNIT):
                data = await self.ws.recv()
            frame = decode_gateway_frame(data)
            if isinstance(frame, Generate | Cancel):
                return frame
            if isinstance(frame, Heartbeat):
                await self.send(Heartbeat(frame.sent_at))

    async def send(self, frame: Any) -> None:
        await self.ws.send(encode(frame), text=True)

    async def send_raw(self, data: bytes | str) -> None:
        await self.ws.send(data, text=True)

    @staticmethod
    def chunk(
        request_id: str, seq: int, text: str, *, done: bool = False, prompt: int = 3
    ) -> Chunk:
        return Chunk(
            request_id,
            seq,
            text,
            "",
            1,
            Usage(prompt, seq + 1),
            "stop" if done else None,
        )

    async def close(self) -> None:
        await self.ws.close()


TLS_TOKEN = "tls-runner-token"
"""The runner token of a `TlsGateway` unless told otherwise."""


class TlsGateway:
    """`orchard gateway --tls` on a loopback address, its certificates in their own directory:
    `cert` the chain it serves, `ca` the authority clients trust."""

    def __init__(self, tls_dir: Path, token: str = TLS_TOKEN, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.base = f"https://{host}:{self.port}"
        self.cert = tls_dir / "gateway.pem"
        self.ca = tls_dir / "ca.pem"
        self.process = Process(
            ["gateway", "--tls", "--host", host, "--port", str(self.port), "--log-level", "info"],
            env={"ORCHARD_RUNNER_TOKEN": token, "ORCHARD_TLS_DIR": str(tls_dir)},
        )
        try:
            wait_until(self._healthy, 60, "the TLS gateway to start")
        except BaseException:
            self.process.stop()
            raise

    def _healthy(self) -> bool:
        if not self.process.alive():
            raise AssertionError(f"gateway exited:\n{self.process.stop()}")
        try:
            return httpx.get(f"{self.base}/health", verify=self._verify(), timeout=1).is_success
        except (httpx.HTTPError, FileNotFoundError, ssl.SSLError):
            return False

    def _verify(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def runners(self) -> list[str]:
        got = httpx.get(f"{self.base}/v1/runners", verify=self._verify(), timeout=5).json()
        return [runner["name"] for runner in got["data"]]
