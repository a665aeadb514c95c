"""Scenario "relay": how many tokens one gateway process can relay, and what each costs.

Four scripted runners (`--engine scripted --tokens-per-second 0`: each token is emitted as
soon as the runner's loop takes it) feed 64 / 256 / 1024 concurrent SSE streams through one
gateway. Each level gets a fresh stack (so its memory figures start from the same baseline)
and `runs` measuring windows; every figure is the median over the windows.

Load: closed loop. Each stream slot sends a request, reads it to `[DONE]`, and sends the
next on the same keep-alive connection. The slots are spread over load processes (one
asyncio loop each, raw sockets and a regex over the bytes: no httpx, no JSON parse), which
report their own CPU time so a table shows how close the clients came to being the limit.

Figures, over a window that starts `WARM_S` after the burst of connects:
- tokens/s: tokens (`tokN ` in a content delta) whose bytes arrived in the window;
- gateway CPU µs per token: psutil user+system CPU of the gateway process over the window;
- TTFT: request written → first token's bytes read, for requests sent in the window;
- gap p50/p99: per stream, arrival of token i minus arrival of token i-1 (0 when both came
  in one read), and tokens per read (how much the runner and the gateway batched);
- added latency: a fifth runner paced at PROBE_RATE tok/s serves PROBE_STREAMS streams
  through the same gateway during the flood. The scripted engine emits token i at
  `start + (i+1)/rate`; the client cannot see `start`, so per request it takes the
  smallest `arrival_i - (i+1)/rate` as the stream's zero (its least-delayed token) and
  reports each token's lateness over that. It is the delay a token picks up from the
  runner's loop, the relay and the client read, above the best the path did for that
  stream; the constant part of loopback latency (well under 1 ms unloaded) is not in it.
- gateway RSS before the level's load, peak during it, and 2 s after.

A separate stack measures 1,000 idle browser WebSockets (`/v1/ws`, handshake done, no
message): RSS before, while open, after closing; memory per connection.

`python -m bench.relay --profile [SECONDS [STREAMS [RATE]]]` (default 10 s, 64 streams at
50 tok/s: one token per runner frame) runs py-spy on the gateway under that load and prints
the top functions by own and by inclusive samples, with each one's µs per relayed token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson
import psutil

from bench.harness import env_note, stack, table

MODEL = "relay"
PACED_MODEL = "relay-paced"
FAST_RATE = 200.0
"""Per-stream pace of the second flood: high enough to load the gateway, low enough that a
runner frame carries about one token (unpaced, a frame carries most of a request)."""
PROBE_MODEL = "probe"
PROBE_RATE = 50.0
PROBE_STREAMS = 8
PROBE_TOKENS = 100
LEVELS = (64, 256, 1024)
RUNNERS = 4
WARM_S = 1.5
STAGGER_S = 0.5
WINDOW_S = 5.0
IDLE_SOCKETS = 1000

_TOKEN = re.compile(rb"tok(\d+) ")
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response


# --- load processes ---------------------------------------------------------------------------


def _request(port: int, model: str, max_tokens: int) -> bytes:
    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Sse(asyncio.Protocol):
    """One keep-alive connection reading SSE responses, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[bool] | None = None
        self.idx: list[int] = []
        self.times: list[float] = []
        self.reads = 0
        self._head = True
        self._buf = b""
        self._tail = b""
        self._seen_done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def begin(self, done: asyncio.Future[bool]) -> None:
        self.done = done
        self.idx, self.times, self.reads = [], [], 0
        self._head, self._buf, self._tail, self._seen_done = True, b"", b"", False

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._head:
            data = self._buf + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self._buf = data
                return
            if not data.startswith(b"HTTP/1.1 200"):
                self._finish(False)
                return
            self._head, self._buf, data = False, b"", data[end + 4 :]
        data = self._buf + data
        cut = data.rfind(b"\n") + 1
        lines, self._buf = data[:cut], data[cut:]
        tokens = _TOKEN.findall(lines)
        if tokens:
            self.reads += 1
            self.idx.extend(map(int, tokens))
            self.times.extend([now] * len(tokens))
        if not self._seen_done and b"[DONE]" in lines:
            self._seen_done = True
        self._tail = (self._tail + lines)[-16:]
        if self._seen_done and self._tail.endswith(_END):
            self._finish(True)

    def _finish(self, ok: bool) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(ok)
        if not ok and self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._finish(False)


class _Group:
    """What one worker measured for one model's streams."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = 0
        self.reads = 0
        self.requests = 0
        self.failed = 0
        self.ttft: list[float] = []
        self.burst_ttft: list[float] = []
        self.gaps: list[float] = []
        self.late: list[float] = []

    def add(
        self, proto: _Sse, sent: float, *, first: bool, ok: bool, warm: float, end: float
    ) -> None:
        times, idx = proto.times, proto.idx
        if not ok and time.perf_counter() < end:
            self.failed += 1  # an error, not a stream cut short by the end of the window
        if not times:
            return
        self.requests += ok
        if times and first:
            self.burst_ttft.append(times[0] - sent)
        elif times and warm <= sent < end:
            self.ttft.append(times[0] - sent)
        in_window = [i for i, t in enumerate(times) if warm <= t < end]
        self.tokens += len(in_window)
        self.reads += len({times[i] for i in in_window})
        self.gaps.extend(times[i] - times[i - 1] for i in in_window if i > 0)
        if self.rate > 0 and times:
            zero = min(t - (k + 1) / self.rate for t, k in zip(times, idx, strict=True))
            self.late.extend(times[i] - (idx[i] + 1) / self.rate - zero for i in in_window)

    def result(self) -> dict[str, Any]:
        return dict(vars(self))


async def _slot(
    port: int, req: bytes, group: _Group, *, start: float, warm: float, end: float
) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    proto: _Sse | None = None
    first = True
    while time.perf_counter() < end:
        if proto is None or proto.transport is None:
            try:
                _, proto = await loop.create_connection(_Sse, "127.0.0.1", port)
            except OSError:
                group.failed += 1
                await asyncio.sleep(0.05)
                continue
        done: asyncio.Future[bool] = loop.create_future()
        proto.begin(done)
        sent = time.perf_counter()
        assert proto.transport is not None
        proto.transport.write(req)
        _SLOTS.add(proto)
        ok = await done
        group.add(proto, sent, first=first, ok=ok, warm=warm, end=end)
        first = False
    if proto is not None and proto.transport is not None:
        proto.transport.close()


_SLOTS: set[_Sse] = set()


async def _sse_job(job: dict[str, Any]) -> dict[str, Any]:
    start, warm, end = job["start"], job["warm"], job["end"]
    groups: dict[str, _Group] = {}
    slots = []
    for model, count, max_tokens, rate in job["streams"]:
        group = groups.setdefault(model, _Group(rate))
        req = _request(job["port"], model, max_tokens)
        # Starts spread over STAGGER_S: paced streams started at once would tick in lockstep.
        slots += [
            _slot(job["port"], req, group, start=start + STAGGER_S * k / count, warm=warm, end=end)
            for k in range(count)
        ]
    tasks = [asyncio.ensure_future(s) for s in slots]
    await asyncio.sleep(max(0.0, warm - time.perf_counter()))
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    cpu1 = time.process_time()
    for proto in list(_SLOTS):  # streams still in flight end with the window
        if proto.transport is not None:
            proto.transport.abort()
    _SLOTS.clear()
    await asyncio.gather(*tasks)
    return {"cpu": cpu1 - cpu0, "groups": {m: g.result() for m, g in groups.items()}}


class _Idle(asyncio.Protocol):
    def __init__(self) -> None:
        self.upgraded: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.after_upgrade = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.upgraded.done():
            self.upgraded.set_result(data.startswith(b"HTTP/1.1 101"))
            data = data.partition(b"\r\n\r\n")[2]
        self.after_upgrade += data  # a close frame here means the gateway refused it

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.upgraded.done():
            self.upgraded.set_result(False)


async def _ws_job(job: dict[str, Any], pipe: Connection) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    port = job["port"]
    handshake = (
        f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    gate = asyncio.Semaphore(64)

    async def one() -> _Idle | None:
        async with gate:
            try:
                _, proto = await loop.create_connection(_Idle, "127.0.0.1", port)
            except OSError:
                return None
            assert proto.transport is not None
            proto.transport.write(handshake)
            return proto if await proto.upgraded else None

    protos = [p for p in await asyncio.gather(*(one() for _ in range(job["n"]))) if p]
    pipe.send(len(protos))
    await loop.run_in_executor(None, pipe.recv)  # hold until told to close
    alive = sum(p.transport is not None and not p.after_upgrade for p in protos)
    for p in protos:
        if p.transport is not None:
            p.transport.abort()
    return {"opened": len(protos), "alive": alive}


def _worker(pipe: Connection) -> None:
    while True:
        job = pipe.recv()
        if job is None:
            return
        if job["kind"] == "sse":
            pipe.send(asyncio.run(_sse_job(job)))
        else:
            pipe.send(asyncio.run(_ws_job(job, pipe)))


class Load:
    """Load processes, each with its own event loop."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs = []
        for _ in range(count):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(theirs,), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)

    def send(self, jobs: Sequence[dict[str, Any]]) -> None:
        for pipe, job in zip(self.pipes, jobs, strict=True):
            pipe.send(job)

    def gather(self) -> list[Any]:
        return [pipe.recv() for pipe in self.pipes]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(5)


def workers() -> int:
    return max(2, min(4, os.cpu_count() or 2))


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


# --- measuring a window -----------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _busy() -> tuple[float, float]:
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return float(sum(t) - idle), float(sum(t))


def window(
    load: Load,
    port: int,
    gateway: subprocess.Popen[bytes],
    runners: Sequence[subprocess.Popen[bytes]],
    streams: Sequence[tuple[str, int, int, float]],
) -> dict[str, Any]:
    """Run one measuring window; `streams` are (model, count, max_tokens, rate) in total."""
    n = len(load.pipes)
    start = time.perf_counter() + 0.3
    warm, end = start + WARM_S, start + WARM_S + WINDOW_S
    jobs = []
    for w in range(n):
        mine = [(m, split(c, n)[w], t, r) for m, c, t, r in streams]
        jobs.append(
            {
                "kind": "sse",
                "port": port,
                "start": start,
                "warm": warm,
                "end": end,
                "streams": [s for s in mine if s[1]],
            }
        )
    gw = psutil.Process(gateway.pid)
    rs = [psutil.Process(r.pid) for r in runners]
    rss_before = gw.memory_info().rss
    load.send(jobs)
    time.sleep(max(0.0, warm - time.perf_counter()))
    g0, r0, m0 = _cpu(gw), sum(map(_cpu, rs)), _busy()
    peak = rss_before
    while time.perf_counter() < end:
        peak = max(peak, gw.memory_info().rss)
        time.sleep(0.2)
    g1, r1, m1 = _cpu(gw), sum(map(_cpu, rs)), _busy()
    results = load.gather()
    time.sleep(2.0)  # the gateway trims freed memory 1 s after its last stream ends
    span = WINDOW_S
    return {
        "gateway_cpu": g1 - g0,
        "runner_cpu": r1 - r0,
        "client_cpu": [r["cpu"] / span for r in results],
        "machine_busy": (m1[0] - m0[0]) / (m1[1] - m0[1]),
        "rss": (rss_before, peak, gw.memory_info().rss),
        "groups": _merge([r["groups"] for r in results]),
        "span": span,
    }


def _merge(parts: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for model, g in part.items():
            into = out.setdefault(model, collections.defaultdict(list))
            for key, value in g.items():
                if isinstance(value, list):
                    into[key].extend(value)
                elif key == "rate":
                    into[key] = value
                else:
                    into[key] = into.get(key, 0) + value
    return out


def fd_limit() -> None:
    """Streams x sockets needs more descriptors than the usual soft limit of 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def runner_args(model: str, slots: int, rate: float) -> list[str]:
    return [
        "--engine",
        "scripted",
        "--model",
        model,
        "--max-concurrent",
        str(slots),
        "--tokens-per-second",
        str(rate),
    ]


@contextlib.contextmanager
def relay_stack(slots: int, probe: bool = True) -> Iterator[tuple[int, Any, list[Any]]]:
    runners = [runner_args(MODEL, slots, 0.0) for _ in range(RUNNERS)]
    runners += [runner_args(PACED_MODEL, slots, FAST_RATE) for _ in range(RUNNERS)]
    if probe:
        runners.append(runner_args(PROBE_MODEL, PROBE_STREAMS, PROBE_RATE))
    with stack(runners, ["--max-client-sockets", str(IDLE_SOCKETS + 64)]) as (base, gw, rs):
        yield int(base.rsplit(":", 1)[1]), gw, rs


def ms(seconds: float) -> float:
    return seconds * 1000


# --- scenarios --------------------------------------------------------------------------------


def _level(
    load: Load, streams: int, runs: int, tokens: int
) -> list[tuple[list[object], list[object]]]:
    slots = -(-streams // RUNNERS)
    out = []
    with relay_stack(slots) as (port, gw, rs):
        # Warm the gateway's code paths (imports, first allocations) before its baseline.
        warm_up(load, port, gw, rs, [(MODEL, min(streams, 16), tokens, 0.0)])
        for model, rate in ((MODEL, 0.0), (PACED_MODEL, FAST_RATE)):
            spec = [
                (model, streams, tokens, rate),
                (PROBE_MODEL, PROBE_STREAMS, PROBE_TOKENS, PROBE_RATE),
            ]
            wins = [window(load, port, gw, rs, spec) for _ in range(runs)]
            name = "unpaced" if rate == 0 else f"{rate:.0f} tok/s each"
            out.append(_rows(load, wins, model, name, streams))
    return out


def _rows(
    load: Load, wins: list[dict[str, Any]], model: str, name: str, streams: int
) -> tuple[list[object], list[object]]:
    flood = [w["groups"][model] for w in wins]
    probes = [w["groups"].get(PROBE_MODEL, {}) for w in wins]
    med = statistics.median
    tok_s = med([f["tokens"] / w["span"] for f, w in zip(flood, wins, strict=True)])
    us_tok = med(
        [w["gateway_cpu"] / max(1, f["tokens"]) * 1e6 for f, w in zip(flood, wins, strict=True)]
    )
    row = [
        streams,
        name,
        tok_s,
        us_tok,
        med([f["tokens"] / max(1, f["reads"]) for f in flood]),
        med([ms(pct(f["burst_ttft"], 0.5)) for f in flood]),
        med([ms(pct(f["burst_ttft"], 0.99)) for f in flood]),
        f"{med([ms(pct(f['ttft'], 0.5)) for f in flood]):.1f} / "
        f"{med([ms(pct(f['ttft'], 0.99)) for f in flood]):.1f} "
        f"(n={sum(len(f['ttft']) for f in flood)})",
        f"{med([ms(pct(f['gaps'], 0.5)) for f in flood]):.2f} / "
        f"{med([ms(pct(f['gaps'], 0.99)) for f in flood]):.1f}",
        f"{med([ms(pct(p.get('late', []), 0.5)) for p in probes]):.1f} / "
        f"{med([ms(pct(p.get('late', []), 0.99)) for p in probes]):.1f}",
        sum(f["failed"] for f in flood),
    ]
    rss = [w["rss"] for w in wins]
    usage = [
        streams,
        name,
        med([w["gateway_cpu"] / w["span"] * 100 for w in wins]),
        med([w["runner_cpu"] / w["span"] * 100 for w in wins]),
        " ".join(
            f"{med([w['client_cpu'][i] * 100 for w in wins]):.0f}" for i in range(len(load.pipes))
        ),
        med([w["machine_busy"] * 100 for w in wins]),
        rss[0][0] / 2**20,
        max(r[1] for r in rss) / 2**20,
        rss[-1][2] / 2**20,
        (max(r[1] for r in rss) - rss[0][0]) / streams / 1024,
    ]
    return row, usage


def warm_up(load: Load, port: int, gw: Any, rs: Any, spec: Any) -> None:
    global WARM_S, WINDOW_S
    saved = WARM_S, WINDOW_S
    WARM_S, WINDOW_S = 0.2, 1.0
    try:
        window(load, port, gw, rs, spec)
    finally:
        WARM_S, WINDOW_S = saved


def idle_sockets(load: Load) -> list[object]:
    with relay_stack(1, probe=False) as (port, gw, _):
        proc = psutil.Process(gw.pid)
        before = proc.memory_info().rss
        cpu0 = _cpu(proc)
        opened_at = time.perf_counter()
        load.send(
            [{"kind": "ws", "port": port, "n": n} for n in split(IDLE_SOCKETS, len(load.pipes))]
        )
        opened = sum(pipe.recv() for pipe in load.pipes)
        open_s = time.perf_counter() - opened_at
        time.sleep(2.0)
        cpu1 = _cpu(proc)
        during = proc.memory_info().rss
        time.sleep(3.0)
        idle_cpu = (_cpu(proc) - cpu1) / 3.0
        for pipe in load.pipes:
            pipe.send("close")
        alive = sum(r["alive"] for r in load.gather())
        time.sleep(2.5)  # the gateway trims freed memory 1 s after the last socket leaves
        after = proc.memory_info().rss
    return [
        opened,
        alive,
        open_s,
        (cpu1 - cpu0) / max(1, opened) * 1e6,
        idle_cpu * 100,
        before / 2**20,
        during / 2**20,
        after / 2**20,
        (during - before) / max(1, opened) / 1024,
    ]


def main(runs: int, tokens: int) -> None:
    fd_limit()
    load = Load(workers())
    try:
        idle = idle_sockets(load)
        rows, usage = [], []
        for streams in LEVELS:
            for row, use in _level(load, streams, runs, tokens):
                rows.append(row)
                usage.append(use)
    finally:
        load.close()
    note = f"{env_note()}, {len(load.pipes)} load processes, median of {runs} x {WINDOW_S:.0f} s"
    print(
        table(
            f"relay: {RUNNERS} scripted runners → 1 gateway → SSE, {tokens}-token "
            f"requests, closed loop ({note})",
            [
                "streams",
                "runner pace",
                "tok/s",
                "gateway CPU µs/tok",
                "tok/read",
                "TTFT burst p50 ms",
                "TTFT burst p99 ms",
                "TTFT steady p50/p99 ms",
                "gap p50/p99 ms",
                f"added latency p50/p99 ms ({PROBE_STREAMS} probes @ {PROBE_RATE:.0f} tok/s)",
                "failed",
            ],
            rows,
        )
    )
    print(
        table(
            "relay: CPU (% of one core) and gateway memory",
            [
                "streams",
                "runner pace",
                "gateway CPU %",
                "runners CPU %",
                "load procs CPU %",
                "machine busy %",
                "RSS before MiB",
                "RSS peak MiB",
                "RSS after MiB",
                "KiB per stream (peak-before)",
            ],
            usage,
        )
    )
    print(
        table(
            f"idle browser WebSockets (/v1/ws), {IDLE_SOCKETS} opened",
            [
                "opened",
                "alive after 5 s",
                "open s",
                "gateway CPU µs per open",
                "idle CPU %",
                "RSS before MiB",
                "RSS open MiB",
                "RSS closed MiB",
                "KiB per socket",
            ],
            [idle],
        )
    )


# --- profile ----------------------------------------------------------------------------------


def aggregate(raw: Path, top: int = 25) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """py-spy `-f raw` (folded stacks) → total samples, top own and top inclusive frames."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text:
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack_text.split(";")]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            incl[frame] += count
    # Frames on (nearly) every stack are the event loop's own scaffolding: leave them out.
    inner = [(f, n) for f, n in incl.most_common() if n < 0.6 * total]
    return total, own.most_common(top), inner[:top]


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" → "func (to/file.py)"
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    tail = "/".join(path.split("/")[-2:])
    return f"{name} ({tail})"


def profile(seconds: float, streams: int, rate: float, tokens: int = 256) -> None:
    """py-spy on the gateway while `streams` streams at `rate` tok/s (0: unpaced) run."""
    global WARM_S, WINDOW_S
    fd_limit()
    load = Load(workers())
    raw = Path(tempfile.mkdtemp()) / "gateway.raw"
    spy = Path(sys.executable).parent / "py-spy"
    try:
        args = [runner_args(MODEL, -(-streams // RUNNERS), rate) for _ in range(RUNNERS)]
        with stack(args) as (base, gw, rs):
            port = int(base.rsplit(":", 1)[1])
            WARM_S, WINDOW_S = 1.0, seconds + 1.0
            rec = subprocess.Popen(
                [
                    str(spy),
                    "record",
                    "-p",
                    str(gw.pid),
                    "-d",
                    str(int(seconds)),
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    *(["--native"] if os.environ.get("SPY_NATIVE") else ["--nonblocking"]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            w = window(load, port, gw, rs, [(MODEL, streams, tokens, rate)])
            _, err = rec.communicate(timeout=60)
            if rec.returncode:
                print(err.decode(), file=sys.stderr)
    finally:
        load.close()
    flood = w["groups"][MODEL]
    total, own, incl = aggregate(raw)
    us = w["gateway_cpu"] / max(1, flood["tokens"]) * 1e6
    print(
        f"\n{streams} streams at {rate:g} tok/s: {flood['tokens'] / w['span']:.0f} tok/s, "
        f"{us:.1f} µs gateway CPU per token, {total} samples ({raw})"
    )
    for title, rows in (("own", own), ("inclusive", incl)):
        print(
            table(
                f"gateway profile, top by {title} samples",
                ["function", "samples", "%", "µs per token"],
                [[name, n, n / total * 100, n / total * us] for name, n in rows],
            )
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--profile"]:
        # --profile [SECONDS [STREAMS [RATE]]]
        args = [float(a) for a in sys.argv[2:5]] + [10.0, 64, 50.0][len(sys.argv[2:5]) :]
        profile(args[0], int(args[1]), args[2])
    else:
        main(
            runs=int(sys.argv[1]) if len(sys.argv) > 1 else 1,
            tokens=int(sys.argv[2]) if len(sys.argv) > 2 else 256,
        )
