"""Scenario "paced": how many 50 tok/s streams one gateway carries before clients notice.

Four scripted runners pace every stream at RATE tok/s (a 20 ms beat, like a mid-sized model
on one Mac). The number of concurrent SSE streams grows (50, 100, 150, 200, 300, …) until the p99
inter-token gap seen by clients passes LIMIT_S (twice the beat); the last level under the
limit is the answer. Load and figures as in bench.relay (closed loop over raw sockets in
several load processes; stream starts spread over half a second so the beats are not in
lockstep): gap = arrival of token i minus arrival of token i-1 in one stream (0 when both
came in one read); lateness = a token's delay over the engine's schedule, measured from the
stream's least-delayed token (see bench.relay); CPU of the gateway, of the runners and of
the load processes, so a table says which of them ran out first.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from bench import relay, relay_load
from bench.harness import env_note, stack, table

RATE = 50.0
LIMIT_S = 0.040
LEVELS = (50, 100, 150, 200, 300, 400, 600, 800, 1200, 1600)
MODEL = "paced"


STEPS_MS = (1.0, 5.0)
"""The scripted engine's step (`--step-ms`): 1 ms, many small frames (a pessimistic token
source); 5 ms, closer to a batched engine, whose rows all get their token in one step."""


def main(runs: int, tokens: int) -> None:
    relay_load.fd_limit()
    load = relay_load.Load(relay_load.workers())
    rows: list[list[object]] = []
    results: list[str] = []
    try:
        for step in STEPS_MS:
            passed = _sweep(load, runs, tokens, step, rows)
            results.append(f"step {step:g} ms: {passed if passed else f'< {LEVELS[0]}'} streams")
    finally:
        load.close()
    print(
        table(
            f"paced: {relay.RUNNERS} scripted runners at {RATE:.0f} tok/s per stream → 1 gateway "
            f"→ SSE, {tokens}-token requests ({env_note()}, {len(load.pipes)} load processes, "
            f"median of {runs} x {relay_load.WINDOW_S:.0f} s)",
            [
                "step ms",
                "streams",
                "tok/s (ideal)",
                "gap p50 ms",
                "gap p99 ms",
                "late p50/p99 ms",
                "TTFT steady p50/p99 ms",
                "gateway CPU %",
                "µs/tok",
                "runners CPU %",
                "load procs CPU %",
                "machine busy %",
                "RSS peak MiB",
                "failed",
            ],
            rows,
        )
    )
    print(
        f"\nmost concurrent streams with p99 gap ≤ {LIMIT_S * 1000:.0f} ms: " + "; ".join(results)
    )


def _sweep(
    load: relay_load.Load, runs: int, tokens: int, step: float, rows: list[list[object]]
) -> int:
    """Raise the stream count on a fresh stack until the p99 gap passes the limit."""
    slots = -(-LEVELS[-1] // relay.RUNNERS)
    args = [
        [*relay.runner_args(MODEL, slots, RATE), "--step-ms", str(step)]
        for _ in range(relay.RUNNERS)
    ]
    passed = 0
    with stack(args) as (base, gw, rs):
        port = int(base.rsplit(":", 1)[1])
        relay_load.warm_up(load, port, gw, rs, [(MODEL, 16, tokens, RATE)])
        for streams in LEVELS:
            wins = [
                relay_load.window(load, port, gw, rs, [(MODEL, streams, tokens, RATE)])
                for _ in range(runs)
            ]
            row, p99 = _row(load, wins, streams)
            rows.append([step, *row])
            if p99 > LIMIT_S:
                break
            passed = streams
    return passed


def _row(
    load: relay_load.Load, wins: list[dict[str, Any]], streams: int
) -> tuple[list[object], float]:
    med = statistics.median
    groups = [w["groups"][MODEL] for w in wins]
    span = relay_load.WINDOW_S
    p99 = med([relay_load.pct(g["gaps"], 0.99) for g in groups])
    ms = relay_load.ms
    row: list[object] = [
        streams,
        f"{med([g['tokens'] / span for g in groups]):.0f} ({streams * RATE:.0f})",
        ms(med([relay_load.pct(g["gaps"], 0.5) for g in groups])),
        ms(p99),
        f"{ms(med([relay_load.pct(g['late'], 0.5) for g in groups])):.1f} / "
        f"{ms(med([relay_load.pct(g['late'], 0.99) for g in groups])):.1f}",
        f"{ms(med([relay_load.pct(g['ttft'], 0.5) for g in groups])):.0f} / "
        f"{ms(med([relay_load.pct(g['ttft'], 0.99) for g in groups])):.0f}",
        med([w["gateway_cpu"] / span * 100 for w in wins]),
        med(
            [
                w["gateway_cpu"] / max(1, g["tokens"]) * 1e6
                for w, g in zip(wins, groups, strict=True)
            ]
        ),
        med([w["runner_cpu"] / span * 100 for w in wins]),
        " ".join(
            f"{med([w['client_cpu'][i] * 100 for w in wins]):.0f}" for i in range(len(load.pipes))
        ),
        med([w["machine_busy"] * 100 for w in wins]),
        max(w["rss"][1] for w in wins) / 2**20,
        sum(g["failed"] for g in groups),
    ]
    return row, p99


if __name__ == "__main__":
    main(
        runs=int(sys.argv[1]) if len(sys.argv) > 1 else 1,
        tokens=int(sys.argv[2]) if len(sys.argv) > 2 else 256,
    )
