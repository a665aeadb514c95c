"""The chaos soak's watch on the gateway: RSS, open file descriptors and (when /metrics has it)
the event loop's task count, sampled every few seconds, and whether they stay flat.

Each gateway process (an "incarnation": a restart begins a new one) is judged on its own,
after a warm-up: the median of its last quarter of samples against that of its first
quarter, within a tolerance. One too short to have `MIN_SAMPLES` samples after the warm-up is
reported as such, not judged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Sequence

import httpx
import psutil

TASKS_METRIC = "orchard_gateway_tasks"
"""The gauge this soak would read the gateway's asyncio task count from (not exposed yet)."""
WARMUP = 10.0
"""Seconds of an incarnation's samples left out of the verdict (allocator, caches, sockets)."""
MIN_SAMPLES = 8
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float
    """Seconds since the soak started."""
    incarnation: int
    rss: int
    fds: int
    tasks: float | None


@dataclasses.dataclass(frozen=True)
class Verdict:
    incarnation: int
    samples: int
    figures: str
    flat: bool | None
    """None: too short to judge."""


async def watch(
    pid: Callable[[], tuple[int, int] | None],
    base: str,
    every: float,
    out: list[Sample],
    *,
    origin: float,
    until: float,
) -> None:
    """Sample every `every` seconds from `origin` until `until` (monotonic clock); `pid()`
    gives (incarnation, pid) of the gateway now, None while it restarts (a draining gateway's
    figures are not its steady state)."""
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() + every <= until:
            await asyncio.sleep(every)
            now = pid()
            if now is None:
                continue
            incarnation, gateway = now
            try:
                proc = psutil.Process(gateway)
                rss, fds = int(proc.memory_info().rss), proc.num_fds()
            except psutil.Error:
                continue  # between two incarnations
            out.append(
                Sample(time.monotonic() - origin, incarnation, rss, fds, await _tasks(http, base))
            )


async def _tasks(http: httpx.AsyncClient, base: str) -> float | None:
    try:
        text = (await http.get(f"{base}/metrics")).text
    except httpx.HTTPError:
        return None
    found = re.search(rf"^{TASKS_METRIC}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def verdicts(samples: Sequence[Sample]) -> list[Verdict]:
    """One per incarnation, in order."""
    out = []
    for incarnation in sorted({s.incarnation for s in samples}):
        mine = [s for s in samples if s.incarnation == incarnation]
        judged = [s for s in mine if s.at - mine[0].at >= WARMUP]
        if len(judged) < MIN_SAMPLES:
            out.append(Verdict(incarnation, len(mine), "too short to judge", None))
            continue
        q = len(judged) // 4
        first, last = judged[:q], judged[-q:]
        checks = [
            _check("RSS MiB", [s.rss / MIB for s in first], [s.rss / MIB for s in last], 0.10, 4),
            _check("fds", [s.fds for s in first], [s.fds for s in last], 0.10, 8),
        ]
        if all(s.tasks is not None for s in judged):
            tasks = [float(s.tasks or 0) for s in judged]
            checks.append(_check("tasks", tasks[:q], tasks[-q:], 0.10, 8))
        flat = all(ok for ok, _ in checks)
        out.append(Verdict(incarnation, len(mine), "; ".join(f for _, f in checks), flat))
    return out


def _check(
    name: str, first: Sequence[float], last: Sequence[float], ratio: float, slack: float
) -> tuple[bool, str]:
    """Flat: the last quarter's median at most `ratio` above the first's, plus `slack`."""
    a, b = statistics.median(first), statistics.median(last)
    ok = b <= a * (1 + ratio) + slack
    return ok, f"{name} {a:.1f} → {b:.1f} ({'flat' if ok else 'GROWING'})"


def series(samples: Sequence[Sample], rows: int = 12) -> list[list[object]]:
    """At most `rows` samples, evenly spread, for the report."""
    step = max(1, -(-len(samples) // rows))
    picked = list(samples[::step])
    if samples and picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    return [
        [
            round(s.at),
            s.incarnation,
            s.rss / MIB,
            s.fds,
            "missing" if s.tasks is None else int(s.tasks),
        ]
        for s in picked
    ]
