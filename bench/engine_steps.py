"""Part "steps" of scenario "engine": decode loops written out as mlx-lm's `generate_step`
runs them (async_eval of step t+1 before waiting on step t), with a `KVCache`, a one-row
`BatchKVCache` and an 8-row one: per step the mean ms of graph build (model call + greedy
sampling in Python), launch (`mx.async_eval`) and wait (the blocking `.tolist()`); and the
primitives in one step's graph (`mx.export_to_dot`), with whether the fused
`ScaledDotProductAttention` is among them.
"""

from __future__ import annotations

import collections
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine_common import InProcessModel, engine_env, prompt_text
from bench.harness import median, table


def _hand_loop(
    m: InProcessModel, rows: int, batch_cache: bool, tag: str, steps: int
) -> list[float]:
    """generate_step's pipelined loop by hand: [build, launch, wait, total] ms per step, then
    tok/s (all rows)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    model = m.model
    async_eval: Any = mx.async_eval  # untyped in MLX's stubs
    pc = time.perf_counter
    build: list[float] = []
    launch: list[float] = []
    wait: list[float] = []
    stamps: list[float] = []
    with mx.stream(generation_stream):
        cache = _cache(model, rows, batch_cache)
        prompts = mx.array([m.prompt(prompt_text(tag, 0))] * rows)
        model(prompts[:, :-1], cache=cache)
        mx.eval([c.state for c in cache])

        def step(y: Any) -> tuple[Any, Any]:
            logits = model(y[:, None], cache=cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logprobs, axis=-1), logprobs

        y, logprobs = step(prompts[:, -1])
        async_eval(y, logprobs)
        for i in range(steps):
            a = pc()
            if i < steps - 1:
                next_y, next_logprobs = step(y)
                b = pc()
                async_eval(next_y, next_logprobs)
                c = pc()
            else:
                b = c = a
            y.tolist()
            d = pc()
            build.append(b - a)
            launch.append(c - b)
            wait.append(d - c)
            stamps.append(d)
            if i < steps - 1:
                y, logprobs = next_y, next_logprobs
    inner = slice(1, max(2, steps - 1))  # the first and last steps are not pipelined
    total = (stamps[-1] - stamps[0]) / max(1, steps - 1)
    return [
        1000 * statistics.mean(build[inner]),
        1000 * statistics.mean(launch[inner]),
        1000 * statistics.mean(wait[inner]),
        1000 * total,
        rows / total,
    ]


def _cache(model: Any, rows: int, batch_cache: bool) -> list[Any]:
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    if batch_cache:
        return [BatchKVCache([0] * rows) for _ in model.layers]
    return list(make_prompt_cache(model))


def _primitives(m: InProcessModel, rows: int, batch_cache: bool) -> collections.Counter[str]:
    """The primitives of one decode step's graph (after a prefill), from `mx.export_to_dot`."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    model = m.model
    with mx.stream(generation_stream), tempfile.TemporaryDirectory() as tmp:
        cache = _cache(model, rows, batch_cache)
        model(mx.array([m.prompt(prompt_text("graph", 0))] * rows), cache=cache)
        mx.eval([c.state for c in cache])
        logits = model(mx.array([[5]] * rows), cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = mx.argmax(logprobs, axis=-1)
        dot = Path(tmp) / "step.dot"
        mx.export_to_dot(str(dot), y, logprobs)
        labels = re.findall(r'label ="([^"]+)"', dot.read_text())
        mx.eval(y, logprobs)
    return collections.Counter(labels)


LOOPS = (("KVCache", 1, False), ("BatchKVCache", 1, True), ("BatchKVCache", 8, True))


def steps(runs: int, tokens: int, model: str, m: InProcessModel) -> None:
    for cache, rows, batch in LOOPS:  # warm-up
        _hand_loop(m, rows, batch, f"warm {cache} {rows}", 16)
    figures: dict[int, list[list[float]]] = collections.defaultdict(list)
    for rep in range(runs):
        for i, (cache, rows, batch) in enumerate(LOOPS):
            figures[i].append(_hand_loop(m, rows, batch, f"run {rep} {cache} {rows}", tokens))
    out: list[list[object]] = []
    for i, (cache, rows, batch) in enumerate(LOOPS):
        build, launch, wait, total, rate = (median(col) for col in zip(*figures[i], strict=True))
        prims = _primitives(m, rows, batch)
        top = ", ".join(f"{k} {v}" for k, v in prims.most_common(5))
        sdpa = "yes" if prims["ScaledDotProductAttention"] else "no"
        out.append([cache, rows, rate, build, launch, wait, total, sum(prims.values()), sdpa, top])
    print(
        table(
            f"decode step by hand, pipelined as generate_step, {model}, {tokens} steps, "
            f"median of {runs} runs of the mean per step ({engine_env()})",
            [
                "cache",
                "rows",
                "tok/s",
                "build ms",
                "launch ms",
                "wait ms",
                "total ms/step",
                "primitives",
                "fused SDPA",
                "most frequent primitives",
            ],
            out,
        )
    )
