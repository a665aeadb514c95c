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

Responses over SSE and over the WebSocket mode, side by side (`responses_modes`): on a stack
of its own, MODE_STREAMS closed-loop streams ask for the same responses (`POST /v1/responses`
with `stream: true` on a keep-alive connection per stream, or `response.create` on a socket
per stream, `/v1/responses` upgraded), the two modes' windows alternating, `runs` of each, at
both paces. Per mode: tokens/s, gateway CPU µs per token, TTFT p50/p99 (request written →
first text delta read); then what the WebSocket mode adds over SSE (the TTFT difference and
the CPU ratio). `python -m bench.relay --modes [RUNS [TOKENS]]` runs only that table.

A separate stack measures 1,000 idle browser WebSockets (`/v1/ws`, handshake done, no
message): RSS before, while open, after closing; memory per connection.

`python -m bench.relay --profile [SECONDS [STREAMS [RATE]]]` (default 10 s, 64 streams at
50 tok/s: one token per runner frame) runs py-spy on the gateway under that load and prints
the top functions by own and by inclusive samples, with each one's µs per relayed token.

The load processes and the measuring window are bench.relay_load's.
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench import relay_load
from bench.harness import env_note, stack, table
from bench.relay_load import (
    WINDOW_S,
    Load,
    cpu_seconds,
    fd_limit,
    ms,
    pct,
    split,
    warm_up,
    window,
    workers,
)

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
IDLE_SOCKETS = 1000
MODE_STREAMS = 64
MODES = {"responses-sse": "SSE", "responses-ws": "WebSocket"}


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


_MODES_TITLE = (
    "Responses: SSE vs the WebSocket mode, the same {tokens}-token responses, "
    + f"{MODE_STREAMS} streams (a connection or socket each), windows alternating ({{note}})"
)
_MODES_HEADER = [
    "streams",
    "runner pace",
    "mode",
    "tok/s",
    "gateway CPU µs/tok",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "load procs CPU %",
    "responses timed",
    "failed",
]


def _note(load: Load, runs: int) -> str:
    return f"{env_note()}, {len(load.pipes)} load processes, median of {runs} x {WINDOW_S:.0f} s"


def responses_modes(load: Load, runs: int, tokens: int) -> list[list[object]]:
    """Responses over SSE and over the WebSocket mode, alternating windows on one stack."""
    rows: list[list[object]] = []
    med = statistics.median
    with relay_stack(-(-MODE_STREAMS // RUNNERS), probe=False) as (port, gw, rs):
        for api in MODES:
            warm_up(load, port, gw, rs, [(MODEL, 16, tokens, 0.0)], api=api)
        for model, rate in ((PACED_MODEL, FAST_RATE), (MODEL, 0.0)):
            spec = [(model, MODE_STREAMS, tokens, rate)]
            wins: dict[str, list[dict[str, Any]]] = {api: [] for api in MODES}
            for _ in range(runs):
                for api, got in wins.items():
                    got.append(window(load, port, gw, rs, spec, api=api))
            name = "unpaced" if rate == 0 else f"{rate:.0f} tok/s each"
            figures = {}
            for api, got in wins.items():
                flood = [w["groups"][model] for w in got]
                figures[api] = (
                    med([f["tokens"] / w["span"] for f, w in zip(flood, got, strict=True)]),
                    med(
                        [
                            w["gateway_cpu"] / max(1, f["tokens"]) * 1e6
                            for f, w in zip(flood, got, strict=True)
                        ]
                    ),
                    med([ms(pct(f["ttft"], 0.5)) for f in flood]),
                    med([ms(pct(f["ttft"], 0.99)) for f in flood]),
                    " ".join(
                        f"{med([w['client_cpu'][i] * 100 for w in got]):.0f}"
                        for i in range(len(load.pipes))
                    ),
                    sum(len(f["ttft"]) for f in flood),
                    sum(f["failed"] for f in flood),
                )
                rows.append([MODE_STREAMS, name, MODES[api], *figures[api]])
            sse, ws = figures["responses-sse"], figures["responses-ws"]
            rows.append(
                [
                    MODE_STREAMS,
                    name,
                    "WebSocket vs SSE",
                    f"{ws[0] / sse[0]:.2f}x",
                    f"{ws[1] / sse[1]:.2f}x",
                    f"{ws[2] - sse[2]:+.2f}",
                    f"{ws[3] - sse[3]:+.2f}",
                    "",
                    "",
                    "",
                ]
            )
    return rows


def idle_sockets(load: Load) -> list[object]:
    with relay_stack(1, probe=False) as (port, gw, _):
        proc = psutil.Process(gw.pid)
        before = proc.memory_info().rss
        cpu0 = cpu_seconds(proc)
        opened_at = time.perf_counter()
        load.send(
            [{"kind": "ws", "port": port, "n": n} for n in split(IDLE_SOCKETS, len(load.pipes))]
        )
        opened = sum(pipe.recv() for pipe in load.pipes)
        open_s = time.perf_counter() - opened_at
        time.sleep(2.0)
        cpu1 = cpu_seconds(proc)
        during = proc.memory_info().rss
        time.sleep(3.0)
        idle_cpu = (cpu_seconds(proc) - cpu1) / 3.0
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
        modes = responses_modes(load, runs, tokens)
        rows, usage = [], []
        for streams in LEVELS:
            for row, use in _level(load, streams, runs, tokens):
                rows.append(row)
                usage.append(use)
    finally:
        load.close()
    note = _note(load, runs)
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
    print(table(_MODES_TITLE.format(tokens=tokens, note=note), _MODES_HEADER, modes))
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
    fd_limit()
    load = Load(workers())
    raw = Path(tempfile.mkdtemp()) / "gateway.raw"
    spy = Path(sys.executable).parent / "py-spy"
    try:
        args = [runner_args(MODEL, -(-streams // RUNNERS), rate) for _ in range(RUNNERS)]
        with stack(args) as (base, gw, rs):
            port = int(base.rsplit(":", 1)[1])
            # window() reads its timings from bench.relay_load's globals.
            relay_load.WARM_S, relay_load.WINDOW_S = 1.0, seconds + 1.0
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


def modes_only(runs: int, tokens: int) -> None:
    """Only the SSE vs WebSocket-mode table (`python -m bench.relay --modes [RUNS [TOKENS]]`)."""
    fd_limit()
    load = Load(workers())
    try:
        rows = responses_modes(load, runs, tokens)
    finally:
        load.close()
    print(table(_MODES_TITLE.format(tokens=tokens, note=_note(load, runs)), _MODES_HEADER, rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--modes"]:
        modes_only(
            runs=int(sys.argv[2]) if len(sys.argv) > 2 else 5,
            tokens=int(sys.argv[3]) if len(sys.argv) > 3 else 256,
        )
    elif sys.argv[1:2] == ["--profile"]:
        # --profile [SECONDS [STREAMS [RATE]]]
        args = [float(a) for a in sys.argv[2:5]] + [10.0, 64, 50.0][len(sys.argv[2:5]) :]
        profile(args[0], int(args[1]), args[2])
    else:
        main(
            runs=int(sys.argv[1]) if len(sys.argv) > 1 else 1,
            tokens=int(sys.argv[2]) if len(sys.argv) > 2 else 256,
        )
