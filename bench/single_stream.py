"""Scenario "single": one stream through the gateway (SSE) vs in-process mlx-lm.

Each run uses a fresh prompt (no prefix-cache help for either side) and greedy decoding, so
both sides generate the same tokens. Runs alternate in-process / gateway; medians of the
per-run figures and of the paired ratios are reported. In-process timings come from a
separate worker process (bench.inprocess), given the same CPUs as the runner.

Two layouts, both printed:
- shared: every process may use every CPU (what `orchard serve` on one machine does);
- pinned: runner and in-process worker on CPU 0, gateway and client on CPU 1, so the
  figure isolates what the relay adds from CPU contention with MLX's own threads.
"""

from __future__ import annotations

import os

import httpx
from websockets.sync.client import connect

from bench.harness import (
    InProcess,
    env_note,
    median,
    pin_self,
    sse_run,
    stack,
    table,
    ws_run,
)

MODEL = "orchard-demo"


def _messages(run: int, path: str = "") -> list[dict[str, str]]:
    text = f"Run {run} {path}: tell me a long story about an old orchard."
    return [{"role": "user", "content": text}]


def _body(run: int, path: str, tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": _messages(run, path),
        "max_tokens": tokens,
        "temperature": 0,
    }


def _layout(runs: int, tokens: int, pinned: bool) -> list[list[object]]:
    model_cpus = {0} if pinned else None
    relay_cpus = {1} if pinned else None
    all_cpus = os.sched_getaffinity(0)
    inproc = InProcess(MODEL, model_cpus)
    rows: dict[str, list[tuple[float, float, int]]] = {
        "in-process": [],
        "gateway SSE": [],
        "gateway WebSocket": [],
    }
    try:
        with (
            stack(
                [["--model", MODEL, "--max-concurrent", "1"]],
                gateway_cpus=relay_cpus,
                runner_cpus=model_cpus,
            ) as (base, _, _),
            httpx.Client(timeout=120) as client,
            connect(base.replace("http", "ws") + "/v1/ws", max_size=None) as ws,
        ):
            pin_self(relay_cpus)
            # Warm both paths once (allocator, sampler compilation).
            inproc.run(_messages(-1), 16)
            sse_run(client, base, {"model": MODEL, "messages": _messages(-2), "max_tokens": 16})
            ws_run(ws, {"model": MODEL, "messages": _messages(-3), "max_tokens": 16})
            for run in range(runs):
                # A fresh prompt per path: the runner's prefix cache must not help one path.
                rows["in-process"].append(inproc.run(_messages(run, "local"), tokens))
                rows["gateway SSE"].append(sse_run(client, base, _body(run, "sse", tokens)))
                rows["gateway WebSocket"].append(ws_run(ws, _body(run, "ws", tokens)))
    finally:
        inproc.close()
        os.sched_setaffinity(0, all_cpus)

    ref = rows["in-process"]
    ref_ttft = median([r[0] for r in ref])
    out: list[list[object]] = []
    for name, results in rows.items():
        ttft = median([r[0] for r in results])
        ratios = [r[1] / base_r[1] for r, base_r in zip(results, ref, strict=True)]
        out.append(
            [
                "pinned" if pinned else "shared",
                name,
                median([float(r[2]) for r in results]),
                median([r[1] for r in results]),
                median(ratios),
                ttft * 1000,
                (ttft - ref_ttft) * 1000,
            ]
        )
    return out


def main(runs: int, tokens: int) -> None:
    rows = _layout(runs, tokens, pinned=False)
    if len(os.sched_getaffinity(0)) >= 2:
        rows += _layout(runs, tokens, pinned=True)
    print(
        table(
            f"single stream, {MODEL}, {tokens} tokens, median of {runs} runs ({env_note()})",
            [
                "CPUs",
                "path",
                "tokens",
                "tok/s",
                "÷ in-process (paired)",
                "TTFT ms",
                "TTFT added ms",
            ],
            rows,
        )
    )
