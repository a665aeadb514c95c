"""What only the batched engine (`MlxEngine` with the `Batched` strategy) does, on the real
demo model: one batch for concurrent requests (with their lone output), shared samplers, late
joiners, the own-stream path of seeded requests, the KV budget, and a failing batch step."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator

from protocol.frames import LogitBias, SamplingParams
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.batch_decoder import PREFILL_MIN_CHUNK
from runner.engine.batched import batched_engine
from runner.engine.generation import PREFILL_CHUNK
from runner.engine.mlx_engine import MlxEngine
from runner.engine.solo import SoloDecoder
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
from tests.runner.engines import GREEDY, PROMPTS, Reference, ask
from tests.support import UNIT, wait_until

StartEngine = Callable[..., tuple[MlxEngine, Collector]]


@pytest.fixture
def start_engine(demo_model_path: Path) -> Iterator[StartEngine]:
    """Engines of the test's own."""
    with engine_starter(lambda **options: batched_engine(DEMO_MODEL_ID, **options)) as start:
        yield start


@pytest.fixture(scope="module")
def shared(demo_model_path: Path) -> Iterator[SharedEngine[MlxEngine]]:
    with shared_engine(lambda: batched_engine(DEMO_MODEL_ID)) as shared:
        yield shared


@pytest.fixture
def lent(shared: SharedEngine[MlxEngine]) -> Iterator[tuple[MlxEngine, Collector]]:
    """The module's engine, for a test that needs no options (its counters go on from the
    tests before: read them as differences)."""
    with shared.borrow() as lent:
        yield lent


def paths(engine: MlxEngine) -> tuple[int, int]:
    """Requests served so far in a batch, and on their own streams."""
    return engine.stats.batched_requests, engine.stats.fallback_requests


def sub(now: tuple[int, int], before: tuple[int, int]) -> tuple[int, int]:
    return now[0] - before[0], now[1] - before[1]


def test_concurrent_requests_share_one_batch_with_their_lone_output(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine(max_concurrent=8)
    requests = [
        ask(f"r{i}", content, max_tokens=20 + i, sampling=GREEDY)
        for i, content in enumerate(PROMPTS)
    ]
    gate = hold(engine, collector, ask("gate", max_tokens=1, sampling=GREEDY))
    for request in requests:
        engine.submit(request)
    gate.set()
    for request in requests:
        events = collector.wait(request.request_id)
        assert [o.text for o in outputs(events)] == reference.greedy(request)[1]
        assert final(events).usage.completion_tokens == request.max_tokens
    assert engine.stats.peak_batch_size == 8
    assert (engine.stats.batched_requests, engine.stats.fallback_requests) == (9, 0)


def test_staggered_joins_keep_lone_output(start_engine: StartEngine, reference: Reference) -> None:
    # Rows join a running batch with other lengths: left padding must not change the text.
    engine, collector = start_engine(max_concurrent=8)
    requests = [ask(f"r{i}", c, max_tokens=30, sampling=GREEDY) for i, c in enumerate(PROMPTS)]
    started: list[str] = []

    def submit_next(event: EngineEvent) -> None:
        started_all = len(started) == len(requests)
        if isinstance(event, Output) and event.usage.completion_tokens == 3 and not started_all:
            request = requests[len(started)]
            started.append(request.request_id)
            engine.submit(request)

    collector.on_event = submit_next
    started.append("r0")
    engine.submit(requests[0])
    for request in requests:
        events = collector.wait(request.request_id)
        assert [o.text for o in outputs(events)] == reference.greedy(request)[1], request
    assert engine.stats.peak_batch_size > 1


def test_logit_bias_and_penalties_in_the_batch(
    lent: tuple[MlxEngine, Collector], reference: Reference
) -> None:
    engine, collector = lent
    before = paths(engine)
    apple = reference.tokenizer.encode(" apple", add_special_tokens=False)
    biased = SamplingParams(temperature=0, logit_bias=(LogitBias(apple[0], 100.0),))
    penalised = SamplingParams(temperature=0, presence_penalty=50)
    engine.submit(ask("plain", max_tokens=30, sampling=GREEDY))
    engine.submit(ask("biased", max_tokens=5, sampling=biased))
    engine.submit(ask("penalised", max_tokens=30, sampling=penalised))
    assert text_of(collector.wait("biased")) == "apple" + " apple" * 4
    collector.wait("penalised")
    tokens = dict(engine.stats.recent_tokens)["penalised"]
    assert len(set(tokens)) == len(tokens)
    assert tokens[0] == reference.greedy(ask("x", max_tokens=1))[0][0]
    plain = collector.wait("plain")
    assert [o.text for o in outputs(plain)] == reference.greedy(ask("x", max_tokens=30))[1]
    assert sub(paths(engine), before) == (3, 0)


def test_late_joiner_starts_at_the_next_step(
    start_engine: StartEngine, reference: Reference
) -> None:
    # Counted in steps (one token of d0 each), not seconds: the late request is submitted
    # from the sink, on the engine thread, as d0's 20th token goes out.
    engine, collector = start_engine(max_concurrent=8)
    late = ask("late", "A late question about pears?", max_tokens=4)
    # While others decode, a step prefills at least PREFILL_MIN_CHUNK tokens of a prompt
    # (more as the measured costs allow): this many steps at the most.
    chunks = math.ceil(len(reference.prompt(late)) / PREFILL_MIN_CHUNK)
    d0_tokens = 0
    first_late: list[int] = []  # d0's tokens when late's first one came

    def note(event: EngineEvent) -> None:
        nonlocal d0_tokens
        if isinstance(event, Output) and event.request_id == "d0":
            d0_tokens += 1
            if d0_tokens == 20:
                engine.submit(late)
        elif event.request_id == "late" and not first_late:
            first_late.append(d0_tokens)

    collector.on_event = note
    for i in range(7):
        engine.submit(ask(f"d{i}", PROMPTS[i], max_tokens=400))
    events = collector.wait("late")
    first_seen = next(e for e in events if isinstance(e, Output))
    assert first_seen.usage.completion_tokens == 1
    # Prefill from the next step on, the first token two steps after it: a few steps, not
    # a slice.
    assert first_late[0] - 20 <= chunks + 2, (first_late, chunks)
    assert not any(is_terminal(e) for i in range(7) for e in collector.events[f"d{i}"])
    for i in range(7):
        engine.cancel(f"d{i}")
        assert final(collector.wait(f"d{i}")).finish_reason == "cancelled"


def test_seeded_requests_run_on_their_own_stream(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    before = paths(engine)
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = text_of(run(engine, collector, ask("a", max_tokens=24, sampling=sampling)))
    # Its draws must not depend on the batch rows running alongside it.
    engine.submit(ask("greedy", "Other words", max_tokens=24, sampling=GREEDY))
    engine.submit(ask("unseeded", "More words", max_tokens=24, sampling=SamplingParams()))
    engine.submit(ask("b", max_tokens=24, sampling=sampling))
    assert text_of(collector.wait("b")) == alone
    assert final(collector.wait("greedy")).usage.completion_tokens == 24
    assert final(collector.wait("unseeded")).usage.completion_tokens == 24
    assert sub(paths(engine), before) == (2, 2)
    # A seeded request at temperature 0 is greedy: it is batched.
    run(engine, collector, ask("c", max_tokens=4, sampling=SamplingParams(temperature=0, seed=3)))
    assert sub(paths(engine), before) == (3, 2)


def test_unseeded_sampling_shares_a_sampler(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    fallback = engine.stats.fallback_requests
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05)
    for i in range(4):
        engine.submit(ask(f"s{i}", PROMPTS[i], max_tokens=12, sampling=sampling))
    for i in range(4):
        assert final(collector.wait(f"s{i}")).usage.completion_tokens == 12
    assert engine.stats.fallback_requests == fallback


def test_kv_budget_bounds_memory(start_engine: StartEngine) -> None:
    engine, collector = start_engine(max_concurrent=8, max_kv_bytes=0)
    # A zero budget refuses everything, with a message naming the budget.
    (event,) = run(engine, collector, ask("r0", max_tokens=4))
    assert isinstance(event, Failure)
    assert event.code == "context_length_exceeded"
    assert "KV-cache budget" in event.message

    per_token = engine.stats.kv_bytes_per_token
    assert per_token > 0
    # Room for two rows of ~120 tokens at a time (each may hold 255 more as growth room).
    budget = 2 * 400 * per_token
    engine, collector = start_engine(max_concurrent=8, max_kv_bytes=budget)
    for i in range(4):
        engine.submit(ask(f"r{i}", PROMPTS[i], max_tokens=100))
    peak = 0
    deadline = time.monotonic() + 30 * UNIT
    while time.monotonic() < deadline and not all(
        collector.events[f"r{i}"] and is_terminal(collector.events[f"r{i}"][-1]) for i in range(4)
    ):
        peak = max(peak, engine.stats.kv_bytes)
        time.sleep(0.002)
    for i in range(4):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 100
    assert engine.stats.peak_active_requests == 2
    assert 0 < peak <= budget
    assert engine.stats.kv_bytes <= budget  # what the prefix cache keeps stays within it too


def test_a_failing_batch_step_fails_its_rows_only(
    start_engine: StartEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    real: Callable[[Any], Any] = BatchGenerator.next  # mlx-lm leaves it unannotated
    steps = itertools.count()
    armed = threading.Event()  # once the engine has warmed up

    def next_failing_once(self: Any) -> Any:
        if armed.is_set() and next(steps) == 5:
            raise RuntimeError("the forward pass broke")
        return real(self)

    monkeypatch.setattr(BatchGenerator, "next", next_failing_once)
    engine, collector = start_engine()
    armed.set()
    seeded = ask("seeded", max_tokens=12, sampling=SamplingParams(seed=7))
    engine.submit(seeded)
    for i in range(2):
        engine.submit(ask(f"r{i}", PROMPTS[i], max_tokens=12, sampling=GREEDY))
    for request_id in ("r0", "r1"):
        assert collector.wait(request_id)[-1] == Failure(
            request_id, "internal_error", "RuntimeError: the forward pass broke"
        )
    # The request on its own stream goes on; a fresh batch serves what comes next.
    assert final(collector.wait("seeded")).usage.completion_tokens == 12
    after = ask("after", PROMPTS[3], max_tokens=6, sampling=GREEDY)
    assert [o.text for o in outputs(run(engine, collector, after))] == reference.greedy(after)[1]


def test_rows_leave_the_batch_when_their_requests_end(start_engine: StartEngine) -> None:
    # Without a prefix cache, the KV bytes held once every request has ended are the batch's
    # own: a row left behind would still hold some.
    engine, collector = start_engine(prefix_cache_size=0)

    def cancel_after_three(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.usage.completion_tokens == 3:
            engine.cancel(event.request_id)

    engine.submit(ask("length", PROMPTS[0], max_tokens=5, sampling=GREEDY))
    stop = text_of(run(engine, collector, ask("x", PROMPTS[1], max_tokens=8, sampling=GREEDY)))
    engine.submit(ask("stop", PROMPTS[1], max_tokens=8, stop=(stop[-4:],), sampling=GREEDY))
    assert final(collector.wait("stop")).finish_reason == "stop"
    assert final(collector.wait("length")).finish_reason == "length"
    collector.on_event = cancel_after_three
    assert final(run(engine, collector, ask("cancelled", max_tokens=500))).finish_reason == (
        "cancelled"
    )
    # Counted at the end of the step that ended the request, after its events.
    wait_until(lambda: engine.stats.kv_bytes == 0, 5, "the batch to hold nothing")
    assert engine.stats.active_requests == 0


def test_a_lone_request_decodes_on_a_plain_cache(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine(max_concurrent=8)
    request = ask("alone", PROMPTS[0], max_tokens=24, sampling=GREEDY)
    events = run(engine, collector, request)
    tokens, texts = reference.greedy(request)
    assert [o.text for o in outputs(events)] == texts
    assert dict(engine.stats.recent_tokens)["alone"] == tuple(tokens)
    # It never took a batch row.
    assert (
        engine.stats.solo_requests,
        engine.stats.batched_requests,
        engine.stats.peak_batch_size,
    ) == (1, 1, 0)
    # Its KV cache (prompt and every generated token) went to the prefix cache.
    again = ask("again", PROMPTS[0], max_tokens=4, sampling=GREEDY)
    usage = final(run(engine, collector, again)).usage
    assert usage.cached_tokens == len(reference.prompt(again)) - 1
    assert engine.stats.solo_requests == 2


def test_a_lone_request_joins_the_batch_with_its_state(
    start_engine: StartEngine, reference: Reference
) -> None:
    # A lone request with a presence penalty hands over to the batch when a second arrives:
    # its penalty context carries over, so no token repeats across the handover.
    engine, collector = start_engine(max_concurrent=8)
    plain = reference.greedy(ask("x", PROMPTS[4], max_tokens=40))[0]
    assert len(set(plain)) < len(plain)  # unpenalised, this model repeats itself
    penalised = ask(
        "penalised",
        PROMPTS[4],
        max_tokens=40,
        sampling=SamplingParams(temperature=0, presence_penalty=50),
    )
    other = ask("other", PROMPTS[5], max_tokens=20, sampling=GREEDY)

    def second_at_five(event: EngineEvent) -> None:
        if isinstance(event, Output) and (event.request_id, event.usage.completion_tokens) == (
            "penalised",
            5,
        ):
            engine.submit(other)

    collector.on_event = second_at_five
    engine.submit(penalised)
    events = collector.wait("penalised")
    assert final(events).usage.completion_tokens == 40
    tokens = dict(engine.stats.recent_tokens)["penalised"]
    assert len(set(tokens)) == len(tokens)
    assert tokens[0] == plain[0]
    assert [o.text for o in outputs(collector.wait("other"))] == reference.greedy(other)[1]
    assert (engine.stats.solo_requests, engine.stats.peak_batch_size) == (1, 2)


def test_the_engine_warms_up_before_serving_and_counts_from_zero(
    start_engine: StartEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_next: Callable[[Any], Any] = BatchGenerator.next
    real_step = SoloDecoder.step
    calls = {"batch": 0, "solo": 0}

    def counted_next(self: Any) -> Any:
        calls["batch"] += 1
        return real_next(self)

    def counted_step(self: SoloDecoder) -> None:
        calls["solo"] += 1
        real_step(self)

    monkeypatch.setattr(BatchGenerator, "next", counted_next)
    monkeypatch.setattr(SoloDecoder, "step", counted_step)
    engine, collector = start_engine(max_concurrent=8)
    # Before the engine was ready, a lone request and batches ran through the real paths...
    assert calls["solo"] >= 4
    assert calls["batch"] >= 4
    assert engine.warm_up_seconds > 0
    # ...on scratch state: the engine's figures and its prefix cache start empty.
    counted = (
        engine.stats.tokens_generated,
        engine.stats.requests_finished,
        engine.stats.peak_active_requests,
        engine.stats.batched_requests,
        engine.stats.solo_requests,
        engine.stats.peak_batch_size,
        engine.stats.kv_bytes,
        len(engine.stats.recent_tokens),
    )
    assert counted == (0, 0, 0, 0, 0, 0, 0, 0)
    first = final(run(engine, collector, ask("first", "Warm up pear.", max_tokens=2)))
    assert first.usage.cached_tokens == 0
    assert engine.stats.tokens_generated == 2


@pytest.mark.parametrize("share", [3.0, None])
def test_arrivals_are_prefilled_within_a_budget_while_others_decode(
    start_engine: StartEngine,
    reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
    share: float | None,
) -> None:
    real: Callable[[Any], Any] = BatchGenerator.next
    prefilled: list[tuple[int, int]] = []  # (prompt tokens, rows decoding) per step

    def counted_next(self: Any) -> Any:
        before, decoding = self._counters.prompt_tokens, len(self._generation_batch)
        result = real(self)
        prefilled.append((self._counters.prompt_tokens - before, decoding))
        return result

    engine, collector = start_engine(max_concurrent=32, prefill_share=share)
    monkeypatch.setattr(BatchGenerator, "next", counted_next)
    for i in range(4):
        engine.submit(ask(f"d{i}", PROMPTS[i], max_tokens=300, sampling=GREEDY))
    collector.wait_for_outputs("d3", 20)
    arrivals = [
        ask(f"a{i}", f"{PROMPTS[i % 8]} Again, with pears {i}.", max_tokens=8, sampling=GREEDY)
        for i in range(16)
    ]
    prefilled.clear()
    for request in arrivals:
        engine.submit(request)
    for request in arrivals:
        events = collector.wait(request.request_id)
        # Prefilled in pieces or at once, each arrival writes what it writes alone.
        assert [o.text for o in outputs(events)] == reference.greedy(request)[1]
    for i in range(4):
        engine.cancel(f"d{i}")
    total = sum(len(reference.prompt(r)) for r in arrivals)
    most = max(tokens for tokens, decoding in prefilled if decoding)
    if share is None:
        assert most >= total / 2  # the first wave at once: one long stall
    else:
        assert most <= total / 4  # many short pieces between decode steps


def test_a_long_lone_prompt_hands_over_between_chunks(
    start_engine: StartEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lone request prefills its prompt a chunk per step, so one that arrives meanwhile
    # takes it into the batch after a chunk: the short one's first token comes first.
    handovers: list[int] = []
    real = SoloDecoder.hand_over

    def noted(self: SoloDecoder) -> Any:
        handover = real(self)
        if handover is not None:
            handovers.append(len(handover.held))
        return handover

    monkeypatch.setattr(SoloDecoder, "hand_over", noted)
    engine, collector = start_engine(max_concurrent=8)
    words = " ".join(f"apple{i % 50} pear" for i in range(300))  # 1,130 tokens: three chunks
    long = ask("long", words, max_tokens=6, sampling=GREEDY)
    short = ask("short", PROMPTS[1], max_tokens=6, sampling=GREEDY)
    assert len(reference.prompt(long)) > 2 * PREFILL_CHUNK
    firsts: list[str] = []

    def note_first(event: EngineEvent) -> None:
        if event.request_id not in firsts:
            firsts.append(event.request_id)

    collector.on_event = note_first
    engine.submit(long)
    wait_until(lambda: engine.stats.solo_requests == 1, 10, "the long one to start alone")
    engine.submit(short)
    long_events, short_events = collector.wait("long"), collector.wait("short")
    assert [o.text for o in outputs(long_events)] == reference.greedy(long)[1]
    assert [o.text for o in outputs(short_events)] == reference.greedy(short)[1]
    # Handed over with part of its prompt prefilled and no token yet; the short one did not
    # wait for the rest of the long prompt.
    (held,) = handovers
    assert 0 < held < len(reference.prompt(long))
    assert firsts == ["short", "long"]
