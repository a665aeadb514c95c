"""`python -m bench.servers`: uvicorn vs granian, the ASGI server's cost per SSE event.

One tiny raw-ASGI app (`app`, no framework) answers a POST with `text/event-stream` and then
sends ~200-byte `chat.completion.chunk` events, one `send` per event. One shared ticker (one
per server process, like the gateway's relay, which writes from the runner link's stack)
wakes every `TICK_S` (20 ms: 50 events/s per stream) and sends one event to every open
stream, awaiting each `send` in turn. A stream ends when the client disconnects.

Servers, each a fresh subprocess per run, on 127.0.0.1 with the same app:
- uvicorn: `uvicorn.run(app, loop="uvloop", http="httptools")`, one process;
- granian: `granian --interface asgi --loop uvloop --workers 1 --http 1` (a supervisor process
  and one worker; the CPU figure sums the process tree).

Load: a separate process (one uvloop loop, raw `asyncio.Protocol` sockets, no HTTP or JSON
parsing: it counts `\\n\\n`) opens C streams, waits until every stream has its first event,
then `WARM_S` of warm-up and a `WINDOW_S` window. Over the window:
- server CPU: psutil user+system of the server's process tree, per delivered event;
- delivered events/s (all streams);
- gap p99: per read, arrival minus the previous event's arrival on that stream (0 for a
  further event in the same read), pooled over streams; the ideal is the 20 ms tick;
- the load process's own CPU, to show it was not the limit.

Runs alternate servers (the first one alternates too), `--runs` each per level; the table
shows medians and min-max.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

TICK_S = 0.02
"""The shared ticker's period: one event per open stream per tick (50 events/s)."""
WARM_S = 1.0
WINDOW_S = 5.0
LEVELS = (64, 256)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

EVENT = (
    b'data: {"id":"chatcmpl-5f0c3a9e1b2d4c6f8a7e9d1c3b5a7f90","object":"chat.completion.chunk",'
    b'"created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" the"},'
    b'"finish_reason":null}]}\n\n'
)
HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


# --- the app -------------------------------------------------------------------------------


class _Stream:
    __slots__ = ("send",)

    def __init__(self, send: Send) -> None:
        self.send = send


_streams: set[_Stream] = set()
_ticker: asyncio.Task[None] | None = None


async def _tick() -> None:
    loop = asyncio.get_running_loop()
    due = loop.time()
    while True:
        due += TICK_S
        now = loop.time()
        if due < now - TICK_S:  # overran by more than a tick: drop the missed ticks
            due = now
        await asyncio.sleep(max(0.0, due - now))
        for stream in list(_streams):
            try:
                await stream.send({"type": "http.response.body", "body": EVENT, "more_body": True})
            except Exception:  # the client went away
                _streams.discard(stream)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Raw ASGI: POST → an endless SSE stream fed by the shared ticker."""
    global _ticker  # noqa: PLW0603 - one ticker per server process
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    more = True
    while more:  # the request body (ignored)
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    stream = _Stream(send)
    _streams.add(stream)
    if _ticker is None:
        _ticker = asyncio.get_running_loop().create_task(_tick())
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    finally:
        _streams.discard(stream)


def serve_uvicorn(port: int) -> None:
    import uvicorn

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


# --- the load ------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One SSE stream: counts events (`\\n\\n`) and the gaps between their arrivals."""

    def __init__(self, first: asyncio.Event, clients: list[_Client]) -> None:
        self.first = first
        self.clients = clients
        self.last_byte = b""
        self.last_event = 0.0
        self.events = 0
        self.counting = False
        self.counted = 0
        self.gaps: list[float] = []
        self.closed = False

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        n = (self.last_byte + data[:1]).count(b"\n\n") + data.count(b"\n\n")
        self.last_byte = data[-1:]
        if not n:
            return
        if self.counting:
            self.counted += n
            self.gaps.append(now - self.last_event)
            self.gaps.extend([0.0] * (n - 1))
        self.last_event = now
        if self.events == 0:
            self.events = n
            if all(c.events for c in self.clients):
                self.first.set()
        else:
            self.events += n

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True


def _tree_cpu(pid: int) -> float:
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


async def _connect(
    loop: asyncio.AbstractEventLoop, client: _Client, port: int
) -> asyncio.Transport:
    transport, _ = await loop.create_connection(lambda: client, "127.0.0.1", port)
    return transport


async def _load(port: int, streams: int, server_pid: int) -> dict[str, float]:
    import psutil

    loop = asyncio.get_running_loop()
    first = asyncio.Event()
    clients: list[_Client] = []
    body = b'{"model":"qwen3-8b","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    transports = []
    for _ in range(streams):
        client = _Client(first, clients)
        clients.append(client)
        transport = await _connect(loop, client, port)
        transport.write(request)
        transports.append(transport)
    await asyncio.wait_for(first.wait(), 30)
    await asyncio.sleep(WARM_S)
    me = psutil.Process()
    cpu0, me0, t0 = _tree_cpu(server_pid), me.cpu_times(), time.perf_counter()
    for c in clients:
        c.counting = True
    await asyncio.sleep(WINDOW_S)
    for c in clients:
        c.counting = False
    cpu1, me1, t1 = _tree_cpu(server_pid), me.cpu_times(), time.perf_counter()
    for transport in transports:
        transport.close()
    gaps = sorted(g for c in clients for g in c.gaps)
    events = sum(c.counted for c in clients)
    elapsed = t1 - t0
    return {
        "events": events,
        "events_per_s": events / elapsed,
        "cpu_us_per_event": (cpu1 - cpu0) / max(events, 1) * 1e6,
        "server_cpu_pct": (cpu1 - cpu0) / elapsed * 100,
        "load_cpu_pct": (me1.user + me1.system - me0.user - me0.system) / elapsed * 100,
        "gap_p50_ms": gaps[len(gaps) // 2] * 1000 if gaps else float("nan"),
        "gap_p99_ms": gaps[int(len(gaps) * 0.99)] * 1000 if gaps else float("nan"),
        "closed": sum(c.closed for c in clients),
    }


def run_load(port: int, streams: int, server_pid: int) -> None:
    import uvloop

    print(json.dumps(uvloop.run(_load(port, streams, server_pid))))


# --- the driver ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(server: str, port: int) -> subprocess.Popen[bytes]:
    if server == "uvicorn":
        cmd = [sys.executable, "-m", "bench.servers", "--serve-uvicorn", str(port)]
    else:
        granian = shutil.which("granian", path=os.path.dirname(sys.executable)) or "granian"
        cmd = [
            granian,
            *("--interface", "asgi", "--loop", "uvloop", "--workers", "1", "--http", "1"),
            *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
            "--no-access-log",
            "bench.servers:app",
        ]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            time.sleep(0.3)  # let a supervisor finish starting its worker
            return proc
        time.sleep(0.1)
    raise RuntimeError(f"{server} did not listen on {port}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        children = psutil.Process(proc.pid).children(recursive=True)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def one_run(server: str, streams: int) -> dict[str, float]:
    port = _free_port()
    proc = _start(server, port)
    try:
        cmd = [sys.executable, "-m", "bench.servers", "--load", str(port), str(streams)]
        done = subprocess.run([*cmd, str(proc.pid)], capture_output=True, timeout=120, check=False)
        if done.returncode:
            raise RuntimeError(f"load failed: {done.stderr.decode()}")
        result: dict[str, float] = json.loads(done.stdout)
        return result
    finally:
        _stop(proc)


def _fmt(values: list[float], digits: int = 1) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def main(runs: int = 5) -> int:
    try:
        from importlib.metadata import version

        versions = {name: version(name) for name in ("granian", "uvicorn", "uvloop", "httptools")}
    except Exception as exc:
        print(
            f"granian/uvicorn missing ({exc}): python3 -m venv /tmp/evalvenv && "
            "/tmp/evalvenv/bin/pip install -e . granian && "
            "/tmp/evalvenv/bin/python -m bench.servers"
        )
        return 0
    print(
        ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; Python {sys.version.split()[0]}; {os.cpu_count()} CPUs; "
        f"{1 / TICK_S:.0f} events/s per stream, {len(EVENT)}-byte events, "
        f"{WARM_S:.0f} s warm-up, {WINDOW_S:.0f} s window, {runs} runs per cell\n",
        flush=True,
    )
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    ratios: dict[int, list[float]] = {}
    for streams in LEVELS:
        for i in range(runs):
            order = ("uvicorn", "granian") if i % 2 == 0 else ("granian", "uvicorn")
            pair = {}
            for server in order:
                r = one_run(server, streams)
                pair[server] = r
                results.setdefault((server, streams), []).append(r)
                print(
                    f"  {streams} streams, run {i + 1}, {server}: "
                    f"{r['cpu_us_per_event']:.1f} µs/event, {r['events_per_s']:.0f} events/s, "
                    f"server {r['server_cpu_pct']:.0f}% CPU, load {r['load_cpu_pct']:.0f}% CPU, "
                    f"gap p99 {r['gap_p99_ms']:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
            ratios.setdefault(streams, []).append(
                pair["granian"]["cpu_us_per_event"] / pair["uvicorn"]["cpu_us_per_event"]
            )
    print(
        "| streams | server | server CPU µs/event | events/s (ideal) | server CPU % "
        "| gap p50 ms | gap p99 ms | load CPU % | granian/uvicorn µs/event (paired) |"
    )
    print("|--:|---|--:|--:|--:|--:|--:|--:|--:|")
    for streams in LEVELS:
        for server in ("uvicorn", "granian"):
            rs = results[(server, streams)]
            ratio = _fmt(ratios[streams], 2) if server == "granian" else ""
            print(
                f"| {streams} | {server} | {_fmt([r['cpu_us_per_event'] for r in rs])} "
                f"| {_fmt([r['events_per_s'] for r in rs], 0)} ({streams / TICK_S:.0f}) "
                f"| {_fmt([r['server_cpu_pct'] for r in rs], 0)} "
                f"| {_fmt([r['gap_p50_ms'] for r in rs])} "
                f"| {_fmt([r['gap_p99_ms'] for r in rs])} "
                f"| {_fmt([r['load_cpu_pct'] for r in rs], 0)} | {ratio} |"
            )
    print("\nCells: median (min-max) over the runs.")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.servers", description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="runs per server and level")
    parser.add_argument("--serve-uvicorn", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--load", nargs=3, type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_uvicorn:
        serve_uvicorn(args.serve_uvicorn)
    elif args.load:
        run_load(*args.load)
    else:
        sys.exit(main(runs=args.runs))
