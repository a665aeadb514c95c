"""The Engine contract, on every engine: MlxEngine (interleaved and batched) and ScriptedEngine.

What runner.engine.base and runner.engine.threaded promise: per request, Outputs without a
finish_reason then exactly one terminal event; exact usage; slots and queueing; cancel; stop
strings and the end of sequence; a failing request or a raising sink harms nothing else; the
one engine thread; close and the calls around it. What only one engine does is tested in its
own module (test_mlx_engine, test_batched, test_scripted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import attrs
import pytest

from protocol.frames import Usage
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import Engine, EngineEvent, Failure, Output
from runner.engine.mlx_engine import MlxEngine, engine_version
from runner.engine.scripted import ScriptedEngine
from runner.engine.stats import EngineStats
from runner.errors import EngineStateError
from tests.runner.collect import (
    Collector,
    SharedEngine,
    engine_starter,
    final,
    hold,
    is_terminal,
    outputs,
    run,
    shared_engine,
    text_of,
)
from tests.runner.engines import ENGINE_NAMES, GREEDY, PROMPTS, EngineCase, ask, engine_case
from tests.support import UNIT, wait_until

StartEngine = Callable[..., tuple[Engine, Collector]]


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def case(request: pytest.FixtureRequest) -> EngineCase:
    return engine_case(request.param, lambda: request.getfixturevalue("reference"))


@pytest.fixture
def start(case: EngineCase) -> Iterator[StartEngine]:
    """Engines of the test's own."""
    with engine_starter(case.make) as start:
        yield start


@pytest.fixture(scope="module")
def shared(case: EngineCase) -> Iterator[SharedEngine[MlxEngine] | None]:
    """An mlx engine started once for the module's tests (None for the scripted one)."""
    if not case.has_model:
        yield None
        return
    with shared_engine(lambda: cast("MlxEngine", case.make())) as shared:
        yield shared


@pytest.fixture
def lent(
    shared: SharedEngine[MlxEngine] | None, start: StartEngine
) -> Iterator[tuple[Engine, Collector]]:
    """An engine for a test that needs no options: the module's, lent to it (its counters go
    on from the tests before: read them as differences), or a new scripted one (it costs
    nothing to make)."""
    if shared is None:
        yield start()
        return
    with shared.borrow() as engine:
        yield engine


def counted(engine: Engine) -> EngineStats:
    """The engine's counters (every engine here keeps the same ones, `EngineStats`)."""
    assert isinstance(engine, MlxEngine | ScriptedEngine)
    return engine.stats


def started_outputs(collector: Collector, request_id: str) -> list[Output]:
    """The Outputs of a request that has not ended."""
    events = collector.events[request_id]
    assert all(isinstance(e, Output) and e.finish_reason is None for e in events), events
    return [e for e in events if isinstance(e, Output)]


def test_models_and_an_idle_engine_sleeps(lent: tuple[Engine, Collector]) -> None:
    engine, _ = lent
    (info,) = engine.models
    assert (info.id, info.context_length) == (DEMO_MODEL_ID, 2048)
    if isinstance(engine, MlxEngine):
        assert info.engine == engine_version()
        assert info.engine.startswith("mlx-lm ")
        assert info.engine.endswith(("cpu", "gpu"))
    else:
        assert info.engine is None
    cpu = time.process_time()
    time.sleep(0.3)
    # The engine thread blocks on its inbox: no polling.
    assert time.process_time() - cpu < 0.05


def test_outputs_and_usage_token_by_token(case: EngineCase, start: StartEngine) -> None:
    engine, collector = start()
    request = ask("r1", "Tell me about apples.", max_tokens=17, sampling=GREEDY)
    events = run(engine, collector, request)
    assert [o.text for o in outputs(events)] == case.texts(request)
    assert all(o.tokens == 1 and o.reasoning == "" for o in outputs(events))
    assert [o.usage.completion_tokens for o in outputs(events)] == list(range(1, 18))
    last = final(events)
    assert last.finish_reason == "length"
    assert last.usage == Usage(prompt_tokens=case.prompt_tokens(request), completion_tokens=17)
    stats = last.stats
    assert stats is not None
    assert stats.time_to_first_token > 0
    assert stats.generation_tps > 0
    if case.has_model:
        assert stats.prompt_tps > 0
        assert stats.peak_memory_bytes > 0
    else:
        assert (stats.prompt_tps, stats.peak_memory_bytes) == (0.0, 0)
    counters = counted(engine)
    assert (counters.tokens_generated, counters.requests_finished) == (17, 1)
    assert counters.active_requests == 0


def test_concurrent_requests_do_not_mix(case: EngineCase, start: StartEngine) -> None:
    engine, collector = start(max_concurrent=4)
    requests = [
        ask(f"r{i}", content, max_tokens=24 + i, sampling=GREEDY)
        for i, content in enumerate(PROMPTS[:4])
    ]
    gate = hold(engine, collector, ask("gate", max_tokens=1))
    for request in requests:
        engine.submit(request)
    gate.set()
    for request in requests:
        events = collector.wait(request.request_id)
        assert [o.text for o in outputs(events)] == case.texts(request)
        assert final(events).usage.completion_tokens == request.max_tokens
    assert counted(engine).peak_active_requests == 4


def test_more_requests_than_slots_wait_their_turn(start: StartEngine) -> None:
    engine, collector = start(max_concurrent=2)
    order: list[tuple[str, bool]] = []  # (request id, terminal) of each event, in order
    gate = hold(
        engine,
        collector,
        ask("gate", max_tokens=1),
        lambda event: order.append((event.request_id, is_terminal(event))),
    )
    for i in range(5):
        engine.submit(ask(f"r{i}", PROMPTS[i], max_tokens=8))
    gate.set()
    for i in range(5):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 8
    ends = [index for index, (_, terminal) in enumerate(order) if terminal]
    for i in range(2, 5):
        # Two slots: the third request starts once one has ended, the fourth once two have...
        first = next(index for index, (request_id, _) in enumerate(order) if request_id == f"r{i}")
        assert first > ends[i - 2]
    counters = counted(engine)
    assert counters.peak_active_requests == 2
    assert counters.tokens_generated == 1 + 40  # the gate's token, then 5 x 8


def test_cancel_mid_generation(case: EngineCase, lent: tuple[Engine, Collector]) -> None:
    engine, collector = lent
    counters = counted(engine)
    generated, finished = counters.tokens_generated, counters.requests_finished

    def cancel_after_five(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.usage.completion_tokens == 5:
            engine.cancel("r1")

    collector.on_event = cancel_after_five
    events = run(engine, collector, ask("r1", max_tokens=case.long))
    last = final(events)
    assert last.finish_reason == "cancelled"
    assert (last.text, last.tokens) == ("", 0)
    emitted = sum(o.tokens for o in outputs(events))
    # The cancel lands between two steps: nothing is generated after it.
    assert last.usage.completion_tokens == emitted == 5
    assert (counters.tokens_generated - generated, counters.active_requests) == (5, 0)
    # Finished or unknown ids are ignored.
    engine.cancel("r1")
    engine.cancel("never-seen")
    assert final(run(engine, collector, ask("r2", max_tokens=3))).finish_reason == "length"
    assert collector.events["r1"] == events
    assert "never-seen" not in collector.events
    assert counters.requests_finished - finished == 2


def test_cancel_frees_the_slot(case: EngineCase, start: StartEngine) -> None:
    engine, collector = start(max_concurrent=2)

    def cancel_after_five(event: EngineEvent) -> None:
        if (
            isinstance(event, Output)
            and event.request_id == "r1"
            and event.usage.completion_tokens == 5
        ):
            engine.cancel("r1")

    collector.on_event = cancel_after_five
    engine.submit(ask("other", max_tokens=case.long))
    engine.submit(ask("r1", max_tokens=case.long))
    engine.submit(ask("queued", max_tokens=4))
    last = final(collector.wait("r1"))
    assert last.finish_reason == "cancelled"
    assert last.tokens == 0
    assert last.usage.completion_tokens == sum(o.tokens for o in outputs(collector.events["r1"]))
    assert last.usage.completion_tokens == 5
    # The freed slot goes to the queued request while "other" still runs.
    assert final(collector.wait("queued")).finish_reason == "length"
    started_outputs(collector, "other")
    engine.cancel("other")
    assert final(collector.wait("other")).finish_reason == "cancelled"
    assert counted(engine).active_requests == 0


def test_cancel_of_a_queued_request(case: EngineCase, start: StartEngine) -> None:
    engine, collector = start(max_concurrent=1)
    engine.submit(ask("long", max_tokens=case.long))
    queued = ask("queued", "A question that waits", max_tokens=5)
    engine.submit(queued)
    engine.cancel("queued")
    last = final(collector.wait("queued"))
    # Cancelled in its waiting place, not when a slot came free, with its real prompt usage.
    started_outputs(collector, "long")
    assert last.finish_reason == "cancelled"
    assert last.usage == Usage(prompt_tokens=case.prompt_tokens(queued), completion_tokens=0)
    assert outputs(collector.events["queued"]) == [last]
    engine.cancel("long")
    assert final(collector.wait("long")).finish_reason == "cancelled"


def test_stop_string(case: EngineCase, lent: tuple[Engine, Collector]) -> None:
    engine, collector = lent
    plain = ask("r1", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    texts = case.texts(plain)
    full = "".join(texts)
    # A stop string that straddles a token boundary, from the middle of the output.
    boundary = len("".join(texts[:10]))
    stop = full[boundary - 2 : boundary + 2]
    start_at = full.index(stop)
    ends = [len("".join(texts[: i + 1])) for i in range(len(texts))]
    completing_token = next(i for i, end in enumerate(ends) if end >= start_at + len(stop))

    other = ask("other", "Hello", max_tokens=60, sampling=GREEDY)
    engine.submit(other)
    events = run(engine, collector, attrs.evolve(plain, stop=(stop,)))
    last = final(events)
    assert (last.finish_reason, last.matched_stop) == ("stop", stop)
    assert text_of(events) == full[:start_at]
    assert last.usage.completion_tokens == completing_token + 1
    # A request running alongside goes on undisturbed after the stopped one left.
    assert [o.text for o in outputs(collector.wait("other"))] == case.texts(other)

    # Text held back as a possible stop string comes out when generation ends otherwise.
    plain = attrs.evolve(plain, request_id="r2")
    full = "".join(case.texts(plain))
    never = full[-3:] + "\x00"
    events = run(engine, collector, attrs.evolve(plain, stop=(never,)))
    assert (text_of(events), final(events).finish_reason) == (full, "length")
    assert final(events).matched_stop is None


def test_end_of_sequence_ends_with_stop(case: EngineCase, start: StartEngine) -> None:
    options, request, text = case.end_of_sequence(ask("r1", max_tokens=50))
    engine, collector = start(**options)
    (event,) = run(engine, collector, request)
    assert isinstance(event, Output)
    assert (event.finish_reason, event.text, event.tokens) == ("stop", text, 1)
    assert event.matched_stop is None  # the model ended on its own
    # Like vLLM, the end-of-sequence token is a completion token.
    assert event.usage.completion_tokens == 1


def test_invalid_requests_fail_at_once(lent: tuple[Engine, Collector]) -> None:
    engine, collector = lent
    finished = counted(engine).requests_finished
    (event,) = run(engine, collector, attrs.evolve(ask("r1"), model="other-model"))
    assert isinstance(event, Failure)
    assert event.code == "model_not_found"
    (event,) = run(engine, collector, ask("r2", "apple " * 3000))
    assert isinstance(event, Failure)
    assert event.code == "context_length_exceeded"
    assert counted(engine).requests_finished - finished == 2


def test_a_failing_request_ends_alone(
    case: EngineCase, start: StartEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    boom = ask(
        "boom", "Explode, please, at exactly the third token?", max_tokens=12, sampling=GREEDY
    )
    others = [ask(f"r{i}", f"Question {i}?", max_tokens=12, sampling=GREEDY) for i in range(2)]
    after = ask("after", PROMPTS[3], max_tokens=6, sampling=GREEDY)
    assert case.prompt_tokens(boom) not in {case.prompt_tokens(r) for r in [*others, after]}
    engine, collector = start(max_concurrent=4, **case.fail_third_token(monkeypatch, boom))
    engine.submit(boom)
    for request in others:
        engine.submit(request)
    events = collector.wait("boom")
    assert [type(e) for e in events] == [Output, Output, Failure]
    assert events[-1] == Failure("boom", "internal_error", "RuntimeError: injected failure")
    for request in others:
        assert [o.text for o in outputs(collector.wait(request.request_id))] == (
            case.texts(request)
        )
    # The engine thread lives on.
    assert [o.text for o in outputs(run(engine, collector, after))] == case.texts(after)


def test_a_raising_sink_does_not_stop_the_engine(
    case: EngineCase, caplog: pytest.LogCaptureFixture
) -> None:
    collector = Collector()

    def sink(event: EngineEvent) -> None:
        if event.request_id == "bad":
            raise RuntimeError("the transport broke")
        collector(event)

    engine = case.make()
    engine.start(sink)
    try:
        with caplog.at_level(logging.ERROR, logger="runner.engine"):
            engine.submit(ask("bad", max_tokens=3, sampling=GREEDY))
            good = ask("good", max_tokens=3, sampling=GREEDY)
            engine.submit(good)
            assert text_of(collector.wait("good")) == "".join(case.texts(good))
    finally:
        engine.close()
    failures = [r for r in caplog.records if r.getMessage().startswith("engine sink failed")]
    assert len(failures) == 3  # each of the bad request's events, logged
    assert "bad" not in collector.events


def test_one_thread_serves_every_request(start: StartEngine) -> None:
    before = threading.active_count()
    engine, collector = start(max_concurrent=8)
    senders: set[int] = set()
    collector.on_event = lambda event: senders.add(threading.get_ident())
    for i in range(8):
        engine.submit(ask(f"r{i}", PROMPTS[i], max_tokens=3))
    during = threading.active_count()
    for i in range(8):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 3
    assert during == before + 1
    assert len(senders) == 1
    assert threading.get_ident() not in senders


def test_close_drops_running_requests(case: EngineCase, start: StartEngine) -> None:
    before = threading.active_count()
    engine, collector = start()
    engine.submit(ask("r1", max_tokens=case.long))
    wait_until(lambda: bool(collector.events["r1"]), 10, "a first token")
    closing = time.monotonic()
    engine.close()
    assert time.monotonic() - closing < 0.5 * UNIT
    assert threading.active_count() == before
    engine.close()  # idempotent
    count = len(started_outputs(collector, "r1"))
    # At once, from the submitting thread: no engine thread is left to answer.
    engine.submit(ask("r2"))
    assert collector.events["r2"] == [Failure("r2", "internal_error", "the engine is closed")]
    time.sleep(0.05)
    assert len(collector.events["r1"]) == count


def test_close_from_inside_the_sink(start: StartEngine) -> None:
    before = threading.active_count()
    engine, collector = start()
    returned: list[float] = []

    def close_after_two(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.usage.completion_tokens == 2:
            closing = time.monotonic()
            engine.close()
            returned.append(time.monotonic() - closing)

    collector.on_event = close_after_two
    engine.submit(ask("r1", max_tokens=100))
    wait_until(lambda: bool(returned), 10, "close() to return inside the sink")
    assert returned[0] < 0.5 * UNIT
    wait_until(lambda: threading.active_count() == before, 2, "the engine thread to end")
    assert [o.usage.completion_tokens for o in started_outputs(collector, "r1")] == [1, 2]


def test_submit_before_start_and_start_twice(case: EngineCase) -> None:
    engine = case.make()
    with pytest.raises(EngineStateError, match="submit before start"):
        engine.submit(ask("r1"))
    engine.start(Collector())
    try:
        with pytest.raises(EngineStateError, match="already started"):
            engine.start(Collector())
    finally:
        engine.close()
