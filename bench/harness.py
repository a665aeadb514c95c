"""What every scenario needs: start a gateway and runners as real processes, time streams."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import orjson

MEMORY = ("--store", "memory")
"""A benchmark's gateway keeps its stores in memory: nothing is written to the state
directory (a gateway the user runs holds its file), and the figures stay comparable with
those measured before the stores had a file."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn_process(args: Sequence[str], cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    log = tempfile.TemporaryFile()  # noqa: SIM115 -- lives as long as the process
    return subprocess.Popen(
        [*_taskset(cpus), sys.executable, "-m", "orchard", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _taskset(cpus: set[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []


def pin_self(cpus: set[int] | None) -> None:
    """Pin this (single-threaded client) process."""
    if cpus:
        os.sched_setaffinity(0, cpus)


class InProcess:
    """A `bench.inprocess` worker: in-process mlx-lm timings on the given CPUs."""

    def __init__(self, model: str, cpus: set[int] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*_taskset(cpus), sys.executable, "-m", "bench.inprocess", model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == b"ready"

    def run(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, int]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(
            orjson.dumps({"messages": messages, "max_tokens": max_tokens}) + b"\n"
        )
        self.proc.stdin.flush()
        ttft, rate, n = orjson.loads(self.proc.stdout.readline())
        return float(ttft), float(rate), int(n)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def stack(
    runner_args: Sequence[Sequence[str]],
    gateway_args: Sequence[str] = (),
    *,
    gateway_cpus: set[int] | None = None,
    runner_cpus: set[int] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes], list[subprocess.Popen[bytes]]]]:
    """A gateway process plus one runner process per entry of `runner_args`."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gateway = spawn_process(
        ["gateway", "--port", str(port), "--log-level", "warning", *MEMORY, *gateway_args],
        gateway_cpus,
    )
    runners: list[subprocess.Popen[bytes]] = []
    try:
        wait_until(lambda: httpx.get(f"{base}/health", timeout=1).status_code == 200, 30)
        for i, args in enumerate(runner_args):
            runners.append(
                spawn_process(
                    [
                        "runner",
                        "--gateway",
                        base,
                        "--name",
                        f"bench-{i}",
                        "--log-level",
                        "warning",
                        *args,
                    ],
                    runner_cpus,
                )
            )
        wait_until(lambda: len(httpx.get(f"{base}/v1/runners").json()["data"]) == len(runners), 120)
        yield base, gateway, runners
    finally:
        for proc in [*runners, gateway]:
            stop_process(proc)


def wait_until(check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError("timed out starting the stack")


def sse_run(client: httpx.Client, base: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """Stream one request; (ttft s, decode tok/s after the first token, completion tokens)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if not first:
                first = now
            event = orjson.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                last = now
    return first - start, (tokens - 1) / (last - first) if last > first else 0.0, tokens


def ws_run(ws: Any, body: dict[str, Any]) -> tuple[float, float, int]:
    """One request over an open `/v1/ws` socket (websockets sync client); same figures."""
    rid = f"bench-{time.perf_counter_ns()}"
    start = time.perf_counter()
    ws.send(orjson.dumps({"type": "chat.completions.create", "request_id": rid, "body": body}))
    first = last = 0.0
    while True:
        msg = orjson.loads(ws.recv())
        now = time.perf_counter()
        if msg["type"] == "done":
            tokens = int(msg["usage"]["completion_tokens"])
            break
        if msg["type"] != "chunk":
            raise RuntimeError(msg)
        first = first or now
        choices = msg["chunk"]["choices"]
        if choices and choices[0]["delta"].get("content"):
            last = now
    return first - start, (tokens - 1) / (last - first) if last > first else 0.0, tokens


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [f"\n## {title}\n"]
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def env_note() -> str:
    return f"python {sys.version.split()[0]}, {os.cpu_count()} cpus"
