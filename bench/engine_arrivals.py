"""Part "arrivals" of scenario "engine": on the burst's stack (a gateway + one `mlx-batched`
runner), 4 streams decode, then 16 requests arrive at once: the decoding streams' gaps
between SSE chunks in the second after the arrival (p50, p99, p99 / p50; target ≤ 4), and
in the second before it."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import httpx
import orjson

from bench.concurrency import http_stream, percentile
from bench.engine_common import chat_body, engine_env, prompt_text
from bench.harness import table

DECODING = 4
ARRIVING = 16
ARRIVAL_TOKENS = 32
WINDOW_S = 1.0


def _chunk_times(base: str, body: dict[str, Any], times: list[float], stop: list[float]) -> None:
    """Append each content chunk's arrival time; stop reading (closing the stream, which
    cancels the request) once past `stop[0]`, when set."""
    body = {**body, "stream": True}
    with (
        httpx.Client(timeout=300) as client,
        client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        for line in resp.iter_lines():
            now = time.perf_counter()
            if stop and now > stop[0]:
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = orjson.loads(line[6:]).get("choices")
            if choices and choices[0]["delta"].get("content"):
                times.append(now)


def _arrival(base: str, model: str, tag: str) -> tuple[list[float], list[float], list[float]]:
    """One repetition: (gaps ms in the window after the arrival, gaps ms in the second before
    it, arrivals' TTFT ms)."""
    times: list[list[float]] = [[] for _ in range(DECODING)]
    stop: list[float] = []
    decoders = [
        threading.Thread(
            target=_chunk_times,
            args=(
                base,
                # 1536 tokens outlast the window; the stream is closed after it.
                chat_body(model, prompt_text(f"{tag} decode", i), 1536),
                times[i],
                stop,
            ),
        )
        for i in range(DECODING)
    ]
    for thread in decoders:
        thread.start()
    deadline = time.monotonic() + 120
    while min(map(len, times)) < 16:  # every decoding stream past its prefill
        if time.monotonic() > deadline:
            raise RuntimeError("the decoding streams did not start")
        time.sleep(0.01)
    time.sleep(WINDOW_S)  # a second of steady decoding to compare against
    arrived: list[float] = []
    barrier = threading.Barrier(ARRIVING, action=lambda: arrived.append(time.perf_counter()))
    one = http_stream(base, model)
    ttfts: list[float] = []

    def arrive(i: int) -> None:
        barrier.wait()
        ttfts.append(one(prompt_text(f"{tag} arrival", i), ARRIVAL_TOKENS)[0] * 1000)

    arrivals = [threading.Thread(target=arrive, args=(i,)) for i in range(ARRIVING)]
    for thread in arrivals:
        thread.start()
    while not arrived:
        time.sleep(0.001)
    at = arrived[0]
    stop.append(at + WINDOW_S + 0.1)
    for thread in [*arrivals, *decoders]:
        thread.join()
    after: list[float] = []
    before: list[float] = []
    for stamps in times:
        for a, b in itertools.pairwise(stamps):
            if at <= b <= at + WINDOW_S:
                after.append((b - a) * 1000)
            elif at - WINDOW_S <= b < at:
                before.append((b - a) * 1000)
    return after, before, ttfts


def arrivals(base: str, model: str, runs: int) -> None:
    after: list[float] = []
    before: list[float] = []
    ttfts: list[float] = []
    for rep in range(runs):
        a, b, t = _arrival(base, model, f"arrivals {rep}")
        after += a
        before += b
        ttfts += t
    p50, p99 = percentile(after, 0.5), percentile(after, 0.99)
    print(
        table(
            f"arrivals: {ARRIVING} requests ({ARRIVAL_TOKENS} tokens) arrive at once while "
            f"{DECODING} streams decode; the decoding streams' SSE chunk gaps, {runs} runs "
            f"pooled, one mlx-batched runner, {model} ({engine_env()})",
            [
                "gap p50 before ms",
                f"gap p50 ms ({WINDOW_S:g} s after)",
                "gap p99 ms",
                "gap max ms",
                "p99 ÷ p50 (target ≤ 4)",
                "gaps",
                "arrivals' TTFT p50 ms",
            ],
            [
                [
                    percentile(before, 0.5),
                    p50,
                    p99,
                    max(after),
                    p99 / p50,
                    len(after),
                    percentile(ttfts, 0.5),
                ]
            ],
        )
    )
