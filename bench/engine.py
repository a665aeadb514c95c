"""Scenario "engine": where decode time goes, from mlx-lm's own loop to Orchard end to end.

`just bench engine [--runs N] [--tokens N]`; the rest in environment variables, since every
scenario's `main` takes only runs and tokens: BENCH_ENGINE_PARTS (comma-separated parts below,
or "all"; default "decode,steps"), BENCH_ENGINE_STREAMS (default "1,2,4,8,32,64"; 1 is always
added), BENCH_ENGINE_MODEL (default "orchard-demo"). Everything runs on MLX's default device
(in each title), runner processes included.

- decode: greedy decode speed at each stream count, for every path from in-process
  `stream_generate` (one stream; the 1.00 reference) through each engine (`mlx-batched`,
  `mlx`) stepped in this thread (`_load`, then `_step` in a loop: no engine thread), each
  engine on its own thread with the runner's sink (events queued, one
  `call_soon_threadsafe` per burst onto an asyncio loop on another thread), to a gateway + one
  runner process streamed over SSE. 1 stream: decode tok/s after the first token; N streams:
  aggregate tokens / wall time from submit, and the median per-stream decode tok/s. Ratios
  divide by stream_generate of the same repetition. Every stream has a fresh prompt (no
  prefix-cache help). Paths alternate within a repetition, in an order that rotates per
  repetition. Stream counts from FEW_RUNS_FROM up run once, and there the `mlx` (interleaved)
  paths decode at most MANY_RR_TOKENS tokens per stream: they make one forward pass per token
  whatever the stream count, so their aggregate rate hardly depends on the length, while 64
  streams of 256 tokens take about two minutes per path on 2 CPU cores.
- steps: decode loops written out as mlx-lm's `generate_step` runs them (async_eval of step
  t+1 before waiting on step t), with a `KVCache`, a one-row `BatchKVCache` and an 8-row one:
  per step the mean ms of graph build (model call + greedy sampling in Python), launch
  (`mx.async_eval`) and wait (the blocking `.tolist()`); and the primitives in one step's graph
  (`mx.export_to_dot`), with whether the fused `ScaledDotProductAttention` is among them.
- budget: the batched engine's prefill budget on and off, in this process: arrivals beside
  decoding streams and bursts, and the model's prefill cost per token (`engine_budget`).
- burst: 32 short requests sent at the same instant to a gateway + one `mlx-batched` runner
  (--max-concurrent 32): TTFT p50 / p99 over all requests of all repetitions.
- arrivals: on that stack, 4 streams decode, then 16 requests arrive at once: the decoding
  streams' gaps between SSE chunks in the second after the arrival (p50, p99, p99 / p50;
  target ≤ 4), and in the second before it.
- cold: a fresh gateway + runner per repetition; the first request as soon as /v1/runners
  lists the runner, then 5 more, one after another: first TTFT ÷ median of the rest (target
  ≤ 1.5).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import engine_budget
from bench.concurrency import Result, _http, _percentile, _round
from bench.harness import _spawn, _stop, _wait, env_note, median, sse_run, stack, table
from protocol.frames import Generate, Message, SamplingParams
from runner.demo_model import resolve_model
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.mlx_engine import MlxEngine

PARTS = ("decode", "steps", "budget", "burst", "arrivals", "cold")
DEFAULT_PARTS = ("decode", "steps")
DEFAULT_STREAMS: tuple[int, ...] = (1, 2, 4, 8, 32, 64)
FEW_RUNS_FROM = 32
"""Stream counts from here on run once per scenario, not `runs` times."""
MANY_RR_TOKENS = 64
"""Most tokens per stream of the interleaved paths from FEW_RUNS_FROM streams on."""
ENGINES = ("mlx-batched", "mlx")
"""The engines, by their `orchard runner --engine` names."""
BURST = 32
BURST_TOKENS = 16
DECODING = 4
ARRIVING = 16
ARRIVAL_TOKENS = 32
WINDOW_S = 1.0
COLD_LATER = 5

Round = tuple[float, list[Result]]
"""(aggregate tok/s, one `Result` per stream), as `bench.concurrency._round`."""
RoundFn = Callable[[str, int, int], Round]
"""Runs one round: (tag for fresh prompts, streams, max_tokens per stream)."""


def _text(tag: str, i: int) -> str:
    # The prompt bench.concurrency._round sends, so every path sees prompts of one length.
    return f"{tag} stream {i}: tell me a long story about an old orchard."


def _generate(model: str, request_id: str, text: str, tokens: int) -> Generate:
    return Generate(
        request_id,
        model,
        (Message("user", text),),
        max_tokens=tokens,
        sampling=SamplingParams(temperature=0.0),
    )


def _say(message: str) -> None:
    print(f"[bench engine {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# In-process paths.


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
        _generate(model, f"bench-{next(_ids)}", _text(tag, i), tokens) for i in range(streams)
    ]
    return requests, Tracker([g.request_id for g in requests], time.perf_counter())


class InProcessModel:
    """The model loaded with mlx-lm in this process: `stream_generate` and the hand loops."""

    def __init__(self, name: str) -> None:
        from mlx_lm import load

        loaded: Any = load(resolve_model(name))
        self.model: Any = loaded[0]
        self.tokenizer: Any = loaded[1]

    def prompt(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def stream_generate(self, tag: str, streams: int, tokens: int) -> Round:
        """One stream of mlx-lm's `stream_generate`, timed as bench.inprocess times it."""
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        assert streams == 1, "stream_generate serves one stream"
        start = time.perf_counter()
        prompt = self.prompt(_text(tag, 0))
        first = last = 0.0
        n = 0
        for response in stream_generate(
            self.model, self.tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(0.0)
        ):
            last = time.perf_counter()
            first = first or last
            n = response.generation_tokens
        rate = (n - 1) / (last - first) if last > first else 0.0
        return n / (last - start), [(first - start, rate, n)]


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
    one = _http(base, model)

    def run(tag: str, streams: int, tokens: int) -> Round:
        return _round(one, streams, tokens, tag)

    return run


# Part "decode".

SG = "stream_generate (in-process)"
RATIO_NOTE = "1 stream: after the first token; N: aggregate from submit; (÷ stream_generate x1)"


def _paths(
    stack_: contextlib.ExitStack, model: str, streams: Sequence[int], sg: RoundFn
) -> dict[str, RoundFn]:
    from runner.engine.batched import BatchedMlxEngine

    slots = max(streams)
    classes: dict[str, type[MlxEngine]] = {"mlx-batched": BatchedMlxEngine, "mlx": MlxEngine}
    paths: dict[str, RoundFn] = {SG: sg}
    sink = LoopSink()
    stack_.callback(sink.close)
    for engine in ENGINES:
        paths[f"{engine} stepped (bench thread)"] = SteppedEngine(
            classes[engine](model, slots)
        ).round
        threaded = classes[engine](model, slots)
        stack_.callback(threaded.close)
        paths[f"{engine} threaded (loop sink)"] = OwnThreadEngine(threaded, sink).round
        args = ["--model", model, "--max-concurrent", str(slots), "--engine", engine]
        base, _, _ = stack_.enter_context(stack([args]))
        paths[f"{engine} e2e (gateway + runner, SSE)"] = _e2e(base, model)
    return paths


def _decode(runs: int, tokens: int, model: str, streams: Sequence[int], m: InProcessModel) -> None:
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
                    _say(
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
                    _percentile(ttfts, 0.5),
                    _percentile(ttfts, 0.99),
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
            f"median of {runs} runs{note} ({_env()})",
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


# Part "steps".


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
        prompts = mx.array([m.prompt(_text(tag, 0))] * rows)
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
        model(mx.array([m.prompt(_text("graph", 0))] * rows), cache=cache)
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


def _steps(runs: int, tokens: int, model: str, m: InProcessModel) -> None:
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
            f"median of {runs} runs of the mean per step ({_env()})",
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


# Parts "burst", "arrivals" (one gateway + mlx-batched runner) and "cold".


def _runner_args(model: str, slots: int) -> list[str]:
    return ["--model", model, "--max-concurrent", str(slots), "--engine", "mlx-batched"]


def _burst(base: str, model: str, runs: int) -> None:
    one = _http(base, model)
    ttfts: list[float] = []
    walls: list[float] = []
    for rep in range(runs):
        start = time.perf_counter()
        _, results = _round(one, BURST, BURST_TOKENS, f"burst {rep}")
        walls.append(time.perf_counter() - start)
        ttfts += [r[0] * 1000 for r in results]
    print(
        table(
            f"burst: {BURST} requests at once ({BURST_TOKENS} tokens each) → gateway → one "
            f"mlx-batched runner (--max-concurrent {BURST}), {model}, {runs} bursts ({_env()})",
            ["TTFT p50 ms", "TTFT p99 ms", "TTFT max ms", "burst wall s (median)"],
            [[_percentile(ttfts, 0.5), _percentile(ttfts, 0.99), max(ttfts), median(walls)]],
        )
    )


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
                _chat(model, _text(f"{tag} decode", i), 1536),
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
    one = _http(base, model)
    ttfts: list[float] = []

    def arrive(i: int) -> None:
        barrier.wait()
        ttfts.append(one(_text(f"{tag} arrival", i), ARRIVAL_TOKENS)[0] * 1000)

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


def _arrivals(base: str, model: str, runs: int) -> None:
    after: list[float] = []
    before: list[float] = []
    ttfts: list[float] = []
    for rep in range(runs):
        a, b, t = _arrival(base, model, f"arrivals {rep}")
        after += a
        before += b
        ttfts += t
    p50, p99 = _percentile(after, 0.5), _percentile(after, 0.99)
    print(
        table(
            f"arrivals: {ARRIVING} requests ({ARRIVAL_TOKENS} tokens) arrive at once while "
            f"{DECODING} streams decode; the decoding streams' SSE chunk gaps, {runs} runs "
            f"pooled, one mlx-batched runner, {model} ({_env()})",
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
                    _percentile(before, 0.5),
                    p50,
                    p99,
                    max(after),
                    p99 / p50,
                    len(after),
                    _percentile(ttfts, 0.5),
                ]
            ],
        )
    )


def _cold(runs: int, model: str) -> None:
    """A fresh runner per repetition on one gateway, warmed by a runner of its own first, so
    that only the runner is cold."""
    rows: list[list[float]] = []
    with stack([]) as (base, _, _), httpx.Client(timeout=300) as client:
        for rep in range(-1, runs):
            name = f"bench-cold-{rep}"
            args = ["--gateway", base, "--name", name, "--log-level", "warning"]
            runner = _spawn(["runner", *args, *_runner_args(model, 8)])
            try:
                _wait(lambda name=name: _listed(client, base) == [name], 120)
                ttfts = [
                    sse_run(client, base, _chat(model, _text(f"cold {rep}", i), BURST_TOKENS))[0]
                    * 1000
                    for i in range(1 + COLD_LATER)
                ]
            finally:
                _stop(runner)
            later = median(ttfts[1:])
            if rep >= 0:
                rows.append([ttfts[0], later, ttfts[0] / later])
    print(
        table(
            f"cold start: a fresh mlx-batched runner on a warm gateway, the first request once "
            f"/v1/runners lists it, then {COLD_LATER} more; {model}, median of {runs} runs "
            f"({_env()})",
            ["first TTFT ms", "later TTFT ms (median)", "first ÷ later (target ≤ 1.5)", "worst"],
            [[*(median([r[i] for r in rows]) for i in range(3)), max(r[2] for r in rows)]],
        )
    )


def _listed(client: httpx.Client, base: str) -> list[str]:
    return [r["name"] for r in client.get(f"{base}/v1/runners").json()["data"]]


def _chat(model: str, text: str, tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
    }


# The scenario.


def _env() -> str:
    import mlx.core as mx

    return f"MLX {version('mlx')} on {mx.default_device()}, {env_note()}"


def _settings() -> tuple[tuple[str, ...], tuple[int, ...], str]:
    raw = os.environ.get("BENCH_ENGINE_PARTS", ",".join(DEFAULT_PARTS))
    parts = PARTS if raw == "all" else tuple(p.strip() for p in raw.split(",") if p.strip())
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"BENCH_ENGINE_PARTS: unknown part(s) {sorted(unknown)}; use {PARTS}")
    raw_streams = os.environ.get("BENCH_ENGINE_STREAMS")
    streams = DEFAULT_STREAMS
    if raw_streams:
        # 1 always: stream_generate's one stream is every ratio's reference.
        streams = tuple(sorted({1, *(int(s) for s in raw_streams.split(","))}))
    return parts, streams, os.environ.get("BENCH_ENGINE_MODEL", "orchard-demo")


def _command(runs: int, tokens: int) -> str:
    names = ("BENCH_ENGINE_PARTS", "BENCH_ENGINE_STREAMS", "BENCH_ENGINE_MODEL")
    env = " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ)
    return f"command: {env + ' ' if env else ''}just bench engine --runs {runs} --tokens {tokens}"


def main(runs: int, tokens: int) -> None:
    parts, streams, model = _settings()
    started = time.perf_counter()
    if "decode" in parts or "steps" in parts:
        m = InProcessModel(model)
        if "decode" in parts:
            _decode(runs, tokens, model, streams, m)
        if "steps" in parts:
            _steps(runs, tokens, model, m)
    if "budget" in parts:
        engine_budget.budget(runs, model, _env())
    if "burst" in parts or "arrivals" in parts:
        with stack([_runner_args(model, BURST)]) as (base, _, _):
            _round(_http(base, model), 2, 8, "warm")
            if "burst" in parts:
                _round(_http(base, model), BURST, BURST_TOKENS, "warm burst")
                _burst(base, model, runs)
            if "arrivals" in parts:
                _arrivals(base, model, runs)
    if "cold" in parts:
        _cold(runs, model)
    print(f"\n{_command(runs, tokens)}")
    _say(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 1, int(sys.argv[2]) if len(sys.argv) > 2 else 64
    )
