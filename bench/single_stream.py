"""Scenario "single": one stream, through the gateway (SSE) vs in-process mlx-lm.

Each run uses a fresh prompt (no prefix-cache help for either side) and greedy decoding, so
both sides generate the same tokens. Runs alternate in-process / gateway; medians reported.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.harness import env_note, median, sse_run, stack, table

MODEL = "orchard-demo"


def _messages(run: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Run {run}: tell me a long story about an old orchard."}]


def main(runs: int, tokens: int) -> None:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from runner.demo_model import resolve_model

    loaded: Any = load(resolve_model(MODEL))
    model, tokenizer = loaded[0], loaded[1]
    sampler = make_sampler(0.0)

    def in_process(messages: list[dict[str, str]]) -> tuple[float, float, int]:
        start = time.perf_counter()
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        first = last = 0.0
        n = 0
        for response in stream_generate(
            model, tokenizer, prompt, max_tokens=tokens, sampler=sampler
        ):
            last = time.perf_counter()
            first = first or last
            n = response.generation_tokens
        return first - start, (n - 1) / (last - first), n

    rows: dict[str, list[tuple[float, float, int]]] = {"in-process": [], "gateway SSE": []}
    with (
        stack([["--model", MODEL, "--max-concurrent", "1"]]) as (base, _, _),
        httpx.Client(timeout=120) as client,
    ):
        # Warm both paths once (model load, allocator, JIT of the sampler).
        in_process(_messages(-1))
        sse_run(client, base, {"model": MODEL, "messages": _messages(-2), "max_tokens": 8})
        for run in range(runs):
            messages = _messages(run)
            rows["in-process"].append(in_process(messages))
            body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": 0}
            rows["gateway SSE"].append(sse_run(client, base, body))

    ref_ttft = median([r[0] for r in rows["in-process"]])
    out = []
    for name, results in rows.items():
        ttft = median([r[0] for r in results])
        tps = median([r[1] for r in results])
        ratios = [r[1] / ref[1] for r, ref in zip(results, rows["in-process"], strict=True)]
        out.append(
            [
                name,
                median([float(r[2]) for r in results]),
                tps,
                median(ratios),
                ttft * 1000,
                (ttft - ref_ttft) * 1000,
            ]
        )
    print(
        table(
            f"single stream, {MODEL}, {tokens} tokens, median of {runs} runs ({env_note()})",
            ["path", "tokens", "tok/s", "÷ in-process (paired)", "TTFT ms", "TTFT added ms"],
            out,
        )
    )
