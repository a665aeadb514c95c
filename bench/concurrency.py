"""Scenario "concurrency": 1, 8 and 32 concurrent streams of one model on one runner.

Backends, each kept up for the whole scenario and measured in alternation, run by run:

- `engine rr` / `engine batched`: `MlxEngine` (round robin) and `batched_engine` driven
  in this process (no relay: what the engine alone can do);
- `orchard rr` / `orchard batched` (`orchard runner --engine mlx` / `mlx-batched`): a
  gateway and one runner process, streamed over SSE;
- `mlx_lm.server`: `python -m mlx_lm server --model DIR`, streamed over SSE.

Every stream has a fresh prompt (no prefix-cache help) and decodes greedily. Figures:
aggregate tok/s (completion tokens of all streams / wall time of the round), the median
per-stream decode tok/s, and TTFT p50 / p99 over all streams of all runs. The late-join
table: the TTFT of a request sent while 7 streams decode.
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from bench.harness import env_note, free_port, sse_run, stack, table
from bench.plot import bar_chart
from protocol.frames import Generate, Message, SamplingParams
from runner.demo_model import resolve_model
from runner.engine.base import Engine, EngineEvent, Failure, Output

MODEL = "orchard-demo"
STREAMS = (1, 8, 32)

Result = tuple[float, float, int]
"""(ttft s, decode tok/s after the first token, completion tokens), as `sse_run`."""
OneStream = Callable[[str, int], Result]
"""Runs one greedy stream of `prompt` text for `max_tokens`."""


class EngineClient:
    """Streams requests straight into an Engine in this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, queue.Queue[EngineEvent]] = {}
        self._lock = threading.Lock()
        self._count = 0
        engine.start(self._sink)

    def _sink(self, event: EngineEvent) -> None:
        with self._lock:
            events = self._queues.get(event.request_id)
        if events is not None:
            events.put(event)

    def run(self, prompt: str, max_tokens: int) -> Result:
        with self._lock:
            self._count += 1
            request_id = f"bench-{self._count}"
            events: queue.Queue[EngineEvent] = queue.Queue()
            self._queues[request_id] = events
        start = time.perf_counter()
        self.engine.submit(
            Generate(
                request_id,
                MODEL,
                (Message("user", prompt),),
                max_tokens=max_tokens,
                sampling=SamplingParams(temperature=0.0),
            )
        )
        first = last = 0.0
        tokens = 0
        while True:
            event = events.get(timeout=300)
            if isinstance(event, Failure):
                raise RuntimeError(event)
            assert isinstance(event, Output)
            now = time.perf_counter()
            first = first or now
            if event.tokens:
                last = now
            if event.finish_reason is not None:
                tokens = event.usage.completion_tokens
                break
        with self._lock:
            del self._queues[request_id]
        return first - start, (tokens - 1) / (last - first) if last > first else 0.0, tokens

    def close(self) -> None:
        self.engine.close()


def http_stream(base: str, model: str) -> OneStream:
    local = threading.local()

    def one(prompt: str, max_tokens: int) -> Result:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=300)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        return sse_run(client, base, body)

    return one


@contextlib.contextmanager
def mlx_lm_server(model_dir: str, max_streams: int) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            "--decode-concurrency",
            str(max_streams),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/v1/models", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("mlx_lm.server did not start")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_round(one: OneStream, streams: int, tokens: int, tag: str) -> tuple[float, list[Result]]:
    """`streams` concurrent streams; (aggregate tok/s, per-stream results)."""
    results: list[Result | None] = [None] * streams
    errors: list[BaseException] = []
    barrier = threading.Barrier(streams)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = one(
                f"{tag} stream {i}: tell me a long story about an old orchard.", tokens
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    done = [r for r in results if r is not None]
    return sum(r[2] for r in done) / wall, done


def _late_join(one: OneStream, tokens: int, tag: str) -> float:
    """TTFT of a request sent while 7 long streams decode."""
    decode_tokens = tokens * 4

    def decoding(i: int) -> None:
        one(f"{tag} decode {i}: tell me a long story about an old orchard.", decode_tokens)

    threads = [threading.Thread(target=decoding, args=(i,)) for i in range(7)]
    for thread in threads:
        thread.start()
    # Past the 7 prefills, well before their end (see the per-stream tok/s figures).
    time.sleep(0.4)
    ttft, _, _ = one(f"{tag} late: a short question about pears?", 8)
    for thread in threads:
        thread.join()
    return ttft


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "concurrency.svg"


def main(runs: int, tokens: int) -> None:
    from runner.engine.batched import batched_engine
    from runner.engine.mlx_engine import MlxEngine

    model_dir = resolve_model(MODEL)
    max_streams = max(STREAMS)
    with contextlib.ExitStack() as stack_:
        backends: dict[str, OneStream] = {}
        rr = EngineClient(MlxEngine(MODEL, max_streams, prefix_cache_size=0))
        stack_.callback(rr.close)
        backends["engine rr"] = rr.run
        batched = EngineClient(batched_engine(MODEL, max_streams, prefix_cache_size=0))
        stack_.callback(batched.close)
        backends["engine batched"] = batched.run
        for name, engine in (("orchard rr", "mlx"), ("orchard batched", "mlx-batched")):
            runner = ["--model", MODEL, "--max-concurrent", str(max_streams), "--engine", engine]
            base, _, _ = stack_.enter_context(stack([runner]))
            backends[name] = http_stream(base, MODEL)
        server = stack_.enter_context(mlx_lm_server(model_dir, max_streams))
        # mlx_lm.server names the model by the path it was given.
        backends["mlx_lm.server"] = http_stream(server, model_dir)

        for name, one in backends.items():  # warm-up: allocator, compilation, connections
            run_round(one, 2, 8, f"warm {name}")

        figures: dict[tuple[str, int], list[tuple[float, list[Result]]]] = {}
        late: dict[str, list[float]] = {name: [] for name in backends}
        for run in range(runs):
            for streams in STREAMS:
                for name, one in backends.items():
                    figures.setdefault((name, streams), []).append(
                        run_round(one, streams, tokens, f"run {run} {name}")
                    )
            for name, one in backends.items():
                late[name].append(_late_join(one, tokens, f"run {run} {name}"))

    rows: list[list[object]] = []
    for streams in STREAMS:
        for name in backends:
            rounds = figures[(name, streams)]
            results = [r for _, rs in rounds for r in rs]
            ttfts = [r[0] * 1000 for r in results]
            rows.append(
                [
                    streams,
                    name,
                    statistics.median(agg for agg, _ in rounds),
                    statistics.median(r[1] for r in results),
                    percentile(ttfts, 0.5),
                    percentile(ttfts, 0.99),
                ]
            )
    print(
        table(
            f"concurrent streams, {MODEL}, {tokens} tokens each, {runs} runs ({env_note()})",
            [
                "streams",
                "backend",
                "aggregate tok/s",
                "per-stream tok/s",
                "TTFT p50 ms",
                "TTFT p99 ms",
            ],
            rows,
        )
    )
    shown = [name for name in backends if not name.startswith("engine")]
    aggregate = {(str(r[1]), int(str(r[0]))): float(str(r[2])) for r in rows}
    bar_chart(
        PLOT,
        f"Aggregate tok/s, {MODEL} on 2 CPU cores ({runs} runs, {tokens} tokens/stream)",
        [f"{n} stream{'s' if n > 1 else ''}" for n in STREAMS],
        {name: [aggregate[(name, n)] for n in STREAMS] for name in shown},
        "tokens/s (all streams)",
    )
    print(f"\nplot: {PLOT}")
    print(
        table(
            f"late join: TTFT of a request sent while 7 streams decode ({runs} runs)",
            ["backend", "TTFT median ms", "TTFT max ms"],
            [[name, statistics.median(v) * 1000, max(v) * 1000] for name, v in late.items()],
        )
    )


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 1, int(sys.argv[2]) if len(sys.argv) > 2 else 64
    )
