"""What only ScriptedEngine does: its documented output and usage, pacing and rounds, and its
scripted faults (the Engine contract itself is in test_contract)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from protocol.frames import Generate, Message, ModelInfo, Usage
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.scripted import ScriptedEngine, scripted_prompt_tokens
from tests.runner.collect import Collector, final, hold, is_terminal, outputs, run, text_of
from tests.support import UNIT, wait_until

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


@pytest.mark.timing  # a pace
def test_cancel_takes_effect_before_the_next_paced_token(
    engines: list[ScriptedEngine], collector: Collector
) -> None:
    # Tokens every 0.2 s: the cancel must not wait for the next one to come due.
    engine = start(engines, collector, tokens_per_second=5)
    cancelled_at: list[float] = []

    def cancel_after_one(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.usage.completion_tokens == 1:
            cancelled_at.append(time.perf_counter())
            engine.cancel("r1")

    collector.on_event = cancel_after_one
    events = run(engine, collector, ask("r1", max_tokens=10))
    ended_at = time.perf_counter()
    last = final(events)
    assert (last.finish_reason, last.usage.completion_tokens) == ("cancelled", 1)
    assert ended_at - cancelled_at[0] < 0.1 * UNIT


def test_queue_and_cancel_while_queued(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, tokens_per_second=50, max_concurrent=2)
    for i in range(2):  # they hold both slots until cancelled
        engine.submit(ask(f"long{i}", max_tokens=10**6))
    for i in range(2):
        engine.submit(ask(f"r{i}", max_tokens=10))
    engine.submit(ask("queued", max_tokens=10))
    engine.cancel("queued")
    last = final(collector.wait("queued"))
    # Cancelled in its waiting place: no slot came free meanwhile.
    assert not any(is_terminal(e) for i in range(2) for e in collector.events[f"long{i}"])
    assert last.finish_reason == "cancelled"
    assert last.usage == Usage(prompt_tokens=7, completion_tokens=0)
    for i in range(2):
        engine.cancel(f"long{i}")
    held = sum(final(collector.wait(f"long{i}")).usage.completion_tokens for i in range(2))
    for i in range(2):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 10
    assert engine.stats.peak_active_requests == 2
    assert engine.stats.tokens_generated == held + 20
    assert engine.stats.requests_finished == 5
    assert engine.stats.active_requests == 0


def test_slots_are_first_come_first_served_and_rounds_step_every_request(
    engines: list[ScriptedEngine], collector: Collector
) -> None:
    engine = start(engines, collector, max_concurrent=2)
    order: list[str] = []
    gate = hold(engine, collector, ask("gate", max_tokens=1), lambda e: order.append(e.request_id))
    lengths = {"a": 1, "b": 3, "c": 2, "d": 2, "e": 1}
    for request_id, tokens in lengths.items():
        engine.submit(ask(request_id, max_tokens=tokens))
    gate.set()
    for request_id, tokens in lengths.items():
        assert final(collector.wait(request_id)).usage.completion_tokens == tokens
    # Rounds: a b | b c | b c | d e | d. A freed slot goes to the longest waiting request.
    assert "".join(order) == "abbcbcded"
    assert engine.stats.peak_active_requests == 2


def test_one_thread_serves_every_request(
    engines: list[ScriptedEngine], collector: Collector
) -> None:
    before = threading.active_count()
    engine = start(engines, collector, tokens_per_second=200)
    senders: set[int] = set()
    collector.on_event = lambda event: senders.add(threading.get_ident())
    for i in range(100):
        engine.submit(ask(f"r{i}", max_tokens=5))
    during = threading.active_count()
    for i in range(100):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 5
    assert during == before + 1
    assert len(senders) == 1
    assert threading.get_ident() not in senders


@pytest.mark.timing  # a pace
def test_paced_requests_share_rounds(engines: list[ScriptedEngine], collector: Collector) -> None:
    rate, tokens, count = 100, 20, 50
    engine = start(engines, collector, tokens_per_second=rate)
    seen: list[int] = []  # tokens_generated as each token is delivered: one value per round
    gate = hold(
        engine,
        collector,
        ask("gate", max_tokens=1),
        lambda _: seen.append(engine.stats.tokens_generated),
    )
    started = time.monotonic()
    for i in range(count):
        engine.submit(ask(f"r{i}", max_tokens=tokens))
    gate.set()
    for i in range(count):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == tokens
    elapsed = time.monotonic() - started
    # All streams side by side (serialized they would take count times as long)...
    assert tokens / rate <= elapsed < tokens / rate + 0.5 * UNIT
    # ...and token i of every stream in one round, like a batched decode step.
    assert len(seen) == count * tokens
    assert len(set(seen)) <= tokens


@pytest.mark.timing  # a pace
def test_min_step_batches_rounds(engines: list[ScriptedEngine], collector: Collector) -> None:
    rate, min_step = 100, 0.05
    engine = start(engines, collector, tokens_per_second=rate, min_step=min_step)
    arrivals: list[tuple[float, int]] = []
    collector.on_event = lambda event: arrivals.append(
        (time.perf_counter(), engine.stats.tokens_generated)
    )
    submitted = time.perf_counter()
    events = run(engine, collector, ask("r1", max_tokens=10))
    assert final(events).usage.completion_tokens == 10
    for i, (at, _) in enumerate(arrivals):
        due = submitted + (i + 1) / rate
        assert due <= at < due + min_step + 0.05 * UNIT
    # Due every 10 ms, but rounds at least 50 ms apart: about five tokens per round.
    assert len({seen for _, seen in arrivals}) <= 3


@pytest.mark.timing  # a pace
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


def test_text_function_errors_fail_the_request(
    engines: list[ScriptedEngine], collector: Collector
) -> None:
    def text(request: Generate, index: int) -> str:
        if index == 1:
            raise ValueError("no second token")
        return "x"

    engine = start(engines, collector, text=text)
    events = run(engine, collector, ask("r1"))
    assert events[1:] == [Failure("r1", "internal_error", "ValueError: no second token")]
    assert final(run(engine, collector, ask("r2", max_tokens=1))).finish_reason == "length"


def test_eos_at_once(engines: list[ScriptedEngine], collector: Collector) -> None:
    engine = start(engines, collector, eos_after=0)
    (event,) = run(engine, collector, ask("r1"))
    assert isinstance(event, Output)
    assert (event.text, event.finish_reason, event.usage.completion_tokens) == ("", "stop", 0)


def test_close_while_paced_drops_running_requests(
    engines: list[ScriptedEngine], collector: Collector
) -> None:
    engine = start(engines, collector, tokens_per_second=100)
    engine.submit(ask("r1", max_tokens=1000))
    wait_until(lambda: bool(collector.events["r1"]), 10, "a first token")
    closing = time.monotonic()
    engine.close()
    assert time.monotonic() - closing < 0.5 * UNIT
    engine.close()  # idempotent
    count = len(collector.events["r1"])
    assert all(isinstance(e, Output) and e.finish_reason is None for e in collector.events["r1"])
    time.sleep(0.05)
    assert len(collector.events["r1"]) == count


def test_close_under_unpaced_load(engines: list[ScriptedEngine], collector: Collector) -> None:
    before = threading.active_count()
    engine = start(engines, collector, max_concurrent=8)
    for i in range(50):
        engine.submit(ask(f"r{i}", max_tokens=100_000))
    wait_until(lambda: bool(collector.events["r0"]), 10, "a first token")
    closing = time.monotonic()
    engine.close()
    assert time.monotonic() - closing < 0.5 * UNIT
    assert threading.active_count() == before
    count = sum(len(events) for events in collector.events.values())
    assert count > 0
    time.sleep(0.05)
    assert sum(len(events) for events in collector.events.values()) == count


def test_n_choices(engines: list[ScriptedEngine], collector: Collector) -> None:
    # Three choices of 2 tokens, one round each: the first two to end say so with
    # choice_finish, the last ends the request; usage counts every choice's tokens.
    engine = start(engines, collector)
    events = run(engine, collector, ask("r1", max_tokens=2, n=3))
    assert [(o.index, o.text, o.usage.completion_tokens) for o in outputs(events)] == [
        (0, "tok0 ", 1),
        (1, "tok0 ", 2),
        (2, "tok0 ", 3),
        (0, "tok1 ", 4),
        (1, "tok1 ", 5),
        (2, "tok1 ", 6),
    ]
    assert [(o.choice_finish, o.finish_reason) for o in outputs(events)][3:] == [
        ("length", None),
        ("length", None),
        (None, "length"),
    ]
    assert final(events).usage == Usage(prompt_tokens=7, completion_tokens=6)
    assert final(events).stats is not None
    assert engine.stats.peak_active_requests == 3
    assert (engine.stats.requests_finished, engine.stats.active_requests) == (1, 0)


def test_n_choices_cancel_and_fail_together(
    engines: list[ScriptedEngine], collector: Collector
) -> None:
    engine = start(engines, collector, tokens_per_second=5)

    def cancel_after_one(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.usage.completion_tokens == 2:
            engine.cancel("r1")

    collector.on_event = cancel_after_one
    events = run(engine, collector, ask("r1", max_tokens=10, n=2))
    assert [(o.index, o.choice_finish, o.finish_reason) for o in outputs(events)][-2:] == [
        (0, "cancelled", None),
        (1, None, "cancelled"),
    ]
    assert final(events).usage.completion_tokens == 2
    collector.on_event = None

    engine = start(engines, collector, fail_after=1)
    events = run(engine, collector, ask("r2", n=2))
    assert [type(e) for e in events] == [Output, Output, Failure]
    assert engine.stats.active_requests == 0
