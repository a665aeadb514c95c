"""What both mlx engines (interleaved and batched) do beyond the Engine contract, on the real
demo model: exact output against plain mlx-lm, the chat template, the prefix cache,
sampling, reasoning, validation and loading."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.frames import Generate, LogitBias, Message, ModelInfo, SamplingParams
from runner.demo_model import DEMO_MODEL_ID
from runner.engine import interleaved
from runner.engine.base import Failure, Output
from runner.engine.batched import Batched
from runner.engine.mlx_engine import MlxEngine, engine_version
from runner.engine.prefix_cache import common_prefix
from runner.errors import ModelLoadError
from tests.runner.collect import (
    Collector,
    SharedEngine,
    engine_starter,
    final,
    outputs,
    run,
    shared_engine,
    text_of,
)
from tests.runner.engines import GREEDY, MLX_ENGINES, MakeMlxEngine, Reference, ask
from tests.support import weights_bytes

StartEngine = Callable[..., tuple[MlxEngine, Collector]]


@pytest.fixture(scope="module", params=list(MLX_ENGINES))
def make_engine(request: pytest.FixtureRequest) -> MakeMlxEngine:
    return MLX_ENGINES[request.param]


@pytest.fixture(scope="module")
def shared(make_engine: MakeMlxEngine, demo_model_path: Path) -> Iterator[SharedEngine[MlxEngine]]:
    with shared_engine(lambda: make_engine(DEMO_MODEL_ID)) as shared:
        yield shared


@pytest.fixture
def lent(shared: SharedEngine[MlxEngine]) -> Iterator[tuple[MlxEngine, Collector]]:
    """The module's engine of this kind, for a test that needs no options nor fresh state."""
    with shared.borrow() as lent:
        yield lent


@pytest.fixture
def start_engine(make_engine: MakeMlxEngine, demo_model_path: Path) -> Iterator[StartEngine]:
    """Engines of this kind of the test's own."""
    with engine_starter(lambda **options: make_engine(DEMO_MODEL_ID, **options)) as start:
        yield start


def test_greedy_equals_stream_generate(
    lent: tuple[MlxEngine, Collector], reference: Reference
) -> None:
    engine, collector = lent
    request = ask("r1", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    events = run(engine, collector, request)
    tokens, texts = reference.greedy(request)
    assert [o.text for o in outputs(events)] == texts
    assert engine.stats.recent_tokens[-1] == ("r1", tuple(tokens))
    assert all(o.tokens == 1 and o.reasoning == "" for o in outputs(events))


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
    assert engine.stats.prefix_cache_hits == 0

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
    # Alongside another request, which reuses the same entry at once (its prompt shares the
    # template's first tokens with it): an entry serves every request that starts with it.
    other = ask("other", "Hello", max_tokens=30, sampling=GREEDY)
    engine.submit(follow_up)
    engine.submit(other)
    events = collector.wait("r2")
    usage = final(events).usage
    prompt = reference.prompt(follow_up)
    assert usage.prompt_tokens == len(prompt)
    # What of the first request's prompt and answer the follow-up starts with (the answer's
    # text, templated, need not be its tokens; its last token never ran through the model):
    # at least all of the first prompt.
    answer = list(dict(engine.stats.recent_tokens)["r1"])
    kept = reference.prompt(first) + answer[:-1]
    assert usage.cached_tokens == common_prefix(kept, prompt) >= len(reference.prompt(first))
    # The reused cache holds the right keys and values: same output as a fresh run.
    assert [o.text for o in outputs(events)] == reference.greedy(follow_up)[1]
    other_usage = final(collector.wait("other")).usage
    assert other_usage.cached_tokens == common_prefix(kept, reference.prompt(other)) > 0
    assert engine.stats.prefix_cache_hits == 2

    again = Generate("r3", DEMO_MODEL_ID, follow_up.messages, max_tokens=4, sampling=GREEDY)
    usage = final(run(engine, collector, again)).usage
    # Everything but the last prompt token, whose logits start generation.
    assert usage.cached_tokens == usage.prompt_tokens - 1
    assert engine.stats.prefix_cache_hits == 3


def test_seeded_sampling_is_reproducible(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = text_of(run(engine, collector, ask("a", max_tokens=24, sampling=sampling)))
    # Again, with other sampled requests drawing alongside it (seeded and not).
    engine.submit(ask("noise", "Other words", max_tokens=24, sampling=SamplingParams(seed=9)))
    engine.submit(ask("unseeded", "More words", max_tokens=24, sampling=SamplingParams()))
    engine.submit(ask("b", max_tokens=24, sampling=sampling))
    assert text_of(collector.wait("b")) == alone
    collector.wait("noise")
    assert final(collector.wait("unseeded")).usage.completion_tokens == 24
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert text_of(run(engine, collector, ask("c", max_tokens=24, sampling=other_seed))) != alone


def test_filters_and_penalties_run(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1, frequency_penalty=0.5
    )
    last = final(run(engine, collector, ask("r1", max_tokens=16, sampling=sampling)))
    assert last.finish_reason == "length"
    assert last.usage.completion_tokens == 16


def test_presence_penalty_counts_generated_tokens_only(
    lent: tuple[MlxEngine, Collector], reference: Reference
) -> None:
    engine, collector = lent
    request = ask("r1", max_tokens=30, sampling=SamplingParams(temperature=0, presence_penalty=50))
    run(engine, collector, request)
    _, tokens = engine.stats.recent_tokens[-1]
    assert len(set(tokens)) == len(tokens)  # nothing generated twice
    # The first token sees no generated tokens, so no penalty: plain greedy's first token.
    assert tokens[0] == reference.greedy(ask("x", max_tokens=1))[0][0]


def test_logit_bias(lent: tuple[MlxEngine, Collector], reference: Reference) -> None:
    engine, collector = lent
    apple = reference.tokenizer.encode(" apple", add_special_tokens=False)
    assert len(apple) == 1
    sampling = SamplingParams(temperature=0, logit_bias=(LogitBias(apple[0], 100.0),))
    events = run(engine, collector, ask("r1", max_tokens=5, sampling=sampling))
    # mlx-lm's byte-level detokenizer drops the leading space of a completion.
    assert text_of(events) == "apple" + " apple" * 4


def test_starting_inside_a_think_span_is_reasoning(
    make_engine: MakeMlxEngine, demo_model_path: Path, tmp_path: Path
) -> None:
    # A copy of the demo model whose template opens the reasoning, as DeepSeek-R1's does.
    thinking = tmp_path / "thinking"
    thinking.mkdir()
    for source in demo_model_path.iterdir():
        (thinking / source.name).write_bytes(source.read_bytes())
    config = thinking / "tokenizer_config.json"
    config.write_text(config.read_text().replace("assistant\\\\n", "assistant\\\\n<think>\\\\n"))

    with engine_starter(lambda: make_engine(str(thinking))) as start:
        engine, collector = start()
        size = weights_bytes(thinking)
        assert engine.models == (ModelInfo(str(thinking), 2048, engine_version(), size_bytes=size),)
        assert engine.weights_bytes == size
        request = Generate("r1", str(thinking), (Message("user", "Hi"),), max_tokens=12)
        events = run(engine, collector, request)
    last = final(events)
    assert text_of(events) == ""
    assert "".join(o.reasoning for o in outputs(events))
    assert last.usage.reasoning_tokens == last.usage.completion_tokens == 12


def test_context_length_checks(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    (event,) = run(engine, collector, ask("long", "apple " * 3000))
    assert isinstance(event, Failure)
    assert event.code == "context_length_exceeded"
    assert event.message.startswith("This model's maximum context length is 2048 tokens;")
    (event,) = run(engine, collector, ask("greedy", max_tokens=2040))
    assert isinstance(event, Failure)
    assert event.code == "context_length_exceeded"
    # Without max_tokens, generation may use the rest of the context.
    last = final(run(engine, collector, ask("rest", "apple " * 2030)))
    assert last.finish_reason == "length"
    assert last.usage.total_tokens == 2048


def test_invalid_requests(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    sampling = SamplingParams(logit_bias=(LogitBias(10**6, 1.0),))
    (event,) = run(engine, collector, ask("r1", sampling=sampling))
    assert isinstance(event, Failure)
    assert event.code == "invalid_request"
    assert "logit_bias names token 1000000" in event.message
    (event,) = run(engine, collector, Generate("r2", "other-model", (Message("user", "Hi"),)))
    assert event == Failure(
        "r2", "model_not_found", f"This engine serves {DEMO_MODEL_ID}, not other-model."
    )


def test_an_error_in_a_generation_stream_fails_one_request_only(
    lent: tuple[MlxEngine, Collector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlx_lm.generate import stream_generate as real

    def broken_for_13(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for count, response in enumerate(real(*args, **kwargs)):
            if kwargs["max_tokens"] == 13 and count == 2:
                raise RuntimeError("boom")
            yield response

    monkeypatch.setattr(interleaved, "stream_generate", broken_for_13)
    # The batched engine runs seeded sampled requests on their own streams.
    engine, collector = lent
    sampling = SamplingParams(seed=5) if isinstance(engine.strategy, Batched) else GREEDY
    engine.submit(ask("bad", max_tokens=13, sampling=sampling))
    engine.submit(ask("good", max_tokens=20, sampling=sampling))
    bad = collector.wait("bad")
    assert [type(e) for e in bad] == [Output, Output, Failure]
    assert bad[-1] == Failure("bad", "internal_error", "RuntimeError: boom")
    assert final(collector.wait("good")).usage.completion_tokens == 20
    # The generation thread lives on.
    assert final(run(engine, collector, ask("after", max_tokens=3))).finish_reason == "length"


def test_load_error_is_raised_by_start(make_engine: MakeMlxEngine, tmp_path: Path) -> None:
    engine = make_engine(str(tmp_path))  # a directory with no model in it
    with pytest.raises(ModelLoadError) as raised:
        engine.start(Collector())
    assert isinstance(raised.value.__cause__, FileNotFoundError)
    assert str(raised.value) == f"FileNotFoundError: {raised.value.__cause__}"
    assert engine.models == ()
