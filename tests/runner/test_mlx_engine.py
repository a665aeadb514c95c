"""MlxEngine on the real demo model: exact greedy output, accounting, cache, cancel, concurrency."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.frames import Generate, LogitBias, Message, ModelInfo, SamplingParams, Usage
from runner.demo_model import DEMO_MODEL_ID
from runner.engine import interleaved
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.mlx_engine import MlxEngine
from runner.errors import ModelLoadError
from tests.runner.collect import (
    Collector,
    check_failure_stays_alone,
    engine_starter,
    fail_third_token,
    final,
    is_terminal,
    outputs,
    run,
    text_of,
)
from tests.support import UNIT


def ask(request_id: str, content: str = "Hello there", **fields: Any) -> Generate:
    return Generate(request_id, DEMO_MODEL_ID, (Message("user", content),), **fields)


class Reference:
    """Plain in-process mlx-lm on this (the main) thread: what the engine must reproduce."""

    def __init__(self, path: Path) -> None:
        import mlx_lm

        loaded: Any = mlx_lm.load(str(path))  # annotated as a 2- or 3-tuple
        self.model, self.tokenizer = loaded[0], loaded[1]

    def prompt(self, generate: Generate) -> list[int]:
        messages = [{"role": m.role, "content": m.content} for m in generate.messages]
        tokens: list[int] = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokens

    def greedy(self, generate: Generate) -> tuple[list[int], list[str]]:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        assert generate.max_tokens is not None
        responses = list(
            stream_generate(
                self.model,
                self.tokenizer,
                self.prompt(generate),
                max_tokens=generate.max_tokens,
                sampler=make_sampler(0.0),
            )
        )
        return [r.token for r in responses], [r.text for r in responses]


@pytest.fixture(scope="module")
def reference(demo_model_path: Path) -> Reference:
    return Reference(demo_model_path)


StartEngine = Callable[..., tuple[MlxEngine, Collector]]


@pytest.fixture
def start_engine(demo_model_path: Path) -> Iterator[StartEngine]:
    with engine_starter(MlxEngine) as start:
        yield start


GREEDY = SamplingParams(temperature=0.0)


def test_models(start_engine: StartEngine) -> None:
    engine, _ = start_engine()
    assert engine.models == (ModelInfo(DEMO_MODEL_ID, 2048),)


def test_idle_engine_sleeps(start_engine: StartEngine) -> None:
    start_engine()
    cpu = time.process_time()
    time.sleep(0.3)
    # The generation thread blocks on its inbox: no polling.
    assert time.process_time() - cpu < 0.05


def test_greedy_equals_stream_generate(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine()
    request = ask("r1", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    events = run(engine, collector, request)
    tokens, texts = reference.greedy(request)
    assert [o.text for o in outputs(events)] == texts
    assert engine.recent_tokens[-1] == ("r1", tuple(tokens))
    assert all(o.tokens == 1 and o.reasoning == "" for o in outputs(events))


def test_max_tokens_ends_with_length(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine()
    request = ask("r1", max_tokens=17, sampling=GREEDY)
    events = run(engine, collector, request)
    last = final(events)
    assert last.finish_reason == "length"
    assert last.usage == Usage(prompt_tokens=len(reference.prompt(request)), completion_tokens=17)
    assert len(outputs(events)) == 17
    assert [o.usage.completion_tokens for o in outputs(events)] == list(range(1, 18))
    assert last.stats is not None
    assert last.stats.time_to_first_token > 0
    assert last.stats.generation_tps > 0
    assert last.stats.prompt_tps > 0
    assert last.stats.peak_memory_bytes > 0


def test_prompt_tokens_are_the_templated_length(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine(prefix_cache_size=0)
    messages = (
        Message("system", "You are terse."),
        Message("user", "What is an orchard?"),
        Message("assistant", "A place with trees."),
        Message("user", "And in winter?"),
    )
    request = Generate("r1", DEMO_MODEL_ID, messages, max_tokens=3)
    events = run(engine, collector, request)
    assert final(events).usage.prompt_tokens == len(reference.prompt(request))
    # "developer" is the newer name of "system": same template, same prompt.
    developer = Generate(
        "r2", DEMO_MODEL_ID, (Message("developer", "You are terse."), *messages[1:]), max_tokens=3
    )
    assert final(run(engine, collector, developer)).usage.prompt_tokens == len(
        reference.prompt(request)
    )


def test_prefix_cache_reuses_a_shared_prefix(
    start_engine: StartEngine, reference: Reference
) -> None:
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
    events = run(engine, collector, follow_up)
    usage = final(events).usage
    prompt = reference.prompt(follow_up)
    assert usage.prompt_tokens == len(prompt)
    shared = len(reference.prompt(first))
    assert shared <= usage.cached_tokens < usage.prompt_tokens
    assert engine.prefix_cache_hits == 1
    # The reused cache holds the right keys and values: same output as a fresh run.
    _, texts = reference.greedy(follow_up)
    assert [o.text for o in outputs(events)] == texts

    again = Generate("r3", DEMO_MODEL_ID, follow_up.messages, max_tokens=4, sampling=GREEDY)
    usage = final(run(engine, collector, again)).usage
    # Everything but the last prompt token, whose logits start generation.
    assert usage.cached_tokens == usage.prompt_tokens - 1


def test_cancel_mid_generation(start_engine: StartEngine) -> None:
    engine, collector = start_engine()

    def cancel_after_five(event: EngineEvent) -> None:
        if isinstance(event, Output) and event.usage.completion_tokens == 5:
            engine.cancel("r1")

    collector.on_event = cancel_after_five
    events = run(engine, collector, ask("r1", max_tokens=1000))
    last = final(events)
    assert last.finish_reason == "cancelled"
    assert last.tokens == 0
    emitted = sum(o.tokens for o in outputs(events))
    # The cancel lands between two steps: nothing is generated after it.
    assert last.usage.completion_tokens == emitted == 5
    assert engine.active_requests == 0
    engine.cancel("r1")  # finished: ignored
    engine.cancel("never-seen")


def test_cancel_of_a_queued_request(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine(max_concurrent=1)
    engine.submit(ask("long", max_tokens=1500))
    queued = ask("queued", max_tokens=5)
    engine.submit(queued)
    engine.cancel("queued")
    events = collector.wait("queued")
    last = final(events)
    assert last.finish_reason == "cancelled"
    assert last.usage == Usage(prompt_tokens=len(reference.prompt(queued)), completion_tokens=0)
    engine.cancel("long")
    assert final(collector.wait("long")).finish_reason == "cancelled"


def test_concurrent_requests_do_not_mix(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine(max_concurrent=4)
    requests = [
        ask(f"r{i}", content, max_tokens=24 + i, sampling=GREEDY)
        for i, content in enumerate(
            ["Tell me about apples.", "What is 2+2?", "Hello", "Write a poem about the sea."]
        )
    ]
    for request in requests:
        engine.submit(request)
    for request in requests:
        events = collector.wait(request.request_id)
        assert [o.text for o in outputs(events)] == reference.greedy(request)[1]
        assert final(events).usage.completion_tokens == request.max_tokens
    assert engine.peak_active_requests == 4


def test_more_requests_than_slots_wait_their_turn(start_engine: StartEngine) -> None:
    engine, collector = start_engine(max_concurrent=2)
    for i in range(5):
        engine.submit(ask(f"r{i}", max_tokens=8))
    for i in range(5):
        assert final(collector.wait(f"r{i}")).usage.completion_tokens == 8
    assert engine.peak_active_requests == 2
    assert engine.tokens_generated == 40


def test_seeded_sampling_is_reproducible(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = text_of(run(engine, collector, ask("a", max_tokens=24, sampling=sampling)))
    # Again, with another sampled request interleaving its draws.
    engine.submit(ask("noise", "Other words", max_tokens=24, sampling=SamplingParams(seed=9)))
    engine.submit(ask("b", max_tokens=24, sampling=sampling))
    assert text_of(collector.wait("b")) == alone
    collector.wait("noise")
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert text_of(run(engine, collector, ask("c", max_tokens=24, sampling=other_seed))) != alone


def test_filters_and_penalties_run(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1, frequency_penalty=0.5
    )
    last = final(run(engine, collector, ask("r1", max_tokens=16, sampling=sampling)))
    assert last.finish_reason == "length"
    assert last.usage.completion_tokens == 16


def test_presence_penalty_counts_generated_tokens_only(
    start_engine: StartEngine, reference: Reference
) -> None:
    engine, collector = start_engine()
    request = ask("r1", max_tokens=30, sampling=SamplingParams(temperature=0, presence_penalty=50))
    run(engine, collector, request)
    _, tokens = engine.recent_tokens[-1]
    assert len(set(tokens)) == len(tokens)  # nothing generated twice
    # The first token sees no generated tokens, so no penalty: plain greedy's first token.
    assert tokens[0] == reference.greedy(ask("x", max_tokens=1))[0][0]


def test_logit_bias(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine()
    apple = reference.tokenizer.encode(" apple", add_special_tokens=False)
    assert len(apple) == 1
    sampling = SamplingParams(temperature=0, logit_bias=(LogitBias(apple[0], 100.0),))
    events = run(engine, collector, ask("r1", max_tokens=5, sampling=sampling))
    # mlx-lm's byte-level detokenizer drops the leading space of a completion.
    assert text_of(events) == "apple" + " apple" * 4


def test_end_of_sequence_ends_with_stop(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine()
    eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = SamplingParams(temperature=0, logit_bias=(LogitBias(eos, 100.0),))
    events = run(engine, collector, ask("r1", max_tokens=50, sampling=sampling))
    last = final(events)
    assert last.finish_reason == "stop"
    assert (last.text, last.tokens) == ("", 1)
    # Like vLLM, the end-of-sequence token is a completion token.
    assert last.usage.completion_tokens == 1


def test_stop_string(start_engine: StartEngine, reference: Reference) -> None:
    engine, collector = start_engine(prefix_cache_size=0)
    plain = ask("r0", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    _, texts = reference.greedy(plain)
    full = "".join(texts)
    # A stop string that straddles a token boundary, from the middle of the output.
    boundary = len("".join(texts[:10]))
    stop = full[boundary - 2 : boundary + 2]
    start = full.index(stop)
    ends = [len("".join(texts[: i + 1])) for i in range(len(texts))]
    completing_token = next(i for i, end in enumerate(ends) if end >= start + len(stop))

    request = ask("r1", "Tell me about apples.", max_tokens=40, stop=(stop,), sampling=GREEDY)
    events = run(engine, collector, request)
    last = final(events)
    assert last.finish_reason == "stop"
    assert text_of(events) == full[:start]
    assert last.usage.completion_tokens == completing_token + 1

    # Text held back as a possible stop string comes out when generation ends otherwise.
    never = full[-3:] + "\x00"
    request = ask("r2", "Tell me about apples.", max_tokens=40, stop=(never,), sampling=GREEDY)
    events = run(engine, collector, request)
    assert (text_of(events), final(events).finish_reason) == (full, "length")


def test_starting_inside_a_think_span_is_reasoning(
    demo_model_path: Path, tmp_path: Path, reference: Reference
) -> None:
    # A copy of the demo model whose template opens the reasoning, as DeepSeek-R1's does.
    thinking = tmp_path / "thinking"
    thinking.mkdir()
    for source in demo_model_path.iterdir():
        (thinking / source.name).write_bytes(source.read_bytes())
    config = thinking / "tokenizer_config.json"
    config.write_text(config.read_text().replace("assistant\\\\n", "assistant\\\\n<think>\\\\n"))

    collector = Collector()
    engine = MlxEngine(str(thinking))
    engine.start(collector)
    try:
        assert engine.models == (ModelInfo(str(thinking), 2048),)
        request = Generate("r1", str(thinking), (Message("user", "Hi"),), max_tokens=12)
        events = run(engine, collector, request)
    finally:
        engine.close()
    last = final(events)
    assert text_of(events) == ""
    assert "".join(o.reasoning for o in outputs(events))
    assert last.usage.reasoning_tokens == last.usage.completion_tokens == 12


def test_context_length_exceeded(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    events = run(engine, collector, ask("long", "apple " * 3000))
    assert len(events) == 1
    assert isinstance(events[0], Failure)
    assert events[0].code == "context_length_exceeded"
    events = run(engine, collector, ask("greedy", max_tokens=2040))
    assert isinstance(events[0], Failure)
    assert events[0].code == "context_length_exceeded"
    # Without max_tokens, generation may use the rest of the context.
    last = final(run(engine, collector, ask("rest", "apple " * 2030)))
    assert last.finish_reason == "length"
    assert last.usage.total_tokens == 2048


def test_invalid_requests(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    sampling = SamplingParams(logit_bias=(LogitBias(10**6, 1.0),))
    (event,) = run(engine, collector, ask("r1", sampling=sampling))
    assert isinstance(event, Failure)
    assert event.code == "invalid_request"
    (event,) = run(engine, collector, Generate("r2", "other-model", (Message("user", "Hi"),)))
    assert event == Failure(
        "r2", "model_not_found", f"This engine serves {DEMO_MODEL_ID}, not other-model."
    )


def test_an_error_fails_one_request_only(
    start_engine: StartEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.generate import stream_generate as real

    def broken_for_13(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for count, response in enumerate(real(*args, **kwargs)):
            if kwargs["max_tokens"] == 13 and count == 2:
                raise RuntimeError("boom")
            yield response

    monkeypatch.setattr(interleaved, "stream_generate", broken_for_13)
    engine, collector = start_engine()
    engine.submit(ask("bad", max_tokens=13))
    engine.submit(ask("good", max_tokens=20))
    bad = collector.wait("bad")
    assert isinstance(bad[-1], Failure)
    assert (bad[-1].code, bad[-1].message) == ("internal_error", "RuntimeError: boom")
    assert final(collector.wait("good")).usage.completion_tokens == 20
    # The generation thread lives on.
    assert final(run(engine, collector, ask("after", max_tokens=3))).finish_reason == "length"


def test_load_error_is_raised_by_start(tmp_path: Path) -> None:
    engine = MlxEngine(str(tmp_path))  # a directory with no model in it
    with pytest.raises(ModelLoadError) as raised:
        engine.start(Collector())
    assert isinstance(raised.value.__cause__, FileNotFoundError)
    assert str(raised.value) == f"FileNotFoundError: {raised.value.__cause__}"


def test_close_drops_running_requests(start_engine: StartEngine) -> None:
    engine, collector = start_engine()
    engine.submit(ask("r1", max_tokens=1500))
    deadline = time.monotonic() + 10 * UNIT
    while not collector.events["r1"] and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.close()
    count = len(collector.events["r1"])
    assert not any(is_terminal(e) for e in collector.events["r1"])
    engine.submit(ask("r2"))
    assert collector.events["r2"] == [Failure("r2", "internal_error", "the engine is closed")]
    time.sleep(0.05)
    assert len(collector.events["r1"]) == count


def test_a_failing_request_ends_alone(
    start_engine: StartEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    others = [ask(f"r{i}", f"Question {i}?", max_tokens=12, sampling=GREEDY) for i in range(2)]
    boom = ask("boom", "Explode at the third token, please?", max_tokens=12, sampling=GREEDY)
    boom_prompt = len(reference.prompt(boom))
    assert all(len(reference.prompt(other)) != boom_prompt for other in others)
    fail_third_token(monkeypatch, boom_prompt, "injected failure")
    engine, collector = start_engine(max_concurrent=4)
    check_failure_stays_alone(
        engine,
        collector,
        boom,
        others,
        message="injected failure",
        expected_texts=lambda request: reference.greedy(request)[1],
    )
