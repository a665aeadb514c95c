"""Scenario "metrics": what scraping `GET /metrics` costs the relay at 256 streams.

The relay scenario's stack (bench.relay: four unpaced and four paced scripted runners, one
gateway, closed-loop SSE load processes) carries 256 streams; measuring windows alternate
without and with a scraper thread that fetches `/metrics` every `INTERVAL_S` seconds, as
Prometheus would (at a far shorter interval than its usual 15 s). Reported per runner pace:
relay tok/s and gateway CPU µs per token both ways (medians over the windows), and the
scrape's latency and size.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx

from bench.harness import env_note, table
from bench.relay import FAST_RATE, MODEL, PACED_MODEL, RUNNERS, relay_stack
from bench.relay_load import WINDOW_S, Load, fd_limit, ms, pct, warm_up, window, workers

STREAMS = 256
INTERVAL_S = 1.0


class Scraper(threading.Thread):
    """Fetches /metrics every INTERVAL_S until stopped; records each scrape's time and size."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.stopping = threading.Event()
        self.seconds: list[float] = []
        self.sizes: list[int] = []

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stopping.is_set():
                began = time.perf_counter()
                resp = client.get(self.url)
                resp.raise_for_status()
                self.seconds.append(time.perf_counter() - began)
                self.sizes.append(len(resp.content))
                self.stopping.wait(max(0.0, INTERVAL_S - (time.perf_counter() - began)))

    def stop(self) -> None:
        self.stopping.set()
        self.join()


def _figures(win: dict[str, Any], model: str) -> tuple[float, float]:
    """tok/s and gateway CPU µs per token of one window."""
    tokens = win["groups"][model]["tokens"]
    return tokens / win["span"], win["gateway_cpu"] / max(1, tokens) * 1e6


def main(runs: int, tokens: int) -> None:
    fd_limit()
    load = Load(workers())
    rows = []
    try:
        with relay_stack(-(-STREAMS // RUNNERS), probe=False) as (port, gw, rs):
            warm_up(load, port, gw, rs, [(MODEL, 16, tokens, 0.0)])
            for model, rate in ((MODEL, 0.0), (PACED_MODEL, FAST_RATE)):
                spec = [(model, STREAMS, tokens, rate)]
                plain: list[tuple[float, float]] = []
                scraped: list[tuple[float, float]] = []
                seconds: list[float] = []
                sizes: list[int] = []
                for _ in range(runs):
                    plain.append(_figures(window(load, port, gw, rs, spec), model))
                    scraper = Scraper(port)
                    scraper.start()
                    try:
                        scraped.append(_figures(window(load, port, gw, rs, spec), model))
                    finally:
                        scraper.stop()
                    seconds += scraper.seconds
                    sizes += scraper.sizes
                med = statistics.median
                rows.append(
                    [
                        STREAMS,
                        "unpaced" if rate == 0 else f"{rate:.0f} tok/s each",
                        med(t for t, _ in plain),
                        med(t for t, _ in scraped),
                        med(c for _, c in plain),
                        med(c for _, c in scraped),
                        f"{ms(pct(seconds, 0.5)):.1f} / {ms(max(seconds)):.1f} (n={len(seconds)})",
                        med(sizes) / 1024,
                    ]
                )
    finally:
        load.close()
    note = f"{env_note()}, {len(load.pipes)} load processes, median of {runs} x {WINDOW_S:.0f} s"
    print(
        table(
            f"metrics: relay with and without a /metrics scrape every {INTERVAL_S:g} s "
            f"({tokens}-token requests, {note})",
            [
                "streams",
                "runner pace",
                "tok/s",
                "tok/s scraped",
                "gateway CPU µs/tok",
                "µs/tok scraped",
                "scrape p50/max ms",
                "scrape KiB",
            ],
            rows,
        )
    )
