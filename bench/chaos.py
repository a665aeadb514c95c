"""`just soak --chaos`: the soak with faults, every stream verified and classified.

A gateway and 4 scripted runners (real processes) under a steady load of streams in four
dialects at once (chat completions with `stream_options.include_usage`, Anthropic Messages,
Responses, and the browser WebSocket), some of whose clients hang up mid-stream or read with
long pauses (so that the gateway merges their chunks). Meanwhile, on a random schedule
(`--seed`), one fault at a time: a runner SIGKILLed and started again, frozen with SIGSTOP past
the liveness timeout then resumed, or drained with SIGTERM and started again; and
`--gateway-restarts` times, evenly spread, the gateway restarted on the same port (drained,
then killed, alternately), its runners coming back on their own.

Every stream is checked token by token (bench/chaos_dialects.py) and ends up as one of:
complete and exact; a clean error after a correct prefix of the text; refused (429/503 with
Retry-After); cut while the gateway was down; hung up by its client on purpose; or a
violation (a token lost, repeated or reordered, a wrong usage, a broken framing, an unclean
end while the gateway was up, a 404 for the model). Exit status 1 on any violation, on fewer
than 95% of started streams complete, on the gateway's RSS, fds (or tasks) growing, on a
runner not back at the end, or on a process left behind.

    just soak --chaos [--minutes 60] [--seed S] [--concurrency 32] [--fault-every 10]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import random
import shlex
import shutil
import sys
import time
from collections import Counter

import psutil

from bench.chaos_client import stream
from bench.chaos_dialects import (
    BROWSER,
    COMPLETE,
    DIALECTS,
    DISCONNECT,
    DOWN,
    FIREHOSE,
    HUNG_UP,
    NO_CONNECTION,
    NORMAL,
    OUTCOMES,
    REFUSED,
    SLOW,
    VIOLATION,
    Transcript,
    judge,
)
from bench.chaos_fleet import GATEWAY, RUNNER_FAULTS, Fleet
from bench.chaos_watch import TASKS_METRIC, Sample, Verdict, series, verdicts, watch
from bench.harness import env_note, free_port, table

REQUIRED_RATIO = 0.95
HANG_UPS, SLOW_READERS = 0.04, 0.03
"""The share of streams whose client hangs up mid-stream, and of slow readers (SSE only)."""


@dataclasses.dataclass
class Report:
    """What one chaos soak found; `text` is the report printed."""

    outcomes: Counter[tuple[str, str]]
    """(outcome, dialect) → streams."""
    details: Counter[tuple[str, str]]
    """(outcome, why: the error code, the violation) → streams."""
    faults: Counter[str]
    behaviours: Counter[str]
    merged: int
    """Slow readers whose text came in merged chunks."""
    ratio: float
    runners_back: bool
    left: list[int]
    verdicts: list[Verdict]
    samples: list[Sample]
    text: str = ""

    @property
    def violation_count(self) -> int:
        return sum(n for (outcome, _), n in self.outcomes.items() if outcome == VIOLATION)

    @property
    def ok(self) -> bool:
        return (
            self.violation_count == 0
            and self.ratio >= REQUIRED_RATIO
            and self.runners_back
            and not self.left
            and all(v.flat is not False for v in self.verdicts)
        )


async def soak(args: argparse.Namespace) -> Report:
    liveness = args.liveness_timeout
    fleet = Fleet(
        free_port(),
        [
            "--liveness-timeout",
            f"{liveness:g}",
            "--drain-timeout",
            f"{4 * liveness:g}",
            *shlex.split(args.gateway_args),
        ],
        [
            "--engine",
            "scripted",
            "--model",
            "chaos",
            "--max-concurrent",
            str(args.max_concurrent),
            "--tokens-per-second",
            f"{args.tokens_per_second:g}",
            "--liveness-timeout",
            f"{liveness + 0.5:g}",
            "--drain-timeout",
            f"{8 * liveness:g}",
        ],
        args.runners,
        firehose_args=["--engine", "scripted", "--model", FIREHOSE, "--max-concurrent", "64"],
        freeze_s=2 * liveness,
    )
    transcripts: list[Transcript] = []
    samples: list[Sample] = []
    faults: Counter[str] = Counter()
    runners_back = False
    started = time.monotonic()
    try:
        await fleet.healthy()
        if not await fleet.all_registered(60):
            raise RuntimeError(f"the runners did not register; logs in {fleet.logs}")
        started = time.monotonic()
        deadline = started + args.minutes * 60
        # A task group: should one part fail, the others are cancelled and awaited before
        # the fleet closes (a fault still under way could start a process after it).
        async with asyncio.TaskGroup() as group:
            group.create_task(
                watch(
                    lambda: (
                        None if fleet.restarting else (len(fleet.gateways) - 1, fleet.gateway.pid)
                    ),
                    fleet.base,
                    args.sample_every,
                    samples,
                    origin=started,
                    until=deadline,
                )
            )
            group.create_task(
                _load(fleet.port, args, random.Random(args.seed + 1), deadline, transcripts)
            )
            group.create_task(
                _faults(
                    fleet,
                    args,
                    random.Random(args.seed),
                    started=started,
                    deadline=deadline,
                    done=faults,
                )
            )
        runners_back = await fleet.all_registered(30)
    finally:
        await asyncio.to_thread(fleet.close)
    # Ours: the fleet's, and any descendant naming its port (a grandchild, were there one).
    left = fleet.left_running() + [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if f"127.0.0.1:{fleet.port}" in _cmdline(p) or f"--port {fleet.port}" in _cmdline(p)
    ]
    report = _report(
        args,
        fleet,
        origin=started,
        transcripts=transcripts,
        faults=faults,
        samples=samples,
        runners_back=runners_back,
        left=left,
    )
    if report.ok:
        shutil.rmtree(fleet.logs, ignore_errors=True)  # kept, and named, only when it failed
    return report


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


async def _load(
    port: int,
    args: argparse.Namespace,
    rng: random.Random,
    deadline: float,
    out: list[Transcript],
) -> None:
    """`concurrency` clients, each streaming one request after another until the deadline.
    The first few requests cover every dialect and client behaviour once."""
    numbers = itertools.count()
    firsts = [(d, NORMAL) for d in DIALECTS] + [("chat", SLOW), (BROWSER, DISCONNECT)]

    async def client() -> None:
        while time.monotonic() < deadline:
            n = next(numbers)
            if n < len(firsts):
                dialect, behaviour = firsts[n]
            else:
                dialect = rng.choice(DIALECTS)
                roll = rng.random()
                behaviour = (
                    DISCONNECT
                    if roll < HANG_UPS
                    else SLOW
                    if roll < HANG_UPS + SLOW_READERS and dialect != BROWSER
                    else NORMAL
                )
            tokens = args.slow_tokens if behaviour == SLOW else args.tokens
            t = await stream(
                port,
                dialect,
                behaviour,
                tokens=tokens,
                n=n,
                hang_up_after=rng.randint(1, tokens - 1),
            )
            out.append(t)
            if t.status not in (101, 200) or t.end == NO_CONNECTION or not t.pieces:
                await asyncio.sleep(0.5)  # refused, or the gateway is away: back off a little

    await asyncio.gather(*(client() for _ in range(args.concurrency)))


async def _faults(
    fleet: Fleet,
    args: argparse.Namespace,
    rng: random.Random,
    *,
    started: float,
    deadline: float,
    done: Counter[str],
) -> None:
    """One fault at a time, `fault_every` seconds apart on average (±50%), until a quiet
    stretch before the deadline; each runner fault once first (in a random order), then at
    random; the gateway's restarts at evenly spread times."""
    first = list(RUNNER_FAULTS)
    rng.shuffle(first)
    span = deadline - started
    restarts = [
        started + span * (i + 1) / (args.gateway_restarts + 1) for i in range(args.gateway_restarts)
    ]
    quiet = deadline - max(5.0, args.fault_every / 2)
    while True:
        wait = args.fault_every * rng.uniform(0.5, 1.5)
        if time.monotonic() + wait > quiet:
            return
        await asyncio.sleep(wait)
        if restarts and time.monotonic() >= restarts[0]:
            restarts.pop(0)
            kind = GATEWAY
        else:
            kind = first.pop(0) if first else rng.choice(RUNNER_FAULTS)
        await fleet.fault(kind, rng.randrange(len(fleet.runners)))
        done[kind] += 1


def _report(
    args: argparse.Namespace,
    fleet: Fleet,
    *,
    origin: float,
    transcripts: list[Transcript],
    faults: Counter[str],
    samples: list[Sample],
    runners_back: bool,
    left: list[int],
) -> Report:
    outcomes: Counter[tuple[str, str]] = Counter()
    details: Counter[tuple[str, str]] = Counter()
    behaviours: Counter[str] = Counter(t.behaviour for t in transcripts)
    examples: list[str] = []
    for t in transcripts:
        outcome, detail = judge(t, fleet.was_down(t.started, t.ended))
        outcomes[outcome, t.dialect] += 1
        details[outcome, detail] += 1
        if outcome == VIOLATION and len(examples) < 5:
            at = t.started - origin
            examples.append(f"{t.dialect} {t.behaviour} at {at:.1f} s: {detail}, {t.text[-60:]!r}")
    merged = sum(1 for t in transcripts if t.behaviour == SLOW and t.merged)
    total = Counter(o for o, _ in outcomes.elements())
    started = len(transcripts) - total[REFUSED] - total[DOWN] - total[HUNG_UP]
    ratio = total[COMPLETE] / started if started else 0.0
    found = verdicts(samples)
    report = Report(
        outcomes, details, faults, behaviours, merged, ratio, runners_back, left, found, samples
    )
    rows: list[list[object]] = [
        [o, *(outcomes[o, d] for d in DIALECTS), total[o]] for o in OUTCOMES
    ]
    rows.append(
        ["all", *(sum(outcomes[o, d] for o in OUTCOMES) for d in DIALECTS), len(transcripts)]
    )
    parts = [
        table(
            f"Chaos soak: {args.minutes:g} min, seed {args.seed} ({env_note()})",
            ["outcome", *DIALECTS, "all"],
            rows,
        ),
        f"\ncomplete: {total[COMPLETE]} of {started} started streams = {100 * ratio:.2f}% "
        f"(need {100 * REQUIRED_RATIO:.0f}%; started = all - refused - cut while the "
        "gateway was down - hung up on purpose)",
        "faults: " + ", ".join(f"{k} {faults[k]}" for k in (*RUNNER_FAULTS, GATEWAY)),
        "clients: "
        + ", ".join(f"{k} {behaviours[k]}" for k in (NORMAL, DISCONNECT, SLOW))
        + f" (slow readers whose chunks the gateway merged: {merged})",
        f"runners all back at the end: {'yes' if runners_back else 'NO'}; "
        f"processes left: {len(left)}",
    ]
    for (outcome, detail), count in sorted(details.items()):
        if outcome != COMPLETE:
            parts.append(f"- {outcome}, {count}: {detail}")
    parts.extend(f"  e.g. {e}" for e in examples)
    parts.append(
        table(
            f"Gateway every {args.sample_every:g} s (tasks from /metrics `{TASKS_METRIC}`)",
            ["s", "gateway #", "RSS MiB", "fds", "tasks"],
            series(samples),
        )
    )
    for v in found:
        flat = {None: "not judged", True: "flat", False: "GROWING"}[v.flat]
        parts.append(f"gateway #{v.incarnation} ({v.samples} samples): {v.figures} → {flat}")
    if not report.ok:
        parts.append(f"logs: {fleet.logs}")
    parts.append("PASS" if report.ok else "FAIL")
    report.text = "\n".join(parts)
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="just soak --chaos", description="The soak with runner and gateway faults."
    )
    p.add_argument("--minutes", type=float, default=60.0, help="how long the load runs")
    p.add_argument("--seed", type=int, default=None, help="the fault schedule's (default: random)")
    p.add_argument("--concurrency", type=int, default=32, help="streams at once")
    p.add_argument("--tokens", type=int, default=40, help="tokens per stream (at least 16)")
    p.add_argument("--slow-tokens", type=int, default=2000, help="tokens per slow reader")
    p.add_argument("--runners", type=int, default=4, help="scripted runner processes")
    p.add_argument("--max-concurrent", type=int, default=16, help="slots per runner")
    p.add_argument("--tokens-per-second", type=float, default=100.0, help="pace per stream")
    p.add_argument("--fault-every", type=float, default=10.0, help="mean seconds between faults")
    p.add_argument("--gateway-restarts", type=int, default=2, help="gateway restarts in all")
    p.add_argument("--liveness-timeout", type=float, default=2.5, help="the gateway's, in s")
    p.add_argument(
        "--gateway-args",
        default="",
        help='more `orchard gateway` options, one string: --gateway-args="--start-grace 0"',
    )
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    if args.tokens < 16 or args.slow_tokens < 16:
        p.error("--tokens and --slow-tokens must be at least 16 (Responses' minimum)")
    if min(args.concurrency, args.runners, args.max_concurrent) < 1 or args.minutes <= 0:
        p.error("counts and --minutes must be positive")
    report = asyncio.run(soak(args))
    print(report.text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
