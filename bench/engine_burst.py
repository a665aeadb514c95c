"""Part "burst" of scenario "engine": 32 short requests sent at the same instant to a gateway
+ one `mlx-batched` runner (--max-concurrent 32): TTFT p50 / p99 over all requests of all
repetitions."""

from __future__ import annotations

import time

from bench.concurrency import http_stream, percentile, run_round
from bench.engine_common import engine_env
from bench.harness import median, table

BURST = 32
BURST_TOKENS = 16


def burst(base: str, model: str, runs: int) -> None:
    one = http_stream(base, model)
    ttfts: list[float] = []
    walls: list[float] = []
    for rep in range(runs):
        start = time.perf_counter()
        _, results = run_round(one, BURST, BURST_TOKENS, f"burst {rep}")
        walls.append(time.perf_counter() - start)
        ttfts += [r[0] * 1000 for r in results]
    print(
        table(
            f"burst: {BURST} requests at once ({BURST_TOKENS} tokens each) → gateway → one "
            f"mlx-batched runner (--max-concurrent {BURST}), {model}, {runs} bursts "
            f"({engine_env()})",
            ["TTFT p50 ms", "TTFT p99 ms", "TTFT max ms", "burst wall s (median)"],
            [[percentile(ttfts, 0.5), percentile(ttfts, 0.99), max(ttfts), median(walls)]],
        )
    )
