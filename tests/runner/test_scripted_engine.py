"""ScriptedEngine: the documented output, usage and event contract, without a model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from protocol.frames import Generate, Message, ModelInfo, Usage
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.scripted import ScriptedEngine, scripted_prompt_tokens
from tests.runner.collect import Collector, final, outputs, text_of
from tests.support import UNIT

MESSAGES = (Message("system", "Be brief."), Message("user", "Hello there, engine"))


def ask(request_id: str, model: str = "scripted", **fields: Any) -> Generate:
    return Generate(request_id, model, MESSAGES, **fields)


@pytest.fixture
def collector() -> Collector:
    return Collector()


@pytest.fixture
def engines(collector: Collector) -> Iterator[list[ScriptedEngine]]:
    started: list[ScriptedEngine] = []
    yield started
    for engine in started:
        engine.close()


def start(engines: list[ScriptedEngine], collector: Collector, **options: Any) -> ScriptedEngine:
    engine = ScriptedEngine(**options)
    engine.start(collector)
    engines.append(engine)
    return engine


def run(engine: ScriptedEngine, collector: Collector, request: Generate) -> list[EngineEvent]:
    engine.submit(request)
    return collector.wait(request.request_id)


def test_prompt_tokens_are_documented() -> None:
    # One per message, plus one per word.
    assert scripted_prompt_tokens(MESSAGES) == 2 + 2 + 3
    assert scripted_prompt_tokens(()) == 0


def test_default_output(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector)
    assert engine.models == (ModelInfo("scripted", 4096),)
    events = run(engine, collector, ask("r1"))
    assert [o.text for o in outputs(events)] == [f"tok{i} " for i in range(16)]
    last = final(events)
    assert last.finish_reason == "length"
    assert last.usage == Usage(prompt_tokens=7, completion_tokens=16)
    assert [o.usage.completion_tokens for o in outputs(events)] == list(range(1, 17))


def test_max_tokens_eos_and_text_function(
    engines: list[ScriptedEngine], collector: Collector
) -> None:
    engine = start(
        engines, collector, eos_after=6, text=lambda request, i: f"{request.request_id}-{i};"
    )
    events = run(engine, collector, ask("a", max_tokens=3))
    assert (text_of(events), final(events).finish_reason) == ("a-0;a-1;a-2;", "length")
    events = run(engine, collector, ask("b", max_tokens=50))
    assert final(events).finish_reason == "stop"
    assert final(events).usage.completion_tokens == 6


def test_reasoning_tokens(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, reasoning_tokens=2)
    events = run(engine, collector, ask("r1", max_tokens=4))
    assert [(o.text, o.reasoning) for o in outputs(events)] == [
        ("", "think0 "),
        ("", "think1 "),
        ("tok2 ", ""),
        ("tok3 ", ""),
    ]
    assert final(events).usage.reasoning_tokens == 2


def test_stop_strings(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector)
    events = run(engine, collector, ask("r1", stop=("2 tok",)))
    assert text_of(events) == "tok0 tok1 tok"
    assert final(events).finish_reason == "stop"
    assert final(events).usage.completion_tokens == 4


def test_cancel_mid_generation(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, tokens_per_second=200)

    def cancel_after_three(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.usage.completion_tokens == 3:
            engine.cancel("r1")

    collector.on_event = cancel_after_three
    events = run(engine, collector, ask("r1", max_tokens=1000))
    last = final(events)
    assert last.finish_reason == "cancelled"
    assert last.usage.completion_tokens == sum(o.tokens for o in outputs(events)) == 3


def test_queue_and_cancel_while_queued(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, tokens_per_second=500, max_concurrent=2)
    for i in range(4):
        engine.submit(ask(f"r{i}", max_tokens=10))
    engine.submit(ask("queued", max_tokens=10))
    engine.cancel("queued")
    last = final(collector.wait("queued"))
    assert last.finish_reason == "cancelled"
    assert last.usage == Usage(prompt_tokens=7, completion_tokens=0)
    for i in range(4):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 10
    assert engine.peak_active_requests == 2
    assert engine.tokens_generated == 40
    assert engine.requests_finished == 5


def test_pacing(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, tokens_per_second=100)
    started = time.monotonic()
    events = run(engine, collector, ask("r1", max_tokens=10))
    elapsed = time.monotonic() - started
    assert 0.09 <= elapsed < 2 * UNIT
    stats = final(events).stats
    assert stats is not None
    assert 50 < stats.generation_tps < 150


def test_failures(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, context_length=5, models=("a", "b"))
    assert run(engine, collector, ask("r1", model="c")) == [
        Failure("r1", "model_not_found", "This runner does not serve c.")
    ]
    (event,) = run(engine, collector, ask("r2", model="a"))
    assert isinstance(event, Failure)
    assert event.code == "context_length_exceeded"

    engine = start(engines, collector, fail_after=2)
    events = run(engine, collector, ask("r3"))
    assert [type(e) for e in events] == [Output, Output, Failure]
    assert isinstance(events[-1], Failure)
    assert events[-1].code == "internal_error"


def test_close_drops_running_requests(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, tokens_per_second=100)
    engine.submit(ask("r1", max_tokens=1000))
    time.sleep(0.05)
    engine.close()
    count = len(collector.events["r1"])
    assert all(isinstance(e, Output) and e.finish_reason is None for e in collector.events["r1"])
    time.sleep(0.05)
    assert len(collector.events["r1"]) == count
    engine.submit(ask("r2"))
    assert collector.events["r2"] == [Failure("r2", "internal_error", "the engine is closed")]
