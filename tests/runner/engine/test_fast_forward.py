"""Forced tokens (runner.engine.fast_forward): a lone constrained request feeds the text its
grammar forces in one forward pass, and writes the same tokens as the same request decoded a
token at a time (mlx-lm's `stream_generate` with the constraint's processor), as a batch row,
handed from the lone decoder to the batch at any token, or on `--engine mlx`; stop strings
and `max_tokens` still cut where they would, and the KV cache kept after it is right."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from protocol.frames import LogitBias, SamplingParams
from runner.demo_model import DEMO_MODEL_ID
from runner.engine import fast_forward, solo
from runner.engine.batched import batched_engine
from runner.engine.masking import BatchConstraints, ConstraintProcessor
from runner.engine.mlx_engine import MlxEngine
from tests.runner.collect import engine_starter, final, hold, outputs, run, text_of
from tests.runner.engine.constraint_cases import (
    CRATES,
    SMALL,
    compile_for,
    crates,
    schema_format,
    stepwise,
)
from tests.runner.engines import GREEDY, Reference, ask


@pytest.fixture
def start(demo_model_path: Path) -> Iterator[Any]:
    with engine_starter(lambda **options: batched_engine(DEMO_MODEL_ID, **options)) as start:
        yield start


@pytest.fixture
def forward_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens fed by each forward pass of `forced_steps` (prefill included), by call."""
    fed: list[int] = []
    original = fast_forward.forced_steps

    def counting(model: Any, *args: Any, **kwargs: Any) -> Any:
        def call(inputs: Any, **options: Any) -> Any:
            fed.append(int(inputs.shape[1]))
            return model(inputs, **options)

        return original(call, *args, **kwargs)

    monkeypatch.setattr(solo, "forced_steps", counting)
    return fed


def generated(engine: Any) -> list[int]:
    """The tokens of the request that finished last."""
    return list(engine.stats.recent_tokens[-1][1])


def test_a_lone_request_feeds_forced_text_in_one_pass(
    start: Any, reference: Reference, forward_passes: list[int]
) -> None:
    engine, collector = start()
    events = run(engine, collector, crates("alone"))
    answer = json.loads(text_of(events))
    jsonschema.validate(answer, CRATES)
    tokens = generated(engine)
    assert tokens == stepwise(reference, crates("x"))
    last = final(events)
    assert last.finish_reason == "stop"
    assert last.usage.completion_tokens == len(tokens)
    assert tokens[-1] in reference.tokenizer.eos_token_ids
    # Every token was fed once (the last, an end of sequence, is not fed), in far fewer
    # passes than tokens: most of the answer is forced.
    prompt = len(reference.prompt(crates("x")))
    assert sum(forward_passes) == prompt + len(tokens) - 1
    decode_passes = len(forward_passes) - (1 if forward_passes[0] == prompt - 1 else 0)
    assert decode_passes < len(tokens) / 2, (decode_passes, len(tokens))
    assert max(forward_passes[1:]) > 3


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SamplingParams(temperature=0, frequency_penalty=1.5)],
    ids=["greedy", "penalties"],
)
def test_alone_in_a_batch_and_on_the_interleaved_engine_the_same_tokens(
    start: Any, reference: Reference, demo_model_path: Path, sampling: SamplingParams
) -> None:
    # With penalties the model would spell forced text its own way (repeated tokens cost
    # more): every way writes the grammar's canonical tokens all the same.
    expected = stepwise(reference, crates("x", sampling=sampling))
    engine, collector = start(max_concurrent=4)
    run(engine, collector, crates("alone", sampling=sampling))
    assert generated(engine) == expected
    # In a batch from its first step, beside a free request and another constrained one.
    gate = hold(engine, collector, ask("gate", max_tokens=1, sampling=GREEDY))
    engine.submit(crates("row", sampling=sampling))
    engine.submit(ask("free", "Pears?", max_tokens=60, sampling=GREEDY))
    engine.submit(
        ask("small", "Figs?", max_tokens=60, sampling=GREEDY, response_format=schema_format(SMALL))
    )
    gate.set()
    collector.wait("row")
    assert engine.stats.peak_batch_size == 3
    row = next(t for rid, t in engine.stats.recent_tokens if rid == "row")
    assert list(row) == expected
    with engine_starter(lambda: MlxEngine(DEMO_MODEL_ID)) as start_mlx:
        interleaved, events = start_mlx()
        run(interleaved, events, crates("interleaved", sampling=sampling))
        assert generated(interleaved) == expected


def test_handed_to_the_batch_at_any_token_the_same_tokens(
    start: Any, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = stepwise(reference, crates("x"))
    rolled: list[int] = []
    rollback = ConstraintProcessor.rollback

    def recorded(self: ConstraintProcessor, tokens: int) -> None:
        rolled.append(tokens)
        rollback(self, tokens)

    monkeypatch.setattr(ConstraintProcessor, "rollback", recorded)
    engine, collector = start(max_concurrent=4)
    for at in range(1, 13):
        name = f"at{at}"
        joined: list[str] = []

        def join(event: Any, at: int = at, joined: list[str] = joined) -> None:
            # A second request arrives after `at` tokens: the lone one joins the batch.
            if (
                event.request_id.startswith("at")
                and not joined
                and event.usage.completion_tokens >= at
            ):
                joined.append(f"free{at}")
                engine.submit(ask(f"free{at}", "Pears?", max_tokens=40, sampling=GREEDY))

        collector.on_event = join
        events = run(engine, collector, crates(name))
        collector.wait(f"free{at}")
        collector.on_event = None
        tokens = next(t for rid, t in engine.stats.recent_tokens if rid == name)
        assert list(tokens) == expected, at
        jsonschema.validate(json.loads(text_of(events)), CRATES)
    # Some handovers came inside a forced group: the matcher went back more than a token.
    assert max(rolled) > 1, rolled


def test_logprobs_and_logit_bias_sample_every_token(
    start: Any, reference: Reference, forward_passes: list[int]
) -> None:
    engine, collector = start()
    (space,) = reference.tokenizer.encode(" ", add_special_tokens=False)
    for request in (
        crates("logprobs", logprobs=True, top_logprobs=2),
        crates("bias", sampling=SamplingParams(temperature=0, logit_bias=(LogitBias(space, -1),))),
    ):
        events = run(engine, collector, request)
        jsonschema.validate(json.loads(text_of(events)), CRATES)
        assert forward_passes == [], request.request_id
    # Every token has its log-probability, forced text included.
    logprobs = [entry for o in outputs(collector.wait("logprobs")) for entry in o.logprobs]
    assert len(logprobs) == final(collector.wait("logprobs")).usage.completion_tokens
    run(engine, collector, crates("plain"))
    assert forward_passes


def test_stop_strings_and_max_tokens_cut_inside_forced_text(
    start: Any, reference: Reference, forward_passes: list[int]
) -> None:
    engine, collector = start()
    expected = reference.tokenizer.decode(stepwise(reference, crates("x"))[:-1])
    # `"n` ends inside a forced group (`, "n": `): the cache had run ahead of the stop.
    events = run(engine, collector, crates("stop", stop=('"n',)))
    last = final(events)
    assert last.finish_reason == "stop"
    assert text_of(events) == expected[: expected.index('"n')]
    assert sum(forward_passes) > last.usage.prompt_tokens + last.usage.completion_tokens
    # The KV cache kept is the prompt and the tokens given: the same prompt reuses it.
    events = run(engine, collector, crates("again"))
    assert final(events).usage.cached_tokens == len(reference.prompt(crates("x"))) - 1
    assert reference.tokenizer.decode(generated(engine)[:-1]) == expected
    for limit in (1, 2, 5, 9):
        events = run(engine, collector, crates(f"max{limit}", max_tokens=limit))
        last = final(events)
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == limit == len(generated(engine))
        assert expected.startswith(text_of(events))


def test_the_processor_forces_and_rolls_back_forced_tokens(reference: Reference) -> None:
    constraint = compile_for(reference.tokenizer, response_format=schema_format(SMALL))
    processor = constraint.processor()
    # At the start `{"ok": ` is forced; its tokens come one at a time.
    first = processor.forced_next()
    assert first is not None
    forced = []
    while (token := processor.forced_next()) is not None:
        forced.append(token)
        processor.consume(token)
    assert reference.tokenizer.decode(forced).startswith('{"ok')
    assert processor.consumed == len(forced)
    # Past the forced run the model chooses: the next lookup is past its token, not before.
    assert processor.forced_next() is None
    # Roll back into the forced run: those tokens are forced again, in order.
    processor.rollback(2)
    assert processor.consumed == len(forced) - 2
    assert processor.forced_next() == forced[-2]
    processor.consume(forced[-2])
    assert processor.forced_next() == forced[-1]
    processor.consume(forced[-1])
    # The lone decoder's way takes a whole group at once.
    other = constraint.processor()
    assert other.forced(100) == forced
    assert other.consumed == len(forced)
    assert other.forced(100) == []  # looked up once past each sampled token
    # No more than the limit (what max_tokens leaves).
    third = constraint.processor()
    assert third.forced(2) == forced[:2]
    assert third.consumed == 2


class _Counted:
    """A matcher that counts the masks computed on it."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.masks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.matcher, name)

    def unsafe_compute_mask_ptr(self, *args: Any) -> None:
        self.masks += 1
        self.matcher.unsafe_compute_mask_ptr(*args)


def test_a_batch_row_takes_a_forced_token_without_computing_a_mask(
    reference: Reference,
) -> None:
    constraint = compile_for(reference.tokenizer, response_format=schema_format(SMALL))
    vocab = reference.model.model.embed_tokens.weight.shape[0]
    forced = constraint.processor().forced(100)  # `{"ok": `
    rows = BatchConstraints()
    processors = [constraint.processor(), constraint.processor(forcing=False)]
    counted = []
    for uid, processor in enumerate(processors, 1):
        counted.append(_Counted(processor.matcher))
        processor.matcher = counted[-1]  # type: ignore[assignment]  # a proxy
        rows.add(uid, processor)
    given = 0
    for token in forced:
        masked = rows.mask([1, 2, 3], mx.array([given] * 3), mx.zeros((3, 1, vocab)))
        finite = np.array(masked[:, 0, :]) > -np.inf
        # Both grammar rows allow that token alone (llguidance's mask allows forced text
        # only in its canonical tokens); a row without a constraint allows everything.
        assert set(np.flatnonzero(finite[0])) == set(np.flatnonzero(finite[1])) == {token}
        assert finite[2].all()
        given = token
    # The forcing row computed no mask for them; the other one a mask a token.
    assert [c.masks for c in counted] == [0, len(forced)]
    # Past them the model chooses: the forcing row computes its mask too.
    rows.mask([1, 2, 3], mx.array([given] * 3), mx.zeros((3, 1, vocab)))
    assert [c.masks for c in counted] == [1, len(forced) + 1]
