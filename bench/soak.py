"""`just soak`: a gateway and scripted runners under a long SSE load, every stream verified.

N requests (default 10,000) at a fixed concurrency (default 256), each streamed over SSE
with `stream_options.include_usage`, against 4 scripted runners generating as fast as they
can. Every stream is checked exactly: its text is "tok0 tok1 ... tok{n-1} " (no token lost,
duplicated or reordered), its finish_reason "length", its usage's completion_tokens the
tokens it streamed, and it ends with `data: [DONE]`. Reports throughput, failures (there
must be none), latency percentiles and the gateway's memory and CPU, so that a leak shows
as RSS that grows with the number of requests.

    just soak [--requests 10000] [--concurrency 256] [--tokens 50] [--runners 4]

With `--chaos`, the soak with faults instead: bench/chaos.py (its own options, `--chaos -h`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import orjson
import psutil

from bench.harness import env_note, stack, table

MODEL = "soak"
MIB = 1024 * 1024


class Outcome:
    """One request as the client saw it: None when it was exactly right, else why not."""

    __slots__ = ("error", "latency", "ttft")

    def __init__(self, error: str | None, latency: float, ttft: float) -> None:
        self.error = error
        self.latency = latency
        self.ttft = ttft


def expected(tokens: int) -> str:
    return "".join(f"tok{i} " for i in range(tokens))


class Connection:
    """One keep-alive HTTP/1.1 connection: just enough HTTP for this gateway (a status line,
    headers, a chunked or sized body), so that the client's own CPU does not set the pace
    the way a general-purpose client's would on a small machine."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes, float]:
        """(status, body, seconds to the first chunk carrying text: 0 if none)."""
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        started = time.perf_counter()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            status = int(head[9:12])
            ttft = 0.0
            if b"transfer-encoding: chunked" in head:
                parts: list[bytes] = []
                while size := int((await reader.readline()).split(b";")[0], 16):
                    data = await reader.readexactly(size + 2)
                    if not ttft and b'"content":"tok' in data:
                        ttft = time.perf_counter() - started
                    parts.append(data[:-2])
                await reader.readline()  # the CRLF after the last chunk (no trailers)
                body = b"".join(parts)
            else:
                length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
            if b"connection: close" in head:
                await self.close()
        except BaseException:
            await self.close()
            raise
        return status, body, ttft

    async def close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def check(body: bytes, want: str) -> str | None:
    """Why an SSE body is not exactly the expected stream; None when it is."""
    blocks = [b for b in body.split(b"\n\n") if b and not b.startswith(b":")]
    if not blocks or blocks[-1] != b"data: [DONE]":
        return "no [DONE] at the end"
    text: list[str] = []
    finish = usage = None
    for block in blocks[:-1]:
        if not block.startswith(b"data: "):
            return "malformed event"
        event = orjson.loads(block[6:])
        if "error" in event:
            return f"error event {event['error'].get('code')}"
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    if "".join(text) != want:
        return "wrong text"
    if finish != "length":
        return f"finish_reason {finish}"
    if usage is None or usage["completion_tokens"] != want.count("tok"):
        return "usage differs from what was streamed"
    return None


async def one(conn: Connection, body: dict[str, Any], want: str) -> Outcome:
    """Stream one request and check it exactly."""
    started = time.perf_counter()
    try:
        status, data, ttft = await conn.post("/v1/chat/completions", orjson.dumps(body))
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return Outcome(type(exc).__name__, time.perf_counter() - started, 0.0)
    latency = time.perf_counter() - started
    error = f"HTTP {status}" if status != 200 else check(data, want)
    return Outcome(error, latency, ttft)


async def load(base: str, requests: int, concurrency: int, tokens: int) -> list[Outcome]:
    """`requests` streams, `concurrency` at a time (one worker per connection)."""
    host, port = base.removeprefix("http://").split(":")
    want = expected(tokens)
    outcomes: list[Outcome] = []
    issued = 0
    step = max(1, requests // 10)

    async def worker() -> None:
        nonlocal issued
        conn = Connection(host, int(port))
        try:
            while issued < requests:
                n = issued
                issued += 1
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"soak request {n}"}],
                    "max_tokens": tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                outcomes.append(await one(conn, body, want))
                if len(outcomes) % step == 0:
                    print(f"  {len(outcomes)}/{requests}", file=sys.stderr, flush=True)
        finally:
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    return outcomes


class Sampler:
    """Samples a process's RSS in the background; the peak it saw."""

    def __init__(self, proc: psutil.Process, interval: float = 0.25) -> None:
        self.proc = proc
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss(self.proc))


def rss(proc: psutil.Process) -> int:
    value: int = proc.memory_info().rss
    return value


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def percentile(values: list[float], p: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def run(args: argparse.Namespace) -> int:
    runner_args = [
        [
            "--engine",
            "scripted",
            "--model",
            MODEL,
            "--max-concurrent",
            str(args.max_concurrent),
            "--tokens-per-second",
            str(args.tokens_per_second),
        ]
    ] * args.runners
    with stack(runner_args) as (base, gateway, _):
        gw = psutil.Process(gateway.pid)
        idle = rss(gw)
        # Warm-up (connections, allocator, caches), so that "before" is the steady state.
        warm = asyncio.run(load(base, args.concurrency, args.concurrency, args.tokens))
        before = rss(gw)
        cpu_before = cpu_seconds(gw)
        started = time.perf_counter()
        with Sampler(gw) as sampler:
            outcomes = asyncio.run(load(base, args.requests, args.concurrency, args.tokens))
        elapsed = time.perf_counter() - started
        after = rss(gw)
        gateway_cpu = cpu_seconds(gw) - cpu_before
        runners_left = len(httpx.get(f"{base}/v1/runners", timeout=10).json()["data"])

    failures = Counter(o.error for o in [*warm, *outcomes] if o.error is not None)
    ok = [o for o in outcomes if o.error is None]
    latencies = [o.latency for o in ok]
    ttfts = [o.ttft for o in ok]
    rows: list[list[object]] = [
        ["requests", args.requests],
        ["concurrency", args.concurrency],
        ["tokens per request", args.tokens],
        ["runners, slots each", f"{args.runners}, {args.max_concurrent}"],
        ["failures", sum(failures.values())],
        ["wall time (s)", elapsed],
        ["requests/s", len(ok) / elapsed],
        ["tokens/s", len(ok) * args.tokens / elapsed],
        ["latency p50 (s)", percentile(latencies, 50)],
        ["latency p99 (s)", percentile(latencies, 99)],
        ["first token p50 (s)", percentile(ttfts, 50)],
        ["first token p99 (s)", percentile(ttfts, 99)],
        ["gateway CPU (s)", gateway_cpu],
        ["gateway RSS idle (MiB)", idle / MIB],
        ["gateway RSS before (MiB)", before / MIB],
        ["gateway RSS after (MiB)", after / MIB],
        ["gateway RSS peak (MiB)", max(sampler.peak, after) / MIB],
        ["runners still registered", runners_left],
    ]
    print(table(f"Soak: SSE through the gateway ({env_note()})", ["figure", "value"], rows))
    for reason, count in failures.most_common():
        print(f"- {count}: {reason}")
    return 1 if failures or runners_left != args.runners else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--chaos" in argv:
        from bench import chaos

        return chaos.main([a for a in argv if a != "--chaos"])
    parser = argparse.ArgumentParser(
        prog="just soak", description="Soak the gateway with verified SSE streams."
    )
    parser.add_argument("--requests", type=int, default=10_000, help="requests in all")
    parser.add_argument("--concurrency", type=int, default=256, help="streams at once")
    parser.add_argument("--tokens", type=int, default=50, help="completion tokens per request")
    parser.add_argument("--runners", type=int, default=4, help="scripted runner processes")
    parser.add_argument("--max-concurrent", type=int, default=64, help="slots per runner")
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=0.0,
        help="pace per stream (0: as fast as the runners go)",
    )
    args = parser.parse_args(argv)
    if min(args.requests, args.concurrency, args.tokens, args.runners, args.max_concurrent) < 1:
        parser.error("counts must be at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
