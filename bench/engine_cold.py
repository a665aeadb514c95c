"""Part "cold" of scenario "engine": a fresh gateway + runner per repetition; the first
request as soon as /v1/runners lists the runner, then 5 more, one after another: first TTFT
÷ median of the rest (target ≤ 1.5)."""

from __future__ import annotations

import httpx

from bench.engine_burst import BURST_TOKENS
from bench.engine_common import batched_runner_args, chat_body, engine_env, prompt_text
from bench.harness import median, spawn_process, sse_run, stack, stop_process, table, wait_until

COLD_LATER = 5


def cold(runs: int, model: str) -> None:
    """A fresh runner per repetition on one gateway, warmed by a runner of its own first, so
    that only the runner is cold."""
    rows: list[list[float]] = []
    with stack([]) as (base, _, _), httpx.Client(timeout=300) as client:
        for rep in range(-1, runs):
            name = f"bench-cold-{rep}"
            args = ["--gateway", base, "--name", name, "--log-level", "warning"]
            runner = spawn_process(["runner", *args, *batched_runner_args(model, 8)])
            try:
                wait_until(lambda name=name: _listed(client, base) == [name], 120)
                ttfts = [
                    sse_run(
                        client, base, chat_body(model, prompt_text(f"cold {rep}", i), BURST_TOKENS)
                    )[0]
                    * 1000
                    for i in range(1 + COLD_LATER)
                ]
            finally:
                stop_process(runner)
            later = median(ttfts[1:])
            if rep >= 0:
                rows.append([ttfts[0], later, ttfts[0] / later])
    print(
        table(
            f"cold start: a fresh mlx-batched runner on a warm gateway, the first request once "
            f"/v1/runners lists it, then {COLD_LATER} more; {model}, median of {runs} runs "
            f"({engine_env()})",
            ["first TTFT ms", "later TTFT ms (median)", "first ÷ later (target ≤ 1.5)", "worst"],
            [[*(median([r[i] for r in rows]) for i in range(3)), max(r[2] for r in rows)]],
        )
    )


def _listed(client: httpx.Client, base: str) -> list[str]:
    return [r["name"] for r in client.get(f"{base}/v1/runners").json()["data"]]
