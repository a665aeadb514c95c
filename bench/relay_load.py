"""The relay scenario's load and its measuring (bench.relay, bench.paced, bench.metrics): load
processes, each an asyncio loop of closed-loop slots: chat completions or Responses over SSE
on raw sockets, Responses over the WebSocket mode (one socket per slot, a `websockets`
client), or idle browser WebSockets; and one measuring window's figures from them and psutil.

How the load runs and what each figure means: bench.relay's docstring.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing as mp
import os
import re
import subprocess
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import orjson
import psutil

WARM_S = 1.5
STAGGER_S = 0.5
WINDOW_S = 5.0

_TOKEN = re.compile(rb"tok(\d+) ")
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response
_RESPONSES_DELTA = re.compile(rb'^data: \{"type":"response\.output_text\.delta".*$', re.M)
_RESPONSES_ENDS = (b"event: response.completed", b"event: response.incomplete", b"event: error")
_WS_DELTA = b'{"type":"response.output_text.delta"'
_WS_ENDS = (b'{"type":"response.completed"', b'{"type":"response.incomplete"', b'{"type":"error"')


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
    return _post(port, "/v1/chat/completions", body)


def _responses_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "input": "go", "max_output_tokens": max_tokens}


def _post(port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
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
        tokens = self._tokens(lines)
        if tokens:
            self.reads += 1
            self.idx.extend(map(int, tokens))
            self.times.extend([now] * len(tokens))
        if not self._seen_done and self._ends(lines):
            self._seen_done = True
        self._tail = (self._tail + lines)[-16:]
        if self._seen_done and self._tail.endswith(_END):
            self._finish(True)

    def _tokens(self, lines: bytes) -> list[bytes]:
        return _TOKEN.findall(lines)

    def _ends(self, lines: bytes) -> bool:
        return b"[DONE]" in lines

    def _finish(self, ok: bool) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(ok)
        if not ok and self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._finish(False)


class _ResponsesSse(_Sse):
    """A Responses SSE stream: tokens in its text deltas (the done events repeat the text),
    no [DONE]: its last event ends it."""

    def _tokens(self, lines: bytes) -> list[bytes]:
        return _TOKEN.findall(b"".join(_RESPONSES_DELTA.findall(lines)))

    def _ends(self, lines: bytes) -> bool:
        return any(end in lines for end in _RESPONSES_ENDS)


class _Run:
    """One WebSocket-mode response's token arrivals (what `_Group.add` reads)."""

    def __init__(self) -> None:
        self.idx: list[int] = []
        self.times: list[float] = []


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
        self, proto: _Sse | _Run, sent: float, *, first: bool, ok: bool, warm: float, end: float
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
    port: int,
    req: bytes,
    group: _Group,
    *,
    start: float,
    warm: float,
    end: float,
    protocol: type[_Sse] = _Sse,
) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    proto: _Sse | None = None
    first = True
    while time.perf_counter() < end:
        if proto is None or proto.transport is None:
            try:
                _, proto = await loop.create_connection(protocol, "127.0.0.1", port)
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


async def _ws_slot(
    port: int, create: bytes, group: _Group, *, start: float, warm: float, end: float
) -> None:
    """A closed loop of WebSocket-mode responses on one socket of its own (the default
    lane), as `_slot` runs SSE requests on one keep-alive connection."""
    from websockets.asyncio.client import connect  # only the load processes need it

    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    first = True
    url = f"ws://127.0.0.1:{port}/v1/responses"
    async with connect(url, compression=None, max_size=None, ping_interval=None) as ws:
        while time.perf_counter() < end:
            run, ok = _Run(), False
            sent = time.perf_counter()
            await ws.send(create, text=True)
            try:
                async with asyncio.timeout(max(0.0, end - sent)):
                    while not ok:
                        message = await ws.recv(decode=False)
                        if message.startswith(_WS_DELTA):
                            tokens = _TOKEN.findall(message)
                            run.idx.extend(map(int, tokens))
                            run.times.extend([time.perf_counter()] * len(tokens))
                        elif message.startswith(_WS_ENDS):
                            ok = not message.startswith(b'{"type":"error"')
                            break
            except TimeoutError:
                pass  # the window ended mid-response
            group.add(run, sent, first=first, ok=ok, warm=warm, end=end)
            first = False
            if not ok:
                return  # the socket carries the cut response on: leave it


async def _sse_job(job: dict[str, Any]) -> dict[str, Any]:
    start, warm, end = job["start"], job["warm"], job["end"]
    groups: dict[str, _Group] = {}
    slots = []
    api = job.get("api", "chat")
    for model, count, max_tokens, rate in job["streams"]:
        group = groups.setdefault(model, _Group(rate))
        # Starts spread over STAGGER_S: paced streams started at once would tick in lockstep.
        starts = [start + STAGGER_S * k / count for k in range(count)]
        if api == "responses-ws":
            create = orjson.dumps({"type": "response.create", **_responses_body(model, max_tokens)})
            slots += [
                _ws_slot(job["port"], create, group, start=at, warm=warm, end=end) for at in starts
            ]
            continue
        protocol: type[_Sse] = _Sse
        req = _request(job["port"], model, max_tokens)
        if api == "responses-sse":
            body = orjson.dumps({**_responses_body(model, max_tokens), "stream": True})
            req, protocol = _post(job["port"], "/v1/responses", body), _ResponsesSse
        slots += [
            _slot(job["port"], req, group, start=at, warm=warm, end=end, protocol=protocol)
            for at in starts
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


def cpu_seconds(proc: psutil.Process) -> float:
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
    *,
    api: str = "chat",
) -> dict[str, Any]:
    """Run one measuring window; `streams` are (model, count, max_tokens, rate) in total,
    over `api`: "chat" (SSE), "responses-sse" or "responses-ws" (the WebSocket mode)."""
    n = len(load.pipes)
    start = time.perf_counter() + 0.3
    warm, end = start + WARM_S, start + WARM_S + WINDOW_S
    jobs = []
    for w in range(n):
        mine = [(m, split(c, n)[w], t, r) for m, c, t, r in streams]
        jobs.append(
            {
                "kind": "sse",
                "api": api,
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
    g0, r0, m0 = cpu_seconds(gw), sum(map(cpu_seconds, rs)), _busy()
    peak = rss_before
    while time.perf_counter() < end:
        peak = max(peak, gw.memory_info().rss)
        time.sleep(0.2)
    g1, r1, m1 = cpu_seconds(gw), sum(map(cpu_seconds, rs)), _busy()
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


def ms(seconds: float) -> float:
    return seconds * 1000


def warm_up(load: Load, port: int, gw: Any, rs: Any, spec: Any, *, api: str = "chat") -> None:
    global WARM_S, WINDOW_S
    saved = WARM_S, WINDOW_S
    WARM_S, WINDOW_S = 0.2, 1.0
    try:
        window(load, port, gw, rs, spec, api=api)
    finally:
        WARM_S, WINDOW_S = saved
