"""The chaos soak's processes: one gateway and N scripted runners, and the faults done to them
(plus a firehose runner, unpaced, serving the slow readers' model, which no fault touches).

Every process started is kept in `spawned`, so that the end of the run can check each one was
reaped. Faults (one at a time, awaited to their end):

- `kill`: SIGKILL a runner, start it again;
- `freeze`: SIGSTOP a runner past the gateway's liveness timeout, then SIGCONT (it finds its
  socket dropped and reconnects);
- `drain`: SIGTERM a runner (it drains: takes nothing new, finishes what it runs, exits 0),
  then start it again;
- `gateway`: restart the gateway on the same port, alternately drained (SIGTERM) and killed
  (SIGKILL); the runners come back on their own, with their backoff. `down` records each
  window from the signal to the new gateway's first healthy answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from bench.harness import MEMORY

KILL, FREEZE, DRAIN, GATEWAY = "runner SIGKILL", "runner SIGSTOP", "runner drain", "gateway restart"
RUNNER_FAULTS = (KILL, FREEZE, DRAIN)
STOP_WAIT = 30.0
"""Seconds a process has to exit after SIGTERM before it is killed."""
START_WAIT = 60.0
"""Seconds the gateway has to answer /health after it starts."""


class Fleet:
    """The gateway and its runners as real processes, their logs under `logs`."""

    def __init__(
        self,
        port: int,
        gateway_args: Sequence[str],
        runner_args: Sequence[str],
        runners: int,
        *,
        firehose_args: Sequence[str],
        freeze_s: float,
    ) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.gateway_args = list(gateway_args)
        self.runner_args = list(runner_args)
        self.freeze_s = freeze_s
        self.logs = Path(tempfile.mkdtemp(prefix="orchard-chaos-"))
        self.spawned: list[subprocess.Popen[bytes]] = []
        self.down: list[tuple[float, float]] = []
        self.closed = False
        self.gateways: list[subprocess.Popen[bytes]] = []
        self._start_gateway()
        self.runners = [self._start_runner(i) for i in range(runners)]
        args = ["runner", "--gateway", self.base, "--name", "firehose", "--log-level", "warning"]
        self.firehose = self._spawn("firehose", [*args, *firehose_args])
        """A runner of its own model for the slow readers, spared the faults."""

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        if self.closed:
            raise RuntimeError("the fleet is closed: nothing more is started")
        with (self.logs / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchard", *args], stdout=log, stderr=subprocess.STDOUT
            )
        self.spawned.append(proc)
        return proc

    @property
    def gateway(self) -> subprocess.Popen[bytes]:
        """The gateway now (its incarnation: `len(gateways) - 1`)."""
        return self.gateways[-1]

    def _start_gateway(self) -> None:
        args = ["gateway", "--port", str(self.port), "--log-level", "warning", *MEMORY]
        self.gateways.append(self._spawn("gateway", [*args, *self.gateway_args]))

    def _start_runner(self, i: int) -> subprocess.Popen[bytes]:
        args = ["runner", "--gateway", self.base, "--name", f"chaos-{i}", "--log-level", "warning"]
        return self._spawn(f"runner-{i}", [*args, *self.runner_args])

    async def healthy(self) -> None:
        await self._until(lambda r: r.status_code == 200, "/health", START_WAIT)

    async def all_registered(self, seconds: float) -> bool:
        """Whether every runner is in /v1/runners (and none draining) within `seconds`."""

        def listed(resp: httpx.Response) -> bool:
            data = resp.json()["data"]
            return len(data) == len(self.runners) + 1 and not any(r["draining"] for r in data)

        try:
            await self._until(listed, "/v1/runners", seconds)
        except TimeoutError:
            return False
        return True

    async def _until(
        self, check: Callable[[httpx.Response], bool], path: str, seconds: float
    ) -> None:
        deadline = time.monotonic() + seconds
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if check(await http.get(f"{self.base}{path}")):
                        return
                await asyncio.sleep(0.05)
        raise TimeoutError(f"{path} not as wanted after {seconds:g} s")

    async def fault(self, kind: str, runner: int) -> None:
        """Do one fault, to runner number `runner` if it is a runner's, and see it through."""
        proc = self.runners[runner]
        if kind == KILL:
            proc.kill()
            await _reaped(proc, STOP_WAIT)
            self.runners[runner] = self._start_runner(runner)
        elif kind == FREEZE:
            proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(self.freeze_s)
            finally:
                proc.send_signal(signal.SIGCONT)
        elif kind == DRAIN:
            proc.terminate()
            await _reaped(proc, STOP_WAIT)
            self.runners[runner] = self._start_runner(runner)
        else:
            await self._restart_gateway(drain=len(self.gateways) % 2 == 1)

    async def _restart_gateway(self, *, drain: bool) -> None:
        started = time.monotonic()
        self.down.append((started, float("inf")))
        if drain:
            self.gateway.terminate()
        else:
            self.gateway.kill()
        await _reaped(self.gateway, STOP_WAIT)
        self._start_gateway()
        try:
            await self.healthy()
        finally:
            self.down[-1] = (started, time.monotonic())

    @property
    def restarting(self) -> bool:
        return bool(self.down) and self.down[-1][1] == float("inf")

    def was_down(self, start: float, end: float) -> bool:
        """Whether [start, end] overlaps a window in which the gateway was down."""
        return any(start <= up and end >= gone for gone, up in self.down)

    def close(self) -> None:
        """SIGTERM every process still running (SIGCONT first: a frozen one cannot exit), then
        SIGKILL what is left after STOP_WAIT; reap them all."""
        self.closed = True
        live = [p for p in self.spawned if p.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for proc in live:
            try:
                proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def left_running(self) -> list[int]:
        """Pids of processes this fleet started that are not reaped, or that still exist."""
        return [p.pid for p in self.spawned if p.returncode is None]

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def _reaped(proc: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            await asyncio.to_thread(proc.wait)
            return
        await asyncio.sleep(0.05)
