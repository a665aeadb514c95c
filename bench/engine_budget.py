"""Part "budget" of scenario "engine": the batched engine's prefill budget, in this process.

The same batched engine (`batched_engine`) on its own thread, with the prefill budget
(`prefill_share`, the default) and without it (None), alternating per repetition:

- arrivals: 4 streams decode, then 16 requests arrive at once; the decoding streams' gaps
  between tokens in the second after the arrival (p50, p99, max) and the arrivals' TTFT;
- burst: 32 requests arrive at once with nothing decoding; their TTFT p50 and p99.

And what a prompt token and a decode step cost on this machine, which sets what any budget
can do: the model's prefill rate for one long prompt and for a burst's many short ones.
In-process, so the gateway's and the clients' share of the CPU does not blur the engine's.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Any

from bench.harness import median, table
from protocol.frames import Generate, Message, SamplingParams
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.batched import batched_engine

DECODING = 4
ARRIVING = 16
BURST = 32
WINDOW_S = 1.0
GREEDY = SamplingParams(temperature=0.0)
SHARES: tuple[float | None, ...] = (3.0, None)


class _Timed:
    """An engine on its own thread; each request's event times."""

    def __init__(self, model: str, share: float | None) -> None:
        self.times: dict[str, list[float]] = {}
        self.ended: set[str] = set()
        self._lock = threading.Lock()
        self.engine = batched_engine(model, BURST, prefill_share=share)
        self.engine.start(self._on_event)
        self._model = model
        self._ids = itertools.count()

    def _on_event(self, event: EngineEvent) -> None:
        now = time.perf_counter()
        with self._lock:
            self.times.setdefault(event.request_id, []).append(now)
            if isinstance(event, Failure) or (isinstance(event, Output) and event.finish_reason):
                self.ended.add(event.request_id)

    def submit(self, text: str, tokens: int) -> str:
        request_id = f"q{next(self._ids)}"
        content = f"{text} {request_id}"
        message = (Message("user", content),)
        self.engine.submit(Generate(request_id, self._model, message, tokens, sampling=GREEDY))
        return request_id

    def wait(self, ids: list[str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(i in self.ended for i in ids):
            if time.monotonic() > deadline:
                raise RuntimeError("requests did not end")
            time.sleep(0.002)

    def count(self, request_id: str) -> int:
        with self._lock:
            return len(self.times.get(request_id, ()))


def _arrivals(timed: _Timed) -> tuple[list[float], list[float]]:
    """Gaps (s) of the decoding streams in the window after 16 arrivals, and the arrivals'
    TTFT (s)."""
    decoding = [timed.submit("Decode a long answer about the orchard", 300) for _ in range(4)]
    while not all(timed.count(i) > 30 for i in decoding):
        time.sleep(0.002)
    arrived = time.perf_counter()
    text = "A new question about apples, pears and the weather in the orchard?"
    arriving = [timed.submit(text, 32) for _ in range(ARRIVING)]
    timed.wait(arriving)
    for request_id in decoding:
        timed.engine.cancel(request_id)
    timed.wait(decoding)
    gaps = []
    for request_id in decoding:
        stamps = timed.times[request_id]
        gaps += [
            b - a for a, b in itertools.pairwise(stamps) if a >= arrived and b <= arrived + WINDOW_S
        ]
    return gaps, [timed.times[i][0] - arrived for i in arriving]


def _burst(timed: _Timed) -> list[float]:
    """TTFT (s) of 32 requests sent at once."""
    sent = time.perf_counter()
    ids = [timed.submit("Burst question about apples and pears?", 16) for _ in range(BURST)]
    timed.wait(ids)
    return [timed.times[i][0] - sent for i in ids]


def _prefill_costs(model_name: str) -> list[list[object]]:
    """Prefill ms per token for one 256-token prompt and for 16 prompts of 20 tokens, and a
    one-row decode step's ms, on the loaded model (best of 5)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from runner.demo_model import resolve_model

    loaded: Any = load(resolve_model(model_name))
    model = loaded[0]

    def best(rows: int, length: int) -> float:
        times = []
        for _ in range(5):
            cache = make_prompt_cache(model)
            tokens = mx.array([[5] * length] * rows)
            start = time.perf_counter()
            mx.eval(model(tokens, cache=cache), [c.state for c in cache])
            times.append(time.perf_counter() - start)
        return min(times) * 1000

    return [
        [f"{rows} x {length}", round(ms := best(rows, length), 1), round(ms / (rows * length), 3)]
        for rows, length in ((1, 1), (1, 256), (16, 20))
    ]


def budget(runs: int, model: str, env: str) -> None:
    """Print the part's tables."""
    rows = _prefill_costs(model)
    print(
        table(
            f"prefill cost, {model}, best of 5 ({env})",
            ["prompts x tokens", "ms", "ms per token"],
            rows,
        )
    )
    engines = {share: _Timed(model, share) for share in SHARES}
    gaps: dict[float | None, list[float]] = {share: [] for share in SHARES}
    arrivals: dict[float | None, list[float]] = {share: [] for share in SHARES}
    bursts: dict[float | None, list[float]] = {share: [] for share in SHARES}
    try:
        for timed in engines.values():  # one untimed round each
            _arrivals(timed)
        for run in range(runs):
            for share in SHARES if run % 2 == 0 else SHARES[::-1]:
                g, a = _arrivals(engines[share])
                gaps[share] += g
                arrivals[share] += a
                bursts[share] += _burst(engines[share])
    finally:
        for timed in engines.values():
            timed.engine.close()
    table_rows = []
    for share in SHARES:
        g = sorted(gaps[share])
        p50, p99 = statistics.median(g), g[min(len(g) - 1, int(0.99 * len(g)))]
        b = sorted(bursts[share])
        table_rows.append(
            [
                "no budget (None)" if share is None else f"prefill_share {share}",
                round(p50 * 1000, 1),
                round(p99 * 1000, 1),
                round(g[-1] * 1000, 1),
                round(p99 / p50, 2),
                round(median(arrivals[share]) * 1000),
                round(statistics.median(b) * 1000),
                round(b[min(len(b) - 1, int(0.99 * len(b)))] * 1000),
            ]
        )
    print(
        table(
            f"prefill budget, in-process batched engine (32 slots), {model}: {DECODING} "
            f"streams decode while {ARRIVING} requests arrive (gaps in the {WINDOW_S:.0f} s "
            f"after), and bursts of {BURST}; {runs} runs pooled ({env})",
            [
                "engine",
                "gap p50 ms",
                "gap p99 ms",
                "gap max ms",
                "p99 ÷ p50",
                "arrivals' TTFT p50 ms",
                "burst TTFT p50 ms",
                "burst TTFT p99 ms",
            ],
            table_rows,
        )
    )
