"""One member of `bench.distributed`'s figures: `python -m bench.distributed_exchange MODE OUT
N`, started twice with the ring environment; rank 0 writes its figures to OUT.

- exchange: `share_step` alone, N times, with nothing new, one request and eight (µs each,
  and the collectives each took);
- decode: mlx-lm's own `stream_generate` on `orchard-demo-qwen2` split in two pipeline
  stages, N tokens, with and without a `share_step` per token (ms per token): what MLX's
  pipeline costs by itself, and what the exchange adds to it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from protocol.frames import Generate, Message
from runner.demo_model import DEMO_PIPELINE_MODEL_ID, resolve_model
from runner.group.exchange import Exchange, StepMessage


def exchange_figures(exchange: Exchange, steps: int) -> dict[str, float]:
    generate = Generate("r", "m", (Message("user", "A question of a few words."),), max_tokens=256)
    messages = {
        "nothing new": StepMessage(),
        "1 request": StepMessage((generate,)),
        "8 requests": StepMessage(tuple(generate for _ in range(8))),
    }
    figures = {}
    for name, message in messages.items():
        times = []
        before = exchange.collectives
        for _ in range(steps):
            start = time.perf_counter()
            exchange.share_step(message if exchange.rank == 0 else None)
            times.append(time.perf_counter() - start)
        figures[name] = statistics.median(times) * 1e6
        figures[f"{name} collectives"] = (exchange.collectives - before) / steps
    return figures


def decode_figures(exchange: Exchange, tokens: int) -> dict[str, float]:
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import sharded_load

    model, tokenizer = sharded_load(
        resolve_model(DEMO_PIPELINE_MODEL_ID), pipeline_group=exchange.group
    )

    def per_token(share: bool) -> float:
        start = time.perf_counter()
        count = 0
        for _ in stream_generate(model, tokenizer, "Tell me about orchards.", max_tokens=tokens):
            count += 1
            if share:
                exchange.share_step(None)
        return (time.perf_counter() - start) / count * 1000

    per_token(False)  # warm up
    plain = min(per_token(False) for _ in range(3))
    shared = min(per_token(True) for _ in range(3))
    return {"pipeline alone": plain, "pipeline + exchange": shared}


def main() -> None:
    mode, out, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    exchange = Exchange(mx.distributed.init(strict=True, backend="ring"))
    figures = (
        exchange_figures(exchange, count) if mode == "exchange" else decode_figures(exchange, count)
    )
    if exchange.rank == 0:
        out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
