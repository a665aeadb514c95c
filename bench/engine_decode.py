"""Part "decode" of scenario "engine": greedy decode speed at each stream count, for every
path from in-process `stream_generate` (one stream; the 1.00 reference) through each engine
(`mlx-batched`, `mlx`) stepped in this thread (`_load`, then `_step` in a loop: no engine
thread), each engine on its own thread with the runner's sink (events queued, one
`call_soon_threadsafe` per burst onto an asyncio loop on another thread), to a gateway + one
runner process streamed over SSE.

1 stream: decode tok/s after the first token; N streams: aggregate tokens / wall time from
submit, and the median per-stream decode tok/s. Ratios divide by stream_generate of the same
repetition. Every stream has a fresh prompt (no prefix-cache help). Paths alternate within a
repetition, in an order that rotates per repetition. Stream counts from FEW_RUNS_FROM up run
once, and there the `mlx` (interleaved) paths decode at most MANY_RR_TOKENS tokens per
stream: they make one forward pass per token whatever the stream count, so their aggregate
rate hardly depends on the length, while 64 streams of 256 tokens take about two minutes per
path on 2 CPU cores.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence

from bench.concurrency import Result, http_stream, percentile, run_round
from bench.engine_common import (
    InProcessModel,
    Round,
    RoundFn,
    engine_env,
    prompt_text,
    say,
)
from bench.harness import median, stack, table
from protocol.frames import Generate, Message, SamplingParams
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.mlx_engine import MlxEngine

FEW_RUNS_FROM = 32
"""Stream counts from here on run once per scenario, not `runs` times."""
MANY_RR_TOKENS = 64
"""Most tokens per stream of the interleaved paths from FEW_RUNS_FROM streams on."""
ENGINES = ("mlx-batched", "mlx")
"""The engines, by their `orchard runner --engine` names."""


def _generate(model: str, request_id: str, text: str, tokens: int) -> Generate:
    return Generate(
        request_id,
        model,
        (Message("user", text),),
        max_tokens=tokens,
        sampling=SamplingParams(temperature=0.0),
    )


class Tracker:
    """First and last token times and token counts of one round's requests, from engine events."""

    def __init__(self, ids: Sequence[str], start: float) -> None:
        self.start = start
        self.open = set(ids)
        self.ids = list(ids)
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.failure: Failure | None = None
        self.done = threading.Event()

    def record(self, now: float, event: EngineEvent) -> None:
        rid = event.request_id
        if rid not in self.open:
            return
        if isinstance(event, Failure):
            self.failure = event
            self.done.set()
            return
        assert isinstance(event, Output)
        if event.tokens:
            self.first.setdefault(rid, now)
            self.last[rid] = now
        if event.finish_reason is not None:
            self.tokens[rid] = event.usage.completion_tokens
            self.open.discard(rid)
            if not self.open:
                self.done.set()

    def result(self) -> Round:
        if self.failure is not None:
            raise RuntimeError(f"engine failure: {self.failure}")
        results: list[Result] = []
        for rid in self.ids:
            first, last, n = self.first[rid], self.last[rid], self.tokens[rid]
            rate = (n - 1) / (last - first) if last > first else 0.0
            results.append((first - self.start, rate, n))
        wall = max(self.last.values()) - self.start
        return sum(r[2] for r in results) / wall, results


_ids = itertools.count(1)


def _submits(model: str, tag: str, streams: int, tokens: int) -> tuple[list[Generate], Tracker]:
    requests = [
        _generate(model, f"bench-{next(_ids)}", prompt_text(tag, i), tokens) for i in range(streams)
    ]
    return requests, Tracker([g.request_id for g in requests], time.perf_counter())


class SteppedEngine:
    """An engine driven in this thread: `_load`, then `_step` calls back to back, as its own
    thread would make them, without the thread (nor its locks and wake-ups)."""

    def __init__(self, engine: MlxEngine) -> None:
        self.engine = engine
        self._tracker: Tracker | None = None
        engine._sink = self._on_event
        engine._load()

    def _on_event(self, event: EngineEvent) -> None:
        assert self._tracker is not None
        self._tracker.record(time.perf_counter(), event)

    def round(self, tag: str, streams: int, tokens: int) -> Round:
        engine = self.engine
        requests, tracker = _submits(engine.model_name, tag, streams, tokens)
        self._tracker = tracker
        engine._step(tracker.start, [(g, tracker.start) for g in requests], [])
        while not tracker.done.is_set():
            due = engine._next_step_at(False)
            if due is None:
                raise RuntimeError("the engine went idle with requests open")
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
                now = time.perf_counter()
            engine._step(now, [], [])
        return tracker.result()


class LoopSink:
    """The runner's hand-off (runner.client `_on_engine_event`): events queued on the engine
    thread, one `call_soon_threadsafe` per burst onto an asyncio loop on another thread, where
    they are drained and timed."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self.tracker: Tracker | None = None
        self._events: collections.deque[EngineEvent] = collections.deque()
        self._scheduled = False
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def __call__(self, event: EngineEvent) -> None:
        self._events.append(event)
        if self._scheduled:
            return
        self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._scheduled = False  # before draining: a later event schedules anew
        now = time.perf_counter()
        tracker = self.tracker
        while self._events:
            event = self._events.popleft()
            if tracker is not None:
                tracker.record(now, event)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:  # the runner's loop (orchard.cli runs on uvloop where it is installed)
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class OwnThreadEngine:
    """An engine on its own thread (`start`), its events through a `LoopSink`."""

    def __init__(self, engine: MlxEngine, sink: LoopSink) -> None:
        self.engine = engine
        self.sink = sink
        engine.start(sink)

    def round(self, tag: str, streams: int, tokens: int) -> Round:
        requests, tracker = _submits(self.engine.model_name, tag, streams, tokens)
        self.sink.tracker = tracker
        for request in requests:
            self.engine.submit(request)
        if not tracker.done.wait(600):
            raise RuntimeError("the engine did not finish the round in 600 s")
        return tracker.result()


def _e2e(base: str, model: str) -> RoundFn:
    one = http_stream(base, model)

    def run(tag: str, streams: int, tokens: int) -> Round:
        return run_round(one, streams, tokens, tag)

    return run


SG = "stream_generate (in-process)"
RATIO_NOTE = "1 stream: after the first token; N: aggregate from submit; (÷ stream_generate x1)"


def _paths(
    stack_: contextlib.ExitStack, model: str, streams: Sequence[int], sg: RoundFn
) -> dict[str, RoundFn]:
    from runner.engine.batched import batched_engine

    slots = max(streams)
    makers: dict[str, Callable[[str, int], MlxEngine]] = {
        "mlx-batched": batched_engine,
        "mlx": MlxEngine,
    }
    paths: dict[str, RoundFn] = {SG: sg}
    sink = LoopSink()
    stack_.callback(sink.close)
    for engine in ENGINES:
        paths[f"{engine} stepped (bench thread)"] = SteppedEngine(
            makers[engine](model, slots)
        ).round
        threaded = makers[engine](model, slots)
        stack_.callback(threaded.close)
        paths[f"{engine} threaded (loop sink)"] = OwnThreadEngine(threaded, sink).round
        args = ["--model", model, "--max-concurrent", str(slots), "--engine", engine]
        base, _, _ = stack_.enter_context(stack([args]))
        paths[f"{engine} e2e (gateway + runner, SSE)"] = _e2e(base, model)
    return paths


def decode(runs: int, tokens: int, model: str, streams: Sequence[int], m: InProcessModel) -> None:
    figures: dict[tuple[str, int], list[tuple[int, Round]]] = collections.defaultdict(list)
    with contextlib.ExitStack() as stack_:
        paths = _paths(stack_, model, streams, m.stream_generate)
        names = list(paths)
        for name, run in paths.items():  # warm-up: allocator, KV growth, connections
            run(f"warm {name}", 1 if name == SG else 2, tokens)
        for rep in range(runs):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for n in streams:
                if n >= FEW_RUNS_FROM and rep > 0:
                    continue
                for name in order:
                    if name == SG and n != streams[0]:
                        continue  # one stream only, once per repetition
                    started = time.perf_counter()
                    width = 1 if name == SG else n
                    length = _length(name, width, tokens)
                    result = paths[name](f"run {rep} {name} x{n}", width, length)
                    figures[(name, width)].append((rep, result))
                    say(
                        f"run {rep}: {name} x{width}, {length} tokens: "
                        f"{time.perf_counter() - started:.1f} s"
                    )
    refs = {rep: rnd[1][0][1] for rep, rnd in figures[(SG, 1)]}
    _decode_tables(runs, tokens, model, streams=streams, names=names, figures=figures, refs=refs)


def _length(path: str, streams: int, tokens: int) -> int:
    """Tokens per stream for `path` at `streams` (see MANY_RR_TOKENS)."""
    if path.startswith("mlx ") and streams >= FEW_RUNS_FROM:
        return min(tokens, MANY_RR_TOKENS)
    return tokens


def _decode_tables(
    runs: int,
    tokens: int,
    model: str,
    *,
    streams: Sequence[int],
    names: Sequence[str],
    figures: dict[tuple[str, int], list[tuple[int, Round]]],
    refs: dict[int, float],
) -> None:
    long_rows: list[list[object]] = []
    cells: dict[tuple[str, int], str] = {}
    for n in streams:
        for name in names:
            got = figures.get((name, n))
            if not got:
                continue
            # 1 stream: decode tok/s after the first token; N: aggregate from submit.
            speeds = [rnd[1][0][1] if n == 1 else rnd[0] for _, rnd in got]
            ratios = [s / refs[rep] for s, (rep, _) in zip(speeds, got, strict=True)]
            results = [r for _, rnd in got for r in rnd[1]]
            ttfts = [r[0] * 1000 for r in results]
            cells[(name, n)] = f"{median(speeds):.0f} ({median(ratios):.2f})"
            long_rows.append(
                [
                    n,
                    name,
                    median(speeds),
                    median(ratios),
                    median([r[1] for r in results]),
                    percentile(ttfts, 0.5),
                    percentile(ttfts, 0.99),
                    _length(name, n, tokens),
                    len(got),
                ]
            )
    few = [n for n in streams if n >= FEW_RUNS_FROM]
    note = ""
    if few:
        note = (
            f"; {', '.join(map(str, few))} streams: 1 run, the mlx paths "
            f"{min(tokens, MANY_RR_TOKENS)} tokens per stream"
        )
    print(
        table(
            f"decode tok/s ({RATIO_NOTE}), {model}, {tokens} greedy tokens per stream, "
            f"median of {runs} runs{note} ({engine_env()})",
            ["path", *(f"{n} stream{'s' if n > 1 else ''}" for n in streams)],
            [[name, *(cells.get((name, n), "-") for n in streams)] for name in names],
        )
    )
    print(
        table(
            "decode detail (per-stream tok/s: decode after each stream's first token)",
            [
                "streams",
                "path",
                "tok/s",
                "÷ stream_generate",
                "per-stream tok/s",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "tokens/stream",
                "runs",
            ],
            long_rows,
        )
    )
