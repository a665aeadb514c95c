"""Runner groups (`just bench distributed`): a 2-process group vs one process on the same model.

- end to end through a gateway: TTFT and tok/s at 1 and 8 streams, `orchard-demo-qwen2`
  served by one runner process, then by `--local-group 2` (pipeline split: each process
  holds 2 of its 4 layers, ring backend over loopback);
- the per-step exchange alone (`bench.distributed_exchange`, two ring processes): what rank
  0's step message costs when there is nothing new, one request, or eight; and mlx-lm's own
  `stream_generate` on the split model with and without an exchange per token (what MLX's
  pipeline costs by itself, and what the exchange adds).

On a machine with fewer cores than processes the group cannot be faster: both members, the
gateway and the client share the cores, and a pipeline's stages run one after the other. The
figure to read is the overhead per decode step: 1 / (per-stream tok/s), group minus one
process, against what the exchange alone costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.harness import env_note, median, sse_run, stack, table
from runner.demo_model import DEMO_PIPELINE_MODEL_ID
from runner.group import launch

MODEL = DEMO_PIPELINE_MODEL_ID
STREAMS = (1, 8)


def _round(base: str, streams: int, tokens: int) -> tuple[list[tuple[float, float, int]], float]:
    """`streams` requests at once: each one's (ttft, tok/s, tokens), and the wall time."""
    results: list[tuple[float, float, int]] = []
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about orchards."}],
        "max_tokens": tokens,
        "temperature": 0,
    }

    def one() -> None:
        with httpx.Client(timeout=300) as client:
            results.append(sse_run(client, base, body))

    threads = [threading.Thread(target=one) for _ in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def _end_to_end(runs: int, tokens: int) -> list[list[object]]:
    rows: list[list[object]] = []
    setups = [
        ("1 process", ["--model", MODEL]),
        ("group of 2", ["--model", MODEL, "--local-group", "2"]),
    ]
    for name, args in setups:
        with stack([args]) as (base, _, _):
            _round(base, 8, 8)  # warm: the gateway's and the runner's first request paths
            for streams in STREAMS:
                ttfts, rates, totals = [], [], []
                for _ in range(runs):
                    results, wall = _round(base, streams, tokens)
                    ttfts.append(median([r[0] for r in results]) * 1000)
                    rates.append(median([r[1] for r in results]))
                    totals.append(sum(r[2] for r in results) / wall)
                rate = median(rates)
                rows.append(
                    [
                        name,
                        streams,
                        median(ttfts),
                        rate,
                        median(totals),
                        1000 / rate if rate else 0.0,
                    ]
                )
    return rows


def _members(mode: str, count: int) -> dict[str, float]:
    """Run `bench.distributed_exchange MODE` on two ring processes; rank 0's figures."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out.json"
        command = [sys.executable, "-m", "bench.distributed_exchange", mode, str(out), str(count)]
        members = launch.local_members(command, 2, Path(scratch) / "ring.json")
        procs = [subprocess.Popen([*m.argv], env={**os.environ, **m.env}) for m in members]
        for proc in procs:
            proc.wait(300)
        figures: dict[str, float] = json.loads(out.read_text())
        return figures


def _ms(row: list[object]) -> float:
    value = row[5]
    assert isinstance(value, float)
    return value


def main(runs: int, tokens: int) -> None:
    exchange = _members("exchange", 2000)
    print(
        table(
            "Runner group: the per-step exchange alone "
            f"(2 ring processes on loopback; {env_note()})",
            ["step message", "µs per step (median of 2000)", "collectives"],
            [
                [name, value, exchange[f"{name} collectives"]]
                for name, value in exchange.items()
                if not name.endswith("collectives")
            ],
        )
    )
    decode = _members("decode", tokens)
    print(
        table(
            f"mlx-lm's stream_generate on {MODEL} split in 2 pipeline stages, {tokens} tokens "
            "(best of 3)",
            ["", "ms per token"],
            [[name, value] for name, value in decode.items()],
        )
    )
    rows = _end_to_end(runs, tokens)
    print(
        table(
            f"Runner group vs one process, {MODEL}, {tokens} tokens, greedy "
            f"(median of {runs} runs; {env_note()})",
            ["runner", "streams", "TTFT ms", "tok/s per stream", "tok/s total", "ms per step"],
            rows,
        )
    )
    by = {(r[0], r[1]): r for r in rows}
    for streams in STREAMS:
        single, group = by[("1 process", streams)], by[("group of 2", streams)]
        extra = _ms(group) - _ms(single)
        print(f"\n{streams} stream(s): the group's decode step is {extra:.2f} ms longer")
