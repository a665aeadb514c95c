"""logprobs and top_logprobs on both mlx engines, checked against the model run in-process:
each value is the log-softmax of the logits the token was sampled from (after logit bias)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from protocol.frames import LogitBias, SamplingParams, TokenLogprob
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import Engine, Output
from runner.engine.mlx_engine import MlxEngine
from tests.runner.collect import (
    Collector,
    SharedEngine,
    outputs,
    run,
    shared_engine,
)
from tests.runner.engines import GREEDY, MLX_ENGINES, Reference, ask


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


def expected_logprobs(
    reference: Reference, prompt: list[int], tokens: list[int], bias: dict[int, float]
) -> list[mx.array]:
    """The log-softmax over the vocabulary before each generated token, computed in one
    forward pass over prompt + tokens."""
    logits = reference.model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1 :, :]
    logits = logits.astype(mx.float32)
    for token, value in bias.items():
        logits[:, token] += value
    return list(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def token_entries(events: list[Any]) -> list[TokenLogprob]:
    return [entry for output in outputs(events) for entry in output.logprobs]


@pytest.mark.parametrize("bias", [{}, {65: 5.0, 66: -3.0}])
def test_logprobs_are_the_models_own(
    engine: tuple[Engine, Collector], reference: Reference, bias: dict[int, float]
) -> None:
    eng, collector = engine
    sampling = SamplingParams(
        temperature=0.0, logit_bias=tuple(LogitBias(t, b) for t, b in bias.items())
    )
    request = ask(
        "r1", "Tell me about pears.", max_tokens=8, sampling=sampling, logprobs=True, top_logprobs=5
    )
    events = run(eng, collector, request)
    entries = token_entries(events)
    assert isinstance(eng, MlxEngine)  # a batched engine is one too
    tokens = list(dict(eng.stats.recent_tokens)["r1"])  # the last r1 to finish: this one
    assert len(entries) == len(tokens) == 8
    expected = expected_logprobs(reference, reference.prompt(request), tokens, bias)
    for entry, token, vector in zip(entries, tokens, expected, strict=True):
        text = reference.tokenizer.decode([token])
        assert entry.token == text
        assert bytes(entry.bytes).decode() == text
        assert entry.logprob == pytest.approx(vector[token].item(), abs=1e-3)
        top_ids: list[int] = mx.argsort(-vector)[:5].tolist()  # type: ignore[assignment]  # 1-D
        assert [t.token for t in entry.top_logprobs] == [
            reference.tokenizer.decode([i]) for i in top_ids
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [vector[i].item() for i in top_ids], abs=1e-3
        )
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token


def test_no_logprobs_unless_asked(engine: tuple[Engine, Collector]) -> None:
    eng, collector = engine
    events = run(eng, collector, ask("r2", max_tokens=4, sampling=GREEDY))
    assert all(output.logprobs == () for output in outputs(events))


def test_logprobs_without_top(engine: tuple[Engine, Collector]) -> None:
    eng, collector = engine
    events = run(eng, collector, ask("r3", max_tokens=4, sampling=GREEDY, logprobs=True))
    entries = token_entries(events)
    assert len(entries) == 4
    assert all(entry.top_logprobs == () and entry.logprob <= 0 for entry in entries)
    assert sum(isinstance(e, Output) for e in events) == 4
