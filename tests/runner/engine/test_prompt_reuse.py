"""Prompt reuse on the real demo model, both mlx engines: one kept prefix serves concurrent
requests at once with exact usage and unchanged output, requests that arrive together
prefill their shared prefix once, and the disk tier brings prompts back after a restart,
never on the decode step, never from files of other weights."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.frames import Generate, Message
from runner.demo_model import DEMO_MODEL_ID
from runner.engine import kv_store
from runner.engine.base import EngineEvent, Output
from runner.engine.batched import batched_engine
from runner.engine.cache_entry import StoredEntry
from runner.engine.generation import SHARE_MIN
from runner.engine.kv_store import KvStore
from runner.engine.mlx_engine import MlxEngine
from runner.engine.prefix_cache import common_prefix
from tests.runner.collect import Collector, engine_starter, final, hold, outputs, run
from tests.runner.engines import GREEDY, MLX_ENGINES, Reference
from tests.support import UNIT

SYSTEM = " ".join(f"Rule {i}: answer about orchards, briefly and kindly." for i in range(16))

StartEngine = Callable[..., tuple[MlxEngine, Collector]]


@pytest.fixture(params=list(MLX_ENGINES))
def start_engine(request: pytest.FixtureRequest, demo_model_path: Path) -> Iterator[StartEngine]:
    kind = MLX_ENGINES[request.param]
    with engine_starter(lambda **options: kind(DEMO_MODEL_ID, **options)) as start:
        yield start


def chat(request_id: str, system: str, user: str, max_tokens: int = 6) -> Generate:
    return Generate(
        request_id,
        DEMO_MODEL_ID,
        (Message("system", system), Message("user", user)),
        max_tokens=max_tokens,
        sampling=GREEDY,
    )


def kept_tokens(engine: MlxEngine, reference: Reference, request: Generate) -> list[int]:
    """What the prefix cache keeps of a finished request: its prompt and its answer but the
    last token (which never ran through the model)."""
    answer = list(dict(engine.stats.recent_tokens)[request.request_id])
    return reference.prompt(request) + answer[:-1]


def test_one_kept_prefix_serves_concurrent_requests_exactly(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine(max_concurrent=8)
    first = chat("first", SYSTEM, "Hello")
    run(engine, collector, first)
    kept = kept_tokens(engine, reference, first)
    hits = engine.stats.prefix_cache_hits
    requests = [chat(f"r{i}", SYSTEM, f"Question number {i}?") for i in range(8)]
    gate = hold(engine, collector, chat("gate", "Something else entirely.", "Hi", max_tokens=1))
    for request in requests:
        engine.submit(request)
    gate.set()  # all eight reach the engine in one step
    for request in requests:
        events = collector.wait(request.request_id)
        usage = final(events).usage
        prompt = reference.prompt(request)
        assert usage.prompt_tokens == len(prompt)
        assert usage.cached_tokens == common_prefix(kept, prompt) > len(SYSTEM) // 8
        # Read from the shared entry, written on copies: each output is a lone run's.
        assert [o.text for o in outputs(events)] == reference.greedy(request)[1]
    assert engine.stats.prefix_cache_hits - hits == 8 + 1  # the gate reused the template's head
    assert len(engine._generation.prefix_cache) >= 1  # type: ignore[union-attr]


def test_requests_arriving_together_prefill_their_shared_prefix_once(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine(max_concurrent=8)
    system = SYSTEM + " A new system prompt, never seen."
    requests = [chat(f"t{i}", system, f"Tell me {i} things.") for i in range(4)]
    prompts = [reference.prompt(r) for r in requests]
    shared = common_prefix(prompts[0], prompts[1])
    assert shared >= SHARE_MIN
    gate = hold(engine, collector, chat("gate2", "Unrelated.", "Hi", max_tokens=1))
    for request in requests:
        engine.submit(request)
    gate.set()
    usages = [final(collector.wait(r.request_id)).usage for r in requests]
    # One prefills it (reusing the template's head at most); the others wait for that and
    # start from its prompt.
    donor = min(range(4), key=lambda i: usages[i].cached_tokens)
    assert usages[donor].cached_tokens < 16
    for i, usage in enumerate(usages):
        if i != donor:
            assert usage.cached_tokens == common_prefix(prompts[donor], prompts[i]) >= shared - 2
    for request in requests:
        assert [o.text for o in outputs(collector.events[request.request_id])] == (
            reference.greedy(request)[1]
        )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KvStore]:
    made = KvStore(tmp_path / "kv", 1 << 30)
    yield made
    made.close()


def test_a_restarted_engine_reads_its_prompts_back_from_disk(
    start_engine: StartEngine, reference: Reference, store: KvStore
) -> None:
    engine, collector = start_engine(kv_store=store)
    first = chat("before", SYSTEM, "Hello")
    run(engine, collector, first)
    kept = kept_tokens(engine, reference, first)
    store.flush()
    engine.close()

    again, collector = start_engine(kv_store=store)  # what a runner restart does
    assert again._generation is not None
    assert again._generation.prefix_cache.on_disk == 1
    assert again.cache_held() == {}  # the request carried no prefix hashes
    follow = chat("after", SYSTEM, "Hello")
    events = run(again, collector, follow)
    usage, stats = final(events).usage, final(events).stats
    prompt = reference.prompt(follow)
    assert common_prefix(kept, prompt) == len(prompt)  # the same prompt: held whole, but
    assert usage.cached_tokens == usage.prompt_tokens - 1  # its last token runs again
    assert stats is not None
    assert stats.cached_disk_tokens == usage.cached_tokens
    assert [o.text for o in outputs(events)] == reference.greedy(follow)[1]
    # A third asks again: from memory now.
    third = final(run(again, collector, chat("third", SYSTEM, "Hello")))
    assert third.stats is not None
    assert (third.usage.cached_tokens, third.stats.cached_disk_tokens) == (usage.cached_tokens, 0)


def test_reading_from_disk_never_holds_up_the_running_streams(
    start_engine: StartEngine, store: KvStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, collector = start_engine(kv_store=store)
    run(engine, collector, chat("kept", SYSTEM, "Hello"))
    store.flush()
    engine.close()
    again, collector = start_engine(kv_store=store)

    # The read blocks until the running stream has produced 10 more tokens: were it on the
    # generation thread, that stream could never get them.
    streamed = threading.Event()
    real = kv_store.ModelStore._verified

    def slow_read(self: kv_store.ModelStore, stored: StoredEntry) -> Any:
        assert streamed.wait(20 * UNIT), "the running stream stalled while the disk was read"
        return real(self, stored)

    monkeypatch.setattr(kv_store.ModelStore, "_verified", slow_read)
    running = chat("running", "A stream that runs on.", "Go", max_tokens=200)
    counted = [0]

    def on_event(event: EngineEvent) -> None:
        if event.request_id == "running":
            counted[0] += 1
            if counted[0] == 10:
                streamed.set()

    collector.on_event = on_event
    again.submit(running)
    collector.wait_for_outputs("running", 1)
    counted[0] = 0
    reader = chat("reader", SYSTEM, "Hello")
    again.submit(reader)
    usage = final(collector.wait("reader")).usage
    assert usage.cached_tokens == usage.prompt_tokens - 1
    assert final(collector.wait("running")).usage.completion_tokens == 200


def test_writing_to_disk_never_holds_up_the_running_streams(
    start_engine: StartEngine, store: KvStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, collector = start_engine(kv_store=store)
    written = threading.Event()
    real = kv_store.ModelStore._write

    def slow_write(self: kv_store.ModelStore, *args: Any) -> None:
        assert written.wait(20 * UNIT), "the requests after it stalled while it was written"
        real(self, *args)

    monkeypatch.setattr(kv_store.ModelStore, "_write", slow_write)
    run(engine, collector, chat("kept", SYSTEM, "Hello"))  # its write waits...
    after = run(engine, collector, chat("next", "Another prompt.", "Hi", max_tokens=20))
    assert final(after).usage.completion_tokens == 20  # ... while the engine serves on
    written.set()
    store.flush()
    assert engine._generation is not None
    engine._generation.prefix_cache.poll()
    assert all(e.stored is not None for e in engine._generation.prefix_cache.entries())


def test_files_of_other_weights_under_the_same_name_are_ignored(
    demo_model_path: Path, tmp_path: Path, reference: Reference, store: KvStore
) -> None:
    copy = tmp_path / "my-model"
    shutil.copytree(demo_model_path, copy)

    def start() -> tuple[MlxEngine, Collector]:
        collector = Collector()
        engine = batched_engine(str(copy), kv_store=store)
        engine.start(collector)
        return engine, collector

    engine, collector = start()
    request = Generate("a", str(copy), (Message("system", SYSTEM), Message("user", "Hi")), 4)
    run(engine, collector, request)
    store.flush()
    engine.close()
    weights = copy / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    engine, collector = start()  # the same name, other weights (as far as the files say)
    try:
        assert engine._generation is not None
        assert engine._generation.prefix_cache.on_disk == 0
        again = Generate("b", str(copy), request.messages, 4)
        stats = final(run(engine, collector, again)).stats
        assert stats is not None
        assert stats.cached_disk_tokens == 0
    finally:
        engine.close()


def test_the_prefix_hashes_of_kept_prompts_are_reported_before_the_last_output(
    start_engine: StartEngine,
) -> None:
    engine, collector = start_engine()
    order: list[str] = []
    engine.watch_cache(lambda change: order.append(f"held {','.join(change.added)}"))

    def on_event(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.finish_reason is not None:
            order.append(f"end {event.request_id}")

    collector.on_event = on_event
    request = Generate(
        "tagged",
        DEMO_MODEL_ID,
        (Message("user", "Hello"),),
        max_tokens=3,
        sampling=GREEDY,
        prefix=("aaaa", "bbbb"),
    )
    run(engine, collector, request)
    assert order == ["held aaaa,bbbb", "end tagged"]
    assert sorted(engine.cache_held()[DEMO_MODEL_ID]) == ["aaaa", "bbbb"]
