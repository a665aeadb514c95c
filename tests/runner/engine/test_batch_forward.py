"""Forced text in a batch step (runner.engine.batch_forward): constrained batch rows are fed
their forced tokens with their sampled one, and every row writes what it writes decoded a
token at a time, beside free rows, rows with penalties and rows fed runs of other lengths;
`max_tokens` and stop strings cut where they would, and the cache kept is right."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
)

from protocol.frames import Generate, SamplingParams
from runner.demo_families import FAMILIES
from runner.demo_model import DEMO_MODEL_ID
from runner.engine import batch_forward
from runner.engine.batched import batched_engine
from tests.runner.collect import engine_starter, final, hold, run, text_of
from tests.runner.engine.constraint_cases import CRATES, crates, schema_format, stepwise
from tests.runner.engine.family_cases import WEATHER
from tests.runner.engine.family_cases import ask as family_ask
from tests.runner.engines import GREEDY, Reference, ask

PENALTIES = SamplingParams(temperature=0, frequency_penalty=1.5)


@pytest.fixture
def start(demo_model_path: Path) -> Iterator[Any]:
    with engine_starter(lambda **options: batched_engine(DEMO_MODEL_ID, **options)) as start:
        yield start


@pytest.fixture
def widths(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Each fed step's rows: how many tokens each row was given. Rows are fed when half a
    step's inputs are real tokens (on a CPU the runner asks for more: rows of the tests'
    small batches would rarely be fed; the policy has its own test)."""
    monkeypatch.setattr(batch_forward, "MIN_REAL", 0.5)
    steps: list[list[int]] = []
    forward = batch_forward.forward

    def recorded(model: Any, inputs: Any, extras: list[list[int]], cache: list[Any]) -> Any:
        steps.append([1 + len(extra) for extra in extras])
        return forward(model, inputs, extras, cache)

    monkeypatch.setattr(batch_forward, "forward", recorded)
    return steps


def together(engine: Any, collector: Any, requests: list[Generate]) -> dict[str, list[int]]:
    """Run `requests` as rows of one batch from their first step: each one's tokens."""
    gate = ask(f"gate-{requests[0].request_id}", max_tokens=1, sampling=GREEDY)
    release = hold(engine, collector, gate)
    for request in requests:
        engine.submit(request)
    release.set()
    for request in requests:
        collector.wait(request.request_id)
    assert engine.stats.peak_batch_size == len(requests)
    made = dict(engine.stats.recent_tokens)
    return {request.request_id: list(made[request.request_id]) for request in requests}


def test_batch_rows_are_fed_their_forced_text_and_write_the_same_tokens(
    start: Any, reference: Reference, widths: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What mlx-lm's batch says each finished row's cache holds.
    held: list[list[int]] = []
    step = GenerationBatch.next

    def recorded(self: GenerationBatch) -> Any:
        responses = step(self)
        held.extend(list(r.all_tokens or ()) for r in responses if r.finish_reason is not None)
        return responses

    monkeypatch.setattr(GenerationBatch, "next", recorded)
    requests = [
        crates("pears", "Pears?"),
        crates("figs", "Figs, please."),
        crates("plums", "Plums?", sampling=PENALTIES),  # penalties: never fed
        ask("free", "Apples?", max_tokens=120, sampling=GREEDY),
    ]
    engine, collector = start(max_concurrent=4)
    made = together(engine, collector, requests)
    for request in requests:
        assert made[request.request_id] == stepwise(reference, request), request.request_id
    for name in ("pears", "figs", "plums"):
        events = collector.wait(name)
        jsonschema.validate(json.loads(text_of(events)), CRATES)
        assert final(events).usage.completion_tokens == len(made[name])
        prompt = reference.prompt(next(r for r in requests if r.request_id == name))
        assert prompt + made[name] in held, name
    # The two forcing rows were fed most of their forced text in the steps they shared with
    # the others: rows of different lengths in one step (padded), the free row and the row
    # with penalties a token a step.
    assert widths
    fed = sum(sum(row) - len(row) for row in widths)
    assert fed > (len(made["pears"]) + len(made["figs"])) / 3, (fed, widths)
    assert any(len(set(row)) > 1 for row in widths)
    assert all(row[2] == 1 and row[3] == 1 for row in widths if len(row) == 4)


def test_max_tokens_and_stop_strings_cut_fed_rows_where_they_would(
    start: Any, reference: Reference, widths: list[list[int]]
) -> None:
    engine, collector = start(max_concurrent=4)
    expected = stepwise(reference, crates("x"))
    for limit in (3, 4, 7, 12, 20):
        made = together(
            engine,
            collector,
            [crates(f"max{limit}", max_tokens=limit), crates(f"other{limit}", "Figs?")],
        )
        last = final(collector.wait(f"max{limit}"))
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == limit == len(made[f"max{limit}"])
        assert made[f"max{limit}"] == expected[:limit]
    assert widths
    # `"n` ends inside forced text (`, "n": `): the row's cache was fed past the stop. A
    # prompt of its own: no cache of it is kept yet.
    expected = stepwise(reference, crates("x", "Stop?"))
    text = reference.tokenizer.decode(expected[:-1])
    widths.clear()
    together(engine, collector, [crates("stop", "Stop?", stop=('"n',)), crates("figs", "Figs?")])
    events = collector.wait("stop")
    assert final(events).finish_reason == "stop"
    assert text_of(events) == text[: text.index('"n')]
    assert widths
    # The cache kept is the prompt and the tokens given: the same prompt reuses it.
    again = together(engine, collector, [crates("again", "Stop?"), crates("figs2", "Figs?")])
    assert final(collector.wait("again")).usage.cached_tokens == (
        len(reference.prompt(crates("x", "Stop?"))) - 1
    )
    assert again["again"] == expected


@attrs.define
class _Row:
    upcoming_tokens: list[int]
    forcing: bool = True
    started: bool = True
    error: str | None = None

    def upcoming(self) -> list[int]:
        return list(self.upcoming_tokens)


@attrs.define
class _Layer:
    keys: Any
    values: Any


@attrs.define
class _Batch:
    uids: list[int]
    max_tokens: list[int]
    _num_tokens: list[int]
    logits_processors: list[list[Any]]
    prompt_cache: list[Any]


def _rows(*runs: int) -> list[tuple[int, Any]]:
    """Rows 0, 1, … whose grammars force runs of these lengths."""
    return [(index, _Row([index + 1] * run)) for index, run in enumerate(runs)]


def _batch(rows: int, *, max_tokens: int = 100, nbytes: int = 0) -> _Batch:
    keys = mx.zeros((nbytes // 2,), dtype=mx.uint8)
    return _Batch(
        list(range(rows)),
        [max_tokens] * rows,
        [0] * rows,
        [[] for _ in range(rows)],
        [_Layer(keys, keys)],
    )


def test_the_plan_feeds_runs_worth_their_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_forward, "MIN_REAL", 0.5)
    # Two rows of eight fed runs of 5 and 3: width 6 would be 8 + 8 real inputs of 48, 5 is
    # 15 of 40, 4 is 14 of 32; width 3 is 12 of 24, half.
    rows = _rows(5, 3)
    assert batch_forward.plan(_batch(8), rows) == {0: [1] * 2, 1: [2] * 2}
    # Asking for 0.9 real: two rows of their own, width 6 would be 10 real of 12; width 5 is
    # 9 of 10.
    monkeypatch.setattr(batch_forward, "MIN_REAL", 0.9)
    assert batch_forward.plan(_batch(2), rows) == {0: [1] * 4, 1: [2] * 3}
    monkeypatch.setattr(batch_forward, "MIN_REAL", 0.5)
    # Alone in their batch, each is fed its run, padded to the longer.
    assert batch_forward.plan(_batch(2), rows) == {0: [1] * 5, 1: [2] * 3}
    # At most MAX_FED, and room for the sampled token and one more under max_tokens.
    assert batch_forward.plan(_batch(1), _rows(40)) == {0: [1] * batch_forward.MAX_FED}
    assert batch_forward.plan(_batch(1, max_tokens=5), _rows(9)) == {0: [1] * 3}
    assert batch_forward.plan(_batch(1, max_tokens=2), _rows(9)) == {}
    # Padding rolls the caches: not over ROLL_BYTES. Rows fed alike need no padding.
    big = batch_forward.ROLL_BYTES
    assert batch_forward.plan(_batch(2, nbytes=big + 2), rows) == {}
    assert batch_forward.plan(_batch(2, nbytes=big + 2), _rows(3, 3)) == {0: [1] * 3, 1: [2] * 3}


def test_only_forcing_rows_without_processors_on_caches_that_take_padded_steps_are_fed() -> None:
    batch = _batch(2)
    assert batch_forward.feedable(batch, 0, _Row([1]))
    assert not batch_forward.feedable(batch, 0, _Row([1], forcing=False))
    assert not batch_forward.feedable(batch, 0, _Row([1], started=False))
    assert not batch_forward.feedable(batch, 0, _Row([1], error="no"))
    batch.logits_processors[1] = [object()]
    assert not batch_forward.feedable(batch, 1, _Row([1]))
    assert batch_forward.padded_steps([BatchKVCache([0, 0])])
    assert batch_forward.padded_steps([BatchKVCache([0]), BatchRotatingKVCache(8, [0])])
    assert batch_forward.padded_steps([ArraysCache(2, left_padding=[0]), BatchKVCache([0])])
    assert not batch_forward.padded_steps([])
    assert not batch_forward.padded_steps([BatchKVCache([0]), KVCache()])  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_rows_write_the_same_tokens_fed_or_not(
    family: str, widths: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two JSON answers and two forced calls, in one batch: fed (half a step's inputs real
    # tokens, as the `widths` fixture sets) and not (all of them, never). Plain attention,
    # sliding windows (Harmony, Gemma 4) and recurrent layers (LFM2) alike.
    model_id = FAMILIES[family].model_id

    def requests(tag: str) -> list[Generate]:
        def one(name: str, prompt: str, **fields: Any) -> Generate:
            return family_ask(family, f"{tag}-{name}", prompt, sampling=GREEDY, **fields)

        return [
            one("json1", "Crates?", response_format=schema_format(CRATES), max_tokens=160),
            one("json2", "Crates, please.", response_format=schema_format(CRATES), max_tokens=160),
            one("call1", "Weather?", tools=(WEATHER,), tool_choice="required"),
            one("call2", "Weather in Paris?", tools=(WEATHER,), tool_choice="required"),
        ]

    with engine_starter(lambda **options: batched_engine(model_id, **options)) as start:
        engine, collector = start(max_concurrent=4)
        fed = together(engine, collector, requests("fed"))
        assert widths
        monkeypatch.setattr(batch_forward, "MIN_REAL", 2.0)
        steps = len(widths)
        plain = together(engine, collector, requests("plain"))
        assert len(widths) == steps
    made = {name.split("-", 1)[1]: tokens for name, tokens in fed.items()}
    for name, tokens in plain.items():
        assert made[name.split("-", 1)[1]] == tokens, name


@pytest.mark.parametrize("family", ["gemma4", "lfm2"])
def test_a_row_joining_a_batch_past_its_window_is_fed_and_writes_what_it_writes_alone(
    family: str, widths: list[list[int]]
) -> None:
    # A long free answer takes the batch's sliding window (128 tokens) past its size, or
    # LFM2's states far along; a short JSON request joins it with much left padding, then
    # takes padded multi-token steps.
    model_id = FAMILIES[family].model_id

    def answer(request_id: str) -> Generate:
        return family_ask(
            family,
            request_id,
            "Crates?",
            response_format=schema_format(CRATES),
            max_tokens=150,
            sampling=GREEDY,
        )

    with engine_starter(lambda **options: batched_engine(model_id, **options)) as start:
        engine, collector = start(max_concurrent=4)
        run(engine, collector, answer("alone"))
        expected = list(dict(engine.stats.recent_tokens)["alone"])
        joined: list[str] = []

        def join(event: Any) -> None:
            if event.request_id == "long" and not joined and event.usage.completion_tokens >= 200:
                joined.append("joined")
                engine.submit(answer("joined"))

        collector.on_event = join
        widths.clear()
        story = "Tell me a long story about " + "apples " * 30
        run(engine, collector, family_ask(family, "long", story, max_tokens=420, sampling=GREEDY))
        collector.wait("joined")
        collector.on_event = None
    assert widths
    assert list(dict(engine.stats.recent_tokens)["joined"]) == expected
