"""n > 1 on both mlx engines: one prefill, n rows; each choice's index; exact usage; seeds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.frames import SamplingParams
from runner.accounting import Piece, RequestAccounting
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import Engine, Failure, Output
from runner.engine.generation import Generation
from runner.engine.mlx_engine import MlxEngine
from tests.runner.collect import Collector, SharedEngine, engine_starter, run, shared_engine
from tests.runner.engines import GREEDY, MLX_ENGINES, MakeMlxEngine, Reference, ask


@pytest.fixture(scope="module", params=sorted(MLX_ENGINES))
def make(request: pytest.FixtureRequest) -> MakeMlxEngine:
    """Each mlx engine's maker."""
    return MLX_ENGINES[request.param]


@pytest.fixture(scope="module")
def shared(make: MakeMlxEngine, demo_model_path: Path) -> Iterator[SharedEngine[MlxEngine]]:
    """Each mlx engine, started once for the module's tests."""
    with shared_engine(lambda: make(DEMO_MODEL_ID)) as shared:
        yield shared


@pytest.fixture
def engine(shared: SharedEngine[MlxEngine]) -> Iterator[tuple[Engine, Collector]]:
    """The module's engine, lent to this test."""
    with shared.borrow() as lent:
        yield lent


@pytest.fixture
def fresh(make: MakeMlxEngine) -> Iterator[tuple[Engine, Collector]]:
    """A new engine of the same kind, for a test that needs its state from zero."""
    with engine_starter(lambda: make(DEMO_MODEL_ID)) as start:
        yield start()


def by_choice(events: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        assert isinstance(event, Output)
        texts[event.index] = texts.get(event.index, "") + event.text
    return texts


def test_greedy_choices_are_one_prefill_and_n_rows(
    fresh: tuple[Engine, Collector], reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An engine of its own: with a prefix cache holding other prompts, less is prefilled.
    prefilled: list[int] = []
    real = Generation._prefill

    def prefill(self: Generation, cache: list[Any], tokens: list[int]) -> None:
        prefilled.append(len(tokens))
        real(self, cache, tokens)

    monkeypatch.setattr(Generation, "_prefill", prefill)
    eng, collector = fresh
    request = ask("r1", "A question about plums?", max_tokens=5, sampling=GREEDY, n=3)
    events = run(eng, collector, request)
    prompt = len(reference.prompt(request))
    # The prompt but its last token, once, for all three choices.
    assert prefilled == [prompt - 1]
    texts = by_choice(events)
    assert sorted(texts) == [0, 1, 2]
    _, pieces = reference.greedy(ask("x", "A question about plums?", max_tokens=5))
    assert texts == dict.fromkeys(range(3), "".join(pieces))
    ends = [(e.index, e.choice_finish, e.finish_reason) for e in events if isinstance(e, Output)]
    ends = [end for end in ends if end[1] or end[2]]
    # Two choices end on their own, the last one ends the request.
    assert [end[1:] for end in ends] == [("length", None), ("length", None), (None, "length")]
    assert sorted(end[0] for end in ends) == [0, 1, 2]
    last = events[-1]
    assert isinstance(last, Output)
    assert last.stats is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt, 15)
    # Usage is the whole request's at every output: completion tokens only grow, one a token.
    counts = [e.usage.completion_tokens for e in events if isinstance(e, Output)]
    assert counts == list(range(1, 16))


def test_seeded_choices_differ_and_repeat(engine: tuple[Engine, Collector]) -> None:
    eng, collector = engine
    sampling = SamplingParams(temperature=1.0, seed=42)
    first = by_choice(run(eng, collector, ask("s1", max_tokens=8, sampling=sampling, n=3)))
    again = by_choice(run(eng, collector, ask("s2", max_tokens=8, sampling=sampling, n=3)))
    assert first == again
    assert len(set(first.values())) == 3
    # Choice 0 draws exactly as the same request with n = 1 does.
    alone = by_choice(run(eng, collector, ask("s3", max_tokens=8, sampling=sampling)))
    assert alone[0] == first[0]


def test_cancel_ends_every_choice(engine: tuple[Engine, Collector]) -> None:
    eng, collector = engine
    eng.submit(ask("c1", max_tokens=1000, sampling=GREEDY, n=2))
    collector.wait_for_outputs("c1", 4)
    eng.cancel("c1")
    events = collector.wait("c1")
    ends = [(e.index, e.choice_finish, e.finish_reason) for e in events if isinstance(e, Output)]
    ends = [end for end in ends if end[1] or end[2]]
    assert len(ends) == 2
    assert {end[0] for end in ends} == {0, 1}
    assert [end[1:] for end in ends] == [("cancelled", None), (None, "cancelled")]


def test_a_failing_choice_fails_the_request_and_stops_the_others(
    engine: tuple[Engine, Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = RequestAccounting.feed
    calls = {"n": 0}

    def feed(self: RequestAccounting, token_id: int, text: str) -> Piece:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected failure")
        return real(self, token_id, text)

    monkeypatch.setattr(RequestAccounting, "feed", feed)
    eng, collector = engine
    events = run(eng, collector, ask("f1", max_tokens=50, sampling=GREEDY, n=3))
    assert isinstance(events[-1], Failure)
    assert events[-1].message == "RuntimeError: injected failure"
    assert all(isinstance(e, Output) and e.finish_reason is None for e in events[:-1])
    monkeypatch.setattr(RequestAccounting, "feed", real)
    # The engine goes on serving.
    after = run(eng, collector, ask("f2", max_tokens=3, sampling=GREEDY, n=2))
    assert isinstance(after[-1], Output)
    assert after[-1].finish_reason == "length"
