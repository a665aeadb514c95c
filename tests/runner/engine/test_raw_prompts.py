"""Raw prompts (text or token ids, no chat template) on both mlx engines: exactly what
mlx-lm's `stream_generate` makes of the same prompt; the errors that name `prompt`; echo, with
the prompt's logprobs checked against the model run in-process; max_tokens 0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from protocol.frames import Echo, Generate, LogitBias, Message, PromptToken, SamplingParams
from runner.demo_model import CONTEXT_LENGTH, DEMO_MODEL_ID
from runner.engine.base import Engine, Failure, Output
from runner.engine.generation import ECHO_PIECE_CHARS, ECHO_PIECE_TOKENS, split_echo
from runner.engine.mlx_engine import MlxEngine
from tests.runner.collect import (
    Collector,
    SharedEngine,
    outputs,
    run,
    shared_engine,
)
from tests.runner.engines import GREEDY, MLX_ENGINES, Reference

TEXT = "Once upon a time, in an orchard"


@pytest.fixture(scope="module", params=sorted(MLX_ENGINES))
def shared(
    request: pytest.FixtureRequest, demo_model_path: Path
) -> Iterator[SharedEngine[MlxEngine]]:
    """Each mlx engine, started once for the module's tests."""
    make = MLX_ENGINES[request.param]
    with shared_engine(lambda: make(DEMO_MODEL_ID)) as shared:
        yield shared


@pytest.fixture
def engine(shared: SharedEngine[MlxEngine]) -> Iterator[tuple[Engine, Collector]]:
    """The module's engine, lent to this test."""
    with shared.borrow() as lent:
        yield lent


def raw(request_id: str, prompt: str | list[int], **fields: Any) -> Generate:
    if isinstance(prompt, str):
        return Generate(request_id, DEMO_MODEL_ID, (), prompt=prompt, **fields)
    return Generate(request_id, DEMO_MODEL_ID, (), prompt_tokens=tuple(prompt), **fields)


def greedy(reference: Reference, prompt: str | list[int], max_tokens: int) -> str:
    """What mlx-lm makes of the raw prompt, greedily: the tokens `stream_generate` picks, as
    the tokenizer decodes them (a leading space kept, which the stream's text drops)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens = [
        r.token
        for r in stream_generate(
            reference.model,
            reference.tokenizer,
            prompt,
            max_tokens=max_tokens,
            sampler=make_sampler(0.0),
        )
    ]
    text: str = reference.tokenizer.decode(tokens)
    return text


def log_softmax(reference: Reference, tokens: list[int]) -> mx.array:
    """The model's log-softmax at each position of `tokens`, in one forward pass."""
    logits = reference.model(mx.array([tokens]))[0].astype(mx.float32)
    result: mx.array = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return result


def by_choice(events: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in outputs(events):
        texts[event.index] = texts.get(event.index, "") + event.text
    return texts


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text", "token ids"])
def test_a_raw_prompt_is_what_stream_generate_makes_of_it(
    engine: tuple[Engine, Collector], reference: Reference, as_tokens: bool
) -> None:
    eng, collector = engine
    tokens: list[int] = reference.tokenizer.encode(TEXT)
    prompt: str | list[int] = tokens if as_tokens else TEXT
    events = run(eng, collector, raw("r", prompt, max_tokens=12, sampling=GREEDY))
    assert "".join(o.text for o in outputs(events)) == greedy(reference, prompt, 12)
    assert all(o.reasoning == "" and o.echo is None for o in outputs(events))
    usage = outputs(events)[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(tokens), 12)


def test_a_continuation_keeps_its_first_tokens_leading_space(
    engine: tuple[Engine, Collector], reference: Reference
) -> None:
    # OpenAI: "The capital of France is" goes on with " Paris". A chat answer drops the space,
    # as mlx-lm's stream_generate does.
    eng, collector = engine
    (the,) = reference.tokenizer.encode(" the", add_special_tokens=False)
    sampling = SamplingParams(temperature=0, logit_bias=(LogitBias(the, 100.0),))
    events = run(eng, collector, raw("r", TEXT, max_tokens=2, sampling=sampling))
    assert [o.text for o in outputs(events)] == [" the", " the"]
    chat = Generate("c", DEMO_MODEL_ID, (Message("user", TEXT),), max_tokens=2, sampling=sampling)
    assert [o.text for o in outputs(run(eng, collector, chat))] == ["the", " the"]


def test_think_markers_in_a_raw_prompt_are_text(
    engine: tuple[Engine, Collector], reference: Reference
) -> None:
    """A chat prompt ending in <think> opens a think span; a raw one is all text."""
    eng, collector = engine
    prompt = "Let me think. <think>"
    events = run(eng, collector, raw("t", prompt, max_tokens=6, sampling=GREEDY))
    assert "".join(o.text for o in outputs(events)) == greedy(reference, prompt, 6)
    assert outputs(events)[-1].usage.reasoning_tokens == 0


@pytest.mark.parametrize(
    ("generate", "code", "fragment"),
    [
        (raw("e1", [1, 10**6]), "invalid_request", "token 1000000, outside"),
        (raw("e2", [-1]), "invalid_request", "token -1, outside"),
        (raw("e3", ""), "invalid_request", "The prompt is empty"),
        (raw("e4", [5] * CONTEXT_LENGTH), "context_length_exceeded", "the prompt takes 2048"),
        (
            raw("e5", [5] * 10, max_tokens=CONTEXT_LENGTH),
            "context_length_exceeded",
            "(10 in the prompt, 2048 in the completion)",
        ),
    ],
    ids=["outside the vocabulary", "negative", "empty", "too long", "too long with max_tokens"],
)
def test_a_bad_raw_prompt_fails_naming_it(
    engine: tuple[Engine, Collector], generate: Generate, code: str, fragment: str
) -> None:
    eng, collector = engine
    (failure,) = run(eng, collector, generate)
    assert isinstance(failure, Failure)
    assert (failure.code, failure.param) == (code, "prompt")
    assert fragment in failure.message


def test_echo_sends_the_prompt_with_each_choices_first_output(
    engine: tuple[Engine, Collector], reference: Reference
) -> None:
    eng, collector = engine
    tokens: list[int] = reference.tokenizer.encode(TEXT)
    cases: list[tuple[str, str | list[int], str]] = [
        ("text", TEXT, TEXT),
        ("tokens", tokens, reference.tokenizer.decode(tokens)),
    ]
    for request_id, prompt, text in cases:
        request = raw(request_id, prompt, max_tokens=3, sampling=GREEDY, n=2, echo=True)
        events = outputs(run(eng, collector, request))
        firsts: dict[int, Output] = {}
        for event in events:
            firsts.setdefault(event.index, event)
        assert {i: e.echo for i, e in firsts.items()} == {0: Echo(text), 1: Echo(text)}
        assert [e.echo for e in events if e not in firsts.values()] == [None] * (len(events) - 2)
        assert by_choice(events) == dict.fromkeys((0, 1), greedy(reference, prompt, 3))


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echoed_prompt_logprobs_are_the_models_own(
    engine: tuple[Engine, Collector], reference: Reference, max_tokens: int
) -> None:
    eng, collector = engine
    tokens: list[int] = reference.tokenizer.encode(TEXT)
    request = raw(
        "lp",
        TEXT,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
        n=2,
        echo=True,
        prompt_logprobs=True,
        logprobs=True,
        top_logprobs=3,
    )
    events = outputs(run(eng, collector, request))
    echoes = [e.echo for e in events if e.echo is not None]
    assert len(echoes) == 2
    assert echoes[0] == echoes[1]
    echo = echoes[0]
    assert echo.text == TEXT
    assert [t.token for t in echo.tokens] == [reference.tokenizer.decode([t]) for t in tokens]
    first = echo.tokens[0]
    assert (first.logprob, first.top_logprobs) == (None, ())
    expected = log_softmax(reference, tokens)
    for position, entry in enumerate(echo.tokens[1:]):
        row = expected[position]
        assert entry.logprob == pytest.approx(row[tokens[position + 1]].item(), abs=1e-3)
        best: list[int] = mx.argsort(-row)[:3].tolist()  # type: ignore[assignment]  # 1-D
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [row[i].item() for i in best], abs=1e-3
        )
        assert entry.top_logprobs[0].token == reference.tokenizer.decode([best[0]])
    last = events[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(tokens),
        2 * max_tokens,
    )
    if max_tokens == 0:
        assert [(e.text, e.tokens) for e in events] == [("", 0), ("", 0)]
    else:
        # The completion's own logprobs go on as for any request.
        assert by_choice(events) == dict.fromkeys((0, 1), greedy(reference, TEXT, max_tokens))
        assert sum(len(e.logprobs) for e in events) == 2 * max_tokens


def test_no_tokens_without_echo(engine: tuple[Engine, Collector]) -> None:
    eng, collector = engine
    (end,) = outputs(run(eng, collector, raw("z", TEXT, max_tokens=0)))
    assert (end.text, end.tokens, end.finish_reason, end.echo) == ("", 0, "length", None)


def test_a_long_prompts_echo_comes_in_pieces(
    engine: tuple[Engine, Collector], reference: Reference
) -> None:
    """So that no frame grows with the prompt: pieces of at most ECHO_PIECE_TOKENS tokens,
    before the choice's first token, which carries the last one."""
    eng, collector = engine
    tokens = (reference.tokenizer.encode(TEXT) * 60)[: 2 * ECHO_PIECE_TOKENS + 10]
    request = raw(
        "long",
        tokens,
        max_tokens=2,
        sampling=GREEDY,
        echo=True,
        prompt_logprobs=True,
        logprobs=True,
    )
    events = outputs(run(eng, collector, request))
    pieces = [e.echo for e in events if e.echo is not None]
    assert [len(p.tokens) for p in pieces] == [ECHO_PIECE_TOKENS, ECHO_PIECE_TOKENS, 10]
    assert [(e.tokens, e.text) for e in events[:2]] == [(0, ""), (0, "")]
    assert events[2].echo is pieces[2]
    assert events[2].tokens == 1
    assert "".join(p.text for p in pieces) == reference.tokenizer.decode(tokens)
    joined = [t for p in pieces for t in p.tokens]
    assert [t.token for t in joined] == [reference.tokenizer.decode([t]) for t in tokens]
    rows = log_softmax(reference, tokens)
    for position in (0, ECHO_PIECE_TOKENS - 1, ECHO_PIECE_TOKENS, len(tokens) - 2):
        assert joined[position + 1].logprob == pytest.approx(
            rows[position][tokens[position + 1]].item(), abs=1e-3
        )


def test_split_echo() -> None:
    tokens = tuple(PromptToken(str(i), (i,)) for i in range(ECHO_PIECE_TOKENS * 2 + 1))
    text = "x" * (ECHO_PIECE_CHARS * 3 + 1)
    pieces = split_echo(Echo(text, tokens))
    assert len(pieces) == 4
    assert "".join(p.text for p in pieces) == text
    assert tuple(t for p in pieces for t in p.tokens) == tokens
    short = Echo("Hi")
    assert split_echo(short) == [short]
