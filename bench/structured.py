"""Scenario "structured": what constrained decoding costs on the batched engine.

The batched engine (`batched_engine`) on the demo model, driven in this process (no
gateway): tokens/s of requests with a json_schema response format ÷ the same requests as free
text, at 1 and 8 concurrent streams. Both kinds run exactly `tokens` completion tokens (the
schema asks for more items than fit, so neither ends early) and decode greedily; the two
alternate, round by round, and each figure is the median of `runs` rounds. Aggregate tok/s:
completion tokens of all streams / wall time of the round.

Also the compile time of a large schema (bench.schemas.large_schema: 60 properties, $defs,
anyOf, enums, patterns, formats) through `constraint_for`, cold (a schema never seen: its
description differs) and from the cache, on the demo tokenizer.

`--families` (`just bench structured --families`) measures each model family's built-in model
(runner.demo_families) instead: free text, a json_schema answer and forced tool calls
(`tool_choice` required, parallel calls allowed so that a model that never stops calling runs
its `tokens`; a Harmony model calls once and ends its turn, so its forced rounds are short) in
the family's own syntax, at 1 and 8 streams. Forced calls are compared with free text on the
same prompt (the tool in it, `tool_choice` auto): a longer context slows every step. Rates
are decode rates (tokens after a stream's first output / the time from it to its end), summed
over the streams; every request must come back with calls (or JSON) that parse.

`python -m bench.structured --profile [STREAMS]` runs constrained rounds under cProfile and
prints where the engine thread's time goes.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import queue
import statistics
import sys
import threading
import time
from typing import Any

import attrs

from bench.harness import env_note, table
from bench.schemas import large_schema
from protocol.frames import Generate, Message, ResponseFormat, SamplingParams, Tool
from runner.engine.base import EngineEvent, Failure, Output

MODEL = "orchard-demo"
STREAMS = (1, 8)
ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "ripe": {"type": "boolean"},
        "fruit": {"enum": ["apple", "pear", "plum", "cherry", "quince"]},
        "grade": {"anyOf": [{"type": "null"}, {"enum": ["A", "B", "C"]}]},
    },
    "required": ["id", "ripe", "fruit", "grade"],
    "additionalProperties": False,
}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "orchard": {"enum": ["north", "south"]},
        "crates": {"type": "array", "items": ITEM, "minItems": 200, "maxItems": 200},
    },
    "required": ["orchard", "crates"],
    "additionalProperties": False,
}
"""Values any model finishes in a few tokens, and more of them than `tokens` can hold."""
FORMAT = ResponseFormat("json_schema", json.dumps(SCHEMA), "crates", strict=True)
CRATE = Tool(
    "log_crate",
    "Log one crate of fruit.",
    json.dumps(
        {
            **ITEM,
            "properties": {
                **ITEM["properties"],
                # Typed, as every family's template can render (Gemma 4's needs a type).
                "fruit": {"type": "string", **ITEM["properties"]["fruit"]},
                "grade": {"type": "string", "enum": ["A", "B"]},
            },
        }
    ),
)
"""The forced calls' tool: a crate's bounded values, each of one JSON type (what the key/value
formats can carry)."""
Kind = str
"""What a round asks for: "free", "json" (the json_schema), "call" (forced tool calls) or
"free+tools" (free text with the tool in the prompt, tool_choice auto: the forced calls'
baseline, on the same prompt)."""


class Client:
    """Streams requests straight into an engine in this process."""

    def __init__(self, engine: Any) -> None:
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

    def run(self, prompt: str, max_tokens: int, kind: Kind, model: str = MODEL) -> Timed:
        """One greedy request to its end: its completion tokens, and when its first and last
        came. Free text and JSON must run `max_tokens` exactly; forced calls must come back
        as calls."""
        with self._lock:
            self._count += 1
            request_id = f"structured-{self._count}"
            events: queue.Queue[EngineEvent] = queue.Queue()
            self._queues[request_id] = events
        self.engine.submit(request_for(request_id, prompt, max_tokens, kind, model))
        text = []
        calls = 0
        first = None
        while True:
            event = events.get(timeout=300)
            if isinstance(event, Failure):
                raise RuntimeError(event)
            assert isinstance(event, Output)
            if first is None and event.tokens:
                first = (time.perf_counter(), event.usage.completion_tokens)
            text.append(event.text)
            calls += sum(1 for delta in event.tool_calls if delta.id is not None)
            if event.finish_reason is not None:
                used = event.usage.completion_tokens
                # A Harmony model may reason first and reach no call within a short round.
                if kind == "call" and not calls and event.finish_reason != "length":
                    raise RuntimeError(f"no call ({event.finish_reason}): {''.join(text)}")
                if kind != "call" and used != max_tokens:
                    raise RuntimeError(f"ended early ({event.finish_reason}): {''.join(text)}")
                break
        with self._lock:
            del self._queues[request_id]
        assert first is not None
        return Timed(used, first[0], first[1], time.perf_counter())


@attrs.frozen
class Timed:
    """What a request's tokens took."""

    tokens: int
    first_at: float
    first_tokens: int
    """Tokens in its first output (the first, or a few merged)."""
    end_at: float

    @property
    def decode_rate(self) -> float:
        """Tokens after the first output ÷ the time from it to the end: its decoding alone,
        whatever its prompt cost (a forced call's tools make a longer prompt)."""
        return (self.tokens - self.first_tokens) / max(self.end_at - self.first_at, 1e-9)


PROMPT = "share: list the crates."
"""The prompt of `forced_share`'s answers."""


def request_for(request_id: str, prompt: str, max_tokens: int, kind: Kind, model: str) -> Generate:
    """One greedy request of `kind` to `model`."""
    return Generate(
        request_id,
        model,
        (Message("user", prompt),),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
        response_format=FORMAT if kind == "json" else None,
        tools=(CRATE,) if kind in ("call", "free+tools") else (),
        tool_choice="required" if kind == "call" else "auto",
        reasoning_effort=_effort(model),
    )


def forced_share(client: Client, kind: Kind, model: str, tokens: int) -> float:
    """Of one lone greedy answer of `kind`, the share of tokens its grammar forced (fed to
    the model with the token before them: runner.engine.fast_forward)."""
    from runner.engine.mlx_model import MlxModel

    client.run(PROMPT, tokens, kind, model)
    made = list(client.engine.stats.recent_tokens[-1][1])
    loaded = MlxModel.load(model)
    request = loaded.prepare(request_for("share", PROMPT, tokens, kind, model), 0.0)
    assert request.constraint is not None
    processor = request.constraint.processor()
    forced = i = 0
    while i < len(made):
        run = processor.forced(len(made) - i)
        if made[i : i + len(run)] != run:
            raise RuntimeError(f"token {i}: the grammar forces {run}, the answer has others")
        forced += len(run)
        i += len(run)
        if i < len(made):
            processor.consume(made[i])
            i += 1
    return forced / len(made)


def _effort(model: str) -> Any:
    """Families that think get their think span closed (a random model never closes one);
    Harmony reasons at low effort."""
    from runner.demo_families import FAMILIES, family_of

    family = family_of(model)
    if family is None:
        return None
    if family == "harmony":
        return "low"
    return "none" if FAMILIES[family].think else None


def _round(  # noqa: PLR0917 (a bench's knobs)
    client: Client,
    streams: int,
    tokens: int,
    kind: Kind,
    tag: str,
    model: str = MODEL,
    *,
    decoding: bool = False,
) -> tuple[float, float]:
    """`streams` concurrent requests of up to `tokens` tokens each: aggregate tok/s (with
    `decoding`, the sum of the streams' decode rates: prompts of different lengths compared),
    and this process's CPU µs per token (all its threads: a figure the machine's other load
    barely moves)."""
    errors: list[BaseException] = []
    used: list[Timed] = []
    barrier = threading.Barrier(streams)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            used.append(client.run(f"{tag} stream {i}: list the crates.", tokens, kind, model))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    start, cpu = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if errors:
        raise errors[0]
    tokens = sum(timed.tokens for timed in used)
    if decoding:
        return sum(timed.decode_rate for timed in used), cpu / tokens * 1e6
    return tokens / wall, cpu / tokens * 1e6


def compile_times(tokenizer: Any, vocab_size: int, runs: int) -> tuple[float, float]:
    """Seconds for `constraint_for` on the large schema: cold (median of `runs`), cached."""
    from runner.engine.constraint import constraint_for

    def once(description: str) -> float:
        schema = {**large_schema(), "description": description}
        generate = Generate(
            "compile",
            MODEL,
            (Message("user", "x"),),
            response_format=ResponseFormat("json_schema", json.dumps(schema)),
        )
        start = time.perf_counter()
        constraint_for(generate, tokenizer, vocab_size=vocab_size)
        return time.perf_counter() - start

    cold = [once(f"cold {i} {time.time()}") for i in range(runs)]
    once("warm")
    warm = [once("warm") for _ in range(runs)]
    return statistics.median(cold), statistics.median(warm)


def main(runs: int = 5, tokens: int = 256) -> None:
    from runner.engine.batched import batched_engine

    engine = batched_engine(MODEL, max_concurrent=max(STREAMS))
    client = Client(engine)
    try:
        # Warm up: the model, mlx's kernels, the grammar's compilation.
        for kind in ("free", "json"):
            _round(client, max(STREAMS), 32, kind, "warm-up")
        rows = []
        for streams in STREAMS:
            figures: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            ratios = []
            for i in range(runs):
                for constrained in (False, True):
                    kind = "json" if constrained else "free"
                    figures[constrained].append(_round(client, streams, tokens, kind, f"r{i}"))
                ratios.append(figures[True][-1][0] / figures[False][-1][0])
            rows.append(
                [
                    streams,
                    statistics.median(rate for rate, _ in figures[False]),
                    statistics.median(rate for rate, _ in figures[True]),
                    statistics.median(ratios),
                    f"{min(ratios):.3f} to {max(ratios):.3f}",
                    statistics.median(cpu for _, cpu in figures[False]),
                    statistics.median(cpu for _, cpu in figures[True]),
                ]
            )
    finally:
        engine.close()
    from runner.engine.mlx_model import MlxModel

    model = MlxModel.load(MODEL)
    cold, warm = compile_times(model.tokenizer, model.vocab_size, runs)
    print(
        table(
            f"json_schema vs free text, batched engine, {MODEL}, {tokens} tokens a stream, "
            f"{runs} runs ({env_note()})",
            [
                "streams",
                "free tok/s",
                "json_schema tok/s",
                "ratio (median)",
                "ratio range",
                "free CPU µs/token",
                "json_schema CPU µs/token",
            ],
            rows,
        )
    )
    print(
        table(
            "compiling the large schema (60 properties, $defs, anyOf, enums), demo tokenizer",
            ["cold ms", "cached ms"],
            [[cold * 1000, warm * 1000]],
        )
    )


def profile(streams: int, tokens: int = 256, rounds: int = 3) -> None:
    """Constrained rounds with cProfile on the engine thread's batch steps: top functions."""
    from runner.engine.batch_decoder import BatchDecoder
    from runner.engine.batched import batched_engine

    profiler = cProfile.Profile()
    real = BatchDecoder.step
    active = threading.Event()

    def step(self: BatchDecoder) -> None:
        if not active.is_set():
            real(self)
            return
        profiler.enable()  # cProfile follows the thread that enables it: the engine's
        try:
            real(self)
        finally:
            profiler.disable()

    BatchDecoder.step = step  # type: ignore[method-assign]
    engine = batched_engine(MODEL, max_concurrent=streams)
    client = Client(engine)
    try:
        _round(client, streams, 32, "json", "warm-up")
        active.set()
        for i in range(rounds):
            _round(client, streams, tokens, "json", f"p{i}")
        active.clear()
    finally:
        engine.close()
        BatchDecoder.step = real  # type: ignore[method-assign]
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def families(runs: int = 5, tokens: int = 256, only: tuple[str, ...] = ()) -> None:
    """Each family's built-in model (or those named in `only`): json_schema and forced calls
    ÷ free text, at 1 and 8 streams (medians of `runs` alternating rounds)."""
    from runner.demo_families import FAMILIES
    from runner.engine.batched import batched_engine

    rows = []
    shares = []
    for name, family in FAMILIES.items():
        if only and name not in only:
            continue
        engine = batched_engine(family.model_id, max_concurrent=max(STREAMS))
        client = Client(engine)
        kinds = ["free", "json", "free+tools", "call"]
        try:
            for kind in kinds:
                _round(client, max(STREAMS), 32, kind, "warm-up", family.model_id)
            for streams in STREAMS:
                rates: dict[Kind, list[float]] = {kind: [] for kind in kinds}
                for i in range(runs):
                    for kind in kinds:
                        rate, _ = _round(
                            client, streams, tokens, kind, f"r{i}", family.model_id, decoding=True
                        )
                        rates[kind].append(rate)
                row: list[Any] = [family.model_id, streams]
                # Each constrained kind against free text on the same prompt: a forced call's
                # prompt holds the tools, and a longer context makes every step slower.
                for kind, baseline in (("json", "free"), ("call", "free+tools")):
                    ratios = [r / f for r, f in zip(rates[kind], rates[baseline], strict=True)]
                    row += [
                        statistics.median(rates[baseline]),
                        statistics.median(rates[kind]),
                        statistics.median(ratios),
                    ]
                rows.append(row)
            shares.append(
                [
                    family.model_id,
                    forced_share(client, "json", family.model_id, tokens),
                    forced_share(client, "call", family.model_id, tokens),
                ]
            )
        finally:
            engine.close()
    print(
        table(
            f"json_schema and forced calls vs free text per family, batched engine, decode "
            f"tok/s (all streams), up to {tokens} tokens a stream, medians of {runs} rounds "
            f"({env_note()})",
            [
                "model",
                "streams",
                "free tok/s",
                "json_schema tok/s",
                "json ÷ free",
                "free, tools in the prompt",
                "forced call tok/s",
                "call ÷ free with tools",
            ],
            rows,
        )
    )
    print(
        table(
            f"share of a lone greedy answer's tokens its grammar forced (fed in one forward "
            f"pass with the token before them), up to {tokens} tokens",
            ["model", "json_schema", "forced call"],
            [[model, f"{share:.2f}", f"{call:.2f}"] for model, share, call in shares],
        )
    )


if __name__ == "__main__":
    if "--families" in sys.argv:
        families()
    elif "--profile" in sys.argv:
        profile(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
