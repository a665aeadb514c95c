"""Scenario "engine": where decode time goes, from mlx-lm's own loop to Orchard end to end.

`just bench engine [--runs N] [--tokens N]`; the rest in environment variables, since every
scenario's `main` takes only runs and tokens: BENCH_ENGINE_PARTS (comma-separated parts below,
or "all"; default "decode,steps"), BENCH_ENGINE_STREAMS (default "1,2,4,8,32,64"; 1 is always
added), BENCH_ENGINE_MODEL (default "orchard-demo"). Everything runs on MLX's default device
(in each title), runner processes included.

The parts, each in a module of its own (whose docstring tells what it measures):

- decode (bench.engine_decode): greedy decode speed at each stream count, for every path from
  in-process `stream_generate` through each engine stepped, threaded, and end to end.
- steps (bench.engine_steps): mlx-lm's pipelined decode loop by hand, per step the graph
  build, launch and wait, and the primitives in one step's graph.
- budget (bench.engine_budget): the batched engine's prefill budget on and off, in this
  process.
- burst (bench.engine_burst): 32 short requests at once to a gateway + one `mlx-batched`
  runner: TTFT p50 / p99.
- arrivals (bench.engine_arrivals): on that stack, 16 requests arrive while 4 streams decode:
  the decoding streams' chunk gaps (target: p99 ÷ p50 ≤ 4).
- cold (bench.engine_cold): a fresh runner per repetition: its first TTFT ÷ the later ones'
  (target ≤ 1.5).
"""

from __future__ import annotations

import os
import sys
import time

from bench import (
    engine_arrivals,
    engine_budget,
    engine_burst,
    engine_cold,
    engine_decode,
    engine_steps,
)
from bench.concurrency import http_stream, run_round
from bench.engine_burst import BURST, BURST_TOKENS
from bench.engine_common import InProcessModel, batched_runner_args, engine_env, say
from bench.harness import stack

PARTS = ("decode", "steps", "budget", "burst", "arrivals", "cold")
DEFAULT_PARTS = ("decode", "steps")
DEFAULT_STREAMS: tuple[int, ...] = (1, 2, 4, 8, 32, 64)


def _settings() -> tuple[tuple[str, ...], tuple[int, ...], str]:
    raw = os.environ.get("BENCH_ENGINE_PARTS", ",".join(DEFAULT_PARTS))
    parts = PARTS if raw == "all" else tuple(p.strip() for p in raw.split(",") if p.strip())
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"BENCH_ENGINE_PARTS: unknown part(s) {sorted(unknown)}; use {PARTS}")
    raw_streams = os.environ.get("BENCH_ENGINE_STREAMS")
    streams = DEFAULT_STREAMS
    if raw_streams:
        # 1 always: stream_generate's one stream is every ratio's reference.
        streams = tuple(sorted({1, *(int(s) for s in raw_streams.split(","))}))
    return parts, streams, os.environ.get("BENCH_ENGINE_MODEL", "orchard-demo")


def _command(runs: int, tokens: int) -> str:
    names = ("BENCH_ENGINE_PARTS", "BENCH_ENGINE_STREAMS", "BENCH_ENGINE_MODEL")
    env = " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ)
    return f"command: {env + ' ' if env else ''}just bench engine --runs {runs} --tokens {tokens}"


def main(runs: int, tokens: int) -> None:
    parts, streams, model = _settings()
    started = time.perf_counter()
    if "decode" in parts or "steps" in parts:
        m = InProcessModel(model)
        if "decode" in parts:
            engine_decode.decode(runs, tokens, model, streams, m)
        if "steps" in parts:
            engine_steps.steps(runs, tokens, model, m)
    if "budget" in parts:
        engine_budget.budget(runs, model, engine_env())
    if "burst" in parts or "arrivals" in parts:
        with stack([batched_runner_args(model, BURST)]) as (base, _, _):
            run_round(http_stream(base, model), 2, 8, "warm")
            if "burst" in parts:
                run_round(http_stream(base, model), BURST, BURST_TOKENS, "warm burst")
                engine_burst.burst(base, model, runs)
            if "arrivals" in parts:
                engine_arrivals.arrivals(base, model, runs)
    if "cold" in parts:
        engine_cold.cold(runs, model)
    print(f"\n{_command(runs, tokens)}")
    say(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 1, int(sys.argv[2]) if len(sys.argv) > 2 else 64
    )
