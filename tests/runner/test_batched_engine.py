"""BatchedMlxEngine on the real demo model: MlxEngine's guarantees, under batching."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protocol.frames import Generate, LogitBias, Message, ModelInfo, SamplingParams, Usage
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.batched import BatchedMlxEngine
from tests.runner.collect import (
    Collector,
    check_failure_stays_alone,
    engine_starter,
    fail_third_token,
    final,
    outputs,
    run,
    text_of,
)
from tests.runner.test_mlx_engine import GREEDY, Reference, ask, reference
from tests.support import UNIT

__all__ = ["reference"]  # the fixture, shared with test_mlx_engine

StartEngine = Callable[..., tuple[BatchedMlxEngine, Collector]]

PROMPTS = [
    "Tell me about apples.",
    "What is 2+2?",
    "Hello",
    "Write a poem about the sea.",
    "Orchards in winter?",
    "Why is the sky blue?",
    "List three fruits.",
    "Say something.",
]


@pytest.fixture
def start_engine(demo_model_path: Path) -> Iterator[StartEngine]:
    with engine_starter(BatchedMlxEngine) as start:
        yield start


def test_models_and_idle(start_engine: StartEngine) -> None:
    engine, _ = start_engine()
    assert engine.models == (ModelInfo(DEMO_MODEL_ID, 2048),)
    cpu = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu < 0.05


def test_greedy_alone_equals_stream_generate(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine()
    request = ask("r1", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    events = run(engine, collector, request)
    tokens, texts = reference.greedy(request)
    assert [o.text for o in outputs(events)] == texts
    assert engine.recent_tokens[-1] == ("r1", tuple(tokens))
    assert engine.batched_requests == 1


def test_max_tokens_and_usage(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine()
    request = ask("r1", max_tokens=17, sampling=GREEDY)
    events = run(engine, collector, request)
    last = final(events)
    assert last.finish_reason == "length"
    assert last.usage == Usage(prompt_tokens=len(reference.prompt(request)), completion_tokens=17)
    assert [o.usage.completion_tokens for o in outputs(events)] == list(range(1, 18))
    assert last.stats is not None
    assert last.stats.time_to_first_token > 0
    assert last.stats.generation_tps > 0


def test_concurrent_requests_get_their_lone_output(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine(max_concurrent=8)
    requests = [
        ask(f"r{i}", content, max_tokens=20 + i, sampling=GREEDY)
        for i, content in enumerate(PROMPTS)
    ]
    for request in requests:
        engine.submit(request)
    for request in requests:
        events = collector.wait(request.request_id)
        assert [o.text for o in outputs(events)] == reference.greedy(request)[1]
        assert final(events).usage.completion_tokens == request.max_tokens
    assert engine.peak_batch_size == 8


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


def test_prefix_cache_under_batching(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine()
    first = ask("r1", "What grows in an orchard?", max_tokens=12, sampling=GREEDY)
    first_events = run(engine, collector, first)
    assert final(first_events).usage.cached_tokens == 0
    follow_up = Generate(
        "r2",
        DEMO_MODEL_ID,
        (
            *first.messages,
            Message("assistant", text_of(first_events)),
            Message("user", "Tell me more."),
        ),
        max_tokens=16,
        sampling=GREEDY,
    )
    # Alongside another request (which comes second: it would take the cache entry too).
    engine.submit(follow_up)
    engine.submit(ask("other", "Hello", max_tokens=30, sampling=GREEDY))
    events = collector.wait("r2")
    usage = final(events).usage
    assert usage.prompt_tokens == len(reference.prompt(follow_up))
    assert len(reference.prompt(first)) <= usage.cached_tokens < usage.prompt_tokens
    assert engine.prefix_cache_hits == 1
    assert [o.text for o in outputs(events)] == reference.greedy(follow_up)[1]
    collector.wait("other")
    again = Generate("r3", DEMO_MODEL_ID, follow_up.messages, max_tokens=4, sampling=GREEDY)
    usage = final(run(engine, collector, again)).usage
    assert usage.cached_tokens == usage.prompt_tokens - 1


def test_stop_string(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine(prefix_cache_size=0)
    plain = ask("r0", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    _, texts = reference.greedy(plain)
    full = "".join(texts)
    boundary = len("".join(texts[:10]))
    stop = full[boundary - 2 : boundary + 2]
    start = full.index(stop)
    ends = [len("".join(texts[: i + 1])) for i in range(len(texts))]
    completing_token = next(i for i, end in enumerate(ends) if end >= start + len(stop))
    request = ask("r1", "Tell me about apples.", max_tokens=40, stop=(stop,), sampling=GREEDY)
    engine.submit(ask("other", "Hello", max_tokens=60, sampling=GREEDY))
    events = run(engine, collector, request)
    last = final(events)
    assert last.finish_reason == "stop"
    assert text_of(events) == full[:start]
    assert last.usage.completion_tokens == completing_token + 1
    # The other row goes on undisturbed after the stopped row left the batch.
    other = collector.wait("other")
    assert [o.text for o in outputs(other)] == reference.greedy(ask("x", "Hello", max_tokens=60))[1]


def test_end_of_sequence_ends_with_stop(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine()
    eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = SamplingParams(temperature=0, logit_bias=(LogitBias(eos, 100.0),))
    events = run(engine, collector, ask("r1", max_tokens=50, sampling=sampling))
    last = final(events)
    assert (last.finish_reason, last.text, last.tokens) == ("stop", "", 1)
    assert last.usage.completion_tokens == 1


def test_logit_bias_and_penalties_in_the_batch(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine()
    apple = reference.tokenizer.encode(" apple", add_special_tokens=False)
    biased = SamplingParams(temperature=0, logit_bias=(LogitBias(apple[0], 100.0),))
    penalised = SamplingParams(temperature=0, presence_penalty=50)
    engine.submit(ask("plain", max_tokens=30, sampling=GREEDY))
    engine.submit(ask("biased", max_tokens=5, sampling=biased))
    engine.submit(ask("penalised", max_tokens=30, sampling=penalised))
    assert text_of(collector.wait("biased")) == "apple" + " apple" * 4
    collector.wait("penalised")
    tokens = dict(engine.recent_tokens)["penalised"]
    assert len(set(tokens)) == len(tokens)
    assert tokens[0] == reference.greedy(ask("x", max_tokens=1))[0][0]
    plain = collector.wait("plain")
    assert [o.text for o in outputs(plain)] == reference.greedy(ask("x", max_tokens=30))[1]
    assert engine.fallback_requests == 0


def test_cancel_mid_batch_frees_the_slot(start_engine: StartEngine) -> None:
    engine, collector = start_engine(max_concurrent=2)

    def cancel_after_five(event: EngineEvent) -> None:
        if (
            isinstance(event, Output)
            and event.request_id == "r1"
            and event.usage.completion_tokens == 5
        ):
            engine.cancel("r1")

    collector.on_event = cancel_after_five
    engine.submit(ask("other", max_tokens=300))
    engine.submit(ask("r1", max_tokens=1000))
    engine.submit(ask("queued", max_tokens=4))
    last = final(collector.wait("r1"))
    assert last.finish_reason == "cancelled"
    assert last.tokens == 0
    assert last.usage.completion_tokens == sum(o.tokens for o in outputs(collector.events["r1"]))
    assert last.usage.completion_tokens == 5
    # The freed slot goes to the queued request while "other" still decodes.
    assert final(collector.wait("queued")).finish_reason == "length"
    assert not collector.events["other"] or final_or_none(collector.events["other"]) is None
    engine.cancel("other")
    assert final(collector.wait("other")).finish_reason == "cancelled"
    assert engine.active_requests == 0
    engine.cancel("r1")
    engine.cancel("never-seen")


def final_or_none(events: list[EngineEvent]) -> Output | None:
    last = events[-1]
    return last if isinstance(last, Output) and last.finish_reason is not None else None


def test_cancel_of_a_queued_request(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine(max_concurrent=1)
    engine.submit(ask("long", max_tokens=1500))
    queued = ask("queued", max_tokens=5)
    engine.submit(queued)
    engine.cancel("queued")
    last = final(collector.wait("queued"))
    assert last.finish_reason == "cancelled"
    assert last.usage == Usage(prompt_tokens=len(reference.prompt(queued)), completion_tokens=0)
    engine.cancel("long")
    assert final(collector.wait("long")).finish_reason == "cancelled"


def test_late_joiner_starts_at_the_next_step(start_engine: StartEngine) -> None:
    engine, collector = start_engine(max_concurrent=8)
    step_times: list[float] = []
    lock = threading.Lock()

    def note(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.request_id == "d0":
            with lock:
                step_times.append(time.perf_counter())

    collector.on_event = note
    for i in range(7):
        engine.submit(ask(f"d{i}", PROMPTS[i], max_tokens=400))
    deadline = time.monotonic() + 20 * UNIT
    while len(step_times) < 20 and time.monotonic() < deadline:
        time.sleep(0.005)
    submitted = time.perf_counter()
    engine.submit(ask("late", "A late question about pears?", max_tokens=4))
    late = collector.wait("late")
    ttft = final(late).stats.time_to_first_token  # type: ignore[union-attr]
    first_seen = next(e for e in late if isinstance(e, Output))
    assert first_seen.usage.completion_tokens == 1
    with lock:
        before = [b - a for a, b in itertools.pairwise(step_times) if b < submitted]
    step = statistics.median(before)
    # Prefill in the next step, the first token two steps later: a few steps, not a slice.
    assert ttft < 6 * step + 0.05 * UNIT, (ttft, step)
    assert all(not final_or_none(collector.events[f"d{i}"]) for i in range(7))
    for i in range(7):
        engine.cancel(f"d{i}")
        assert final(collector.wait(f"d{i}")).finish_reason == "cancelled"


def test_seeded_sampling_is_reproducible(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = text_of(run(engine, collector, ask("a", max_tokens=24, sampling=sampling)))
    engine.submit(ask("noise", "Other words", max_tokens=24, sampling=SamplingParams(seed=9)))
    engine.submit(ask("batched", "More words", max_tokens=24, sampling=SamplingParams()))
    engine.submit(ask("b", max_tokens=24, sampling=sampling))
    assert text_of(collector.wait("b")) == alone
    collector.wait("noise")
    assert final(collector.wait("batched")).usage.completion_tokens == 24
    assert engine.fallback_requests == 3
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert text_of(run(engine, collector, ask("c", max_tokens=24, sampling=other))) != alone


def test_unseeded_sampling_shares_a_sampler(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05)
    for i in range(4):
        engine.submit(ask(f"s{i}", PROMPTS[i], max_tokens=12, sampling=sampling))
    for i in range(4):
        assert final(collector.wait(f"s{i}")).usage.completion_tokens == 12
    assert engine.fallback_requests == 0


def test_kv_budget_bounds_memory(start_engine: StartEngine) -> None:
    engine, collector = start_engine(max_concurrent=8, max_kv_bytes=0)
    # A zero budget refuses everything, with a message naming the budget.
    (event,) = run(engine, collector, ask("r0", max_tokens=4))
    assert isinstance(event, Failure)
    assert event.code == "context_length_exceeded"
    assert "KV-cache budget" in event.message

    per_token = engine.kv_bytes_per_token
    assert per_token > 0
    # Room for two rows of ~120 tokens at a time (each may hold 255 more as growth room).
    budget = 2 * 400 * per_token
    engine, collector = start_engine(max_concurrent=8, max_kv_bytes=budget)
    for i in range(4):
        engine.submit(ask(f"r{i}", PROMPTS[i], max_tokens=100))
    peak = 0
    deadline = time.monotonic() + 30 * UNIT
    while time.monotonic() < deadline and not all(
        collector.events[f"r{i}"] and final_or_none(collector.events[f"r{i}"]) for i in range(4)
    ):
        peak = max(peak, engine.kv_bytes)
        time.sleep(0.002)
    for i in range(4):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 100
    assert engine.peak_active_requests == 2
    assert 0 < peak <= budget
    assert engine.kv_bytes <= budget  # what the prefix cache keeps stays within it too


def test_close_drops_running_requests(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    engine.submit(ask("r1", max_tokens=1500))
    deadline = time.monotonic() + 10 * UNIT
    while not collector.events["r1"] and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.close()
    engine.submit(ask("r2"))
    assert collector.events["r2"] == [Failure("r2", "internal_error", "the engine is closed")]


def test_a_failing_row_fails_only_its_request(
    start_engine: StartEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    others = [ask(f"r{i}", PROMPTS[i], max_tokens=12, sampling=GREEDY) for i in range(2)]
    boom = ask("boom", PROMPTS[2], max_tokens=12, sampling=GREEDY)
    boom_prompt = len(reference.prompt(boom))
    assert all(len(reference.prompt(other)) != boom_prompt for other in others)
    fail_third_token(monkeypatch, boom_prompt, "injected row failure")
    engine, collector = start_engine(max_concurrent=4)
    check_failure_stays_alone(
        engine,
        collector,
        boom,
        others,
        message="injected row failure",
        expected_texts=lambda request: reference.greedy(request)[1],
    )
    assert engine.batched_requests == 3
    after = ask("after", PROMPTS[3], max_tokens=6, sampling=GREEDY)
    assert [o.text for o in outputs(run(engine, collector, after))] == reference.greedy(after)[1]
