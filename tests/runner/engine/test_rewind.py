"""A hybrid model's lone request (runner.engine.rewind): LFM2's convolution states cannot be
trimmed, yet its lone request decodes on a plain cache and is handed to the batch at any
token, its cache taken back by snapshots; the tokens are mlx-lm's own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from protocol.frames import Generate, Message, SamplingParams, Tool
from runner.demo_families import FAMILIES
from runner.engine.batched import batched_engine
from runner.engine.mlx_engine import MlxEngine
from runner.engine.mlx_model import MlxModel
from runner.engine.rewind import Rewinder, rewindable
from tests.runner.collect import Collector, run
from tests.runner.engines import greedy_tokens

LFM2 = FAMILIES["lfm2"].model_id
GREEDY = SamplingParams(temperature=0)
WEATHER = Tool(
    "get_weather",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)


def ask(request_id: str, **fields: Any) -> Generate:
    return Generate(request_id, LFM2, (Message("user", "The weather in Paris?"),), **fields)


@pytest.fixture(scope="module")
def model() -> MlxModel:
    return MlxModel.load(LFM2)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[MlxEngine, Collector]]:
    collector = Collector()
    engine = batched_engine(LFM2, max_concurrent=4)
    engine.start(collector)
    yield engine, collector
    engine.close()


def _logits(model: Any, cache: list[Any], tokens: list[int]) -> Any:
    out = model(mx.array([tokens]), cache=cache)[0, -1]
    mx.eval(out)
    return out


def test_a_rewound_cache_is_the_cache_of_fewer_tokens(model: MlxModel) -> None:
    prompt = model.prepare(ask("r"), 0.0).prompt
    cache = make_prompt_cache(model.model)
    assert any(isinstance(c, ArraysCache) for c in cache)
    assert any(isinstance(c, KVCache) for c in cache)
    assert rewindable(cache)
    rewinder = Rewinder(model.model, cache, 0)
    rewinder(mx.array([prompt]), cache=cache)
    rewinder(mx.array([[11]]), cache=cache)
    rewinder(mx.array([[12, 13, 14]]), cache=cache)
    assert rewinder.offset == len(prompt) + 4
    # Back to the start of the last call: the prompt and token 11.
    assert rewinder.rewind(len(prompt) + 3) == len(prompt) + 1
    assert rewinder.offset == len(prompt) + 1
    fresh = make_prompt_cache(model.model)
    model.model(mx.array([[*prompt, 11]]), cache=fresh)
    assert mx.allclose(_logits(model.model, cache, [20]), _logits(model.model, fresh, [20]))
    # Further back than the calls kept: refused.
    with pytest.raises(ValueError, match="no call started"):
        rewinder.rewind(len(prompt) - 1)


def test_rewindable_refuses_a_layer_that_neither_trims_nor_snapshots() -> None:
    class Fixed:
        def is_trimmable(self) -> bool:
            return False

    plain: Any = KVCache  # untyped in mlx-lm
    assert rewindable([plain(), ArraysCache(1)])
    assert not rewindable([plain(), Fixed()])


def _reference(model: MlxModel, request: Generate, constrained: bool) -> list[int]:
    from runner.engine.constraint import constraint_for

    prompt = model.prepare(request, 0.0).prompt
    processors = []
    if constrained:
        constraint = constraint_for(request, model.tokenizer, vocab_size=model.vocab_size)
        assert constraint is not None
        processors.append(constraint.processor(forcing=False))
    assert request.max_tokens is not None
    return greedy_tokens(model.model, model.tokenizer, prompt, request.max_tokens, processors)


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "forced-call"])
def test_a_lone_hybrid_request_is_handed_over_at_any_token(
    model: MlxModel,
    engine: tuple[MlxEngine, Collector],
    monkeypatch: pytest.MonkeyPatch,
    constrained: bool,
) -> None:
    calls: list[int] = []
    call = Rewinder.__call__

    def counted(self: Rewinder, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(int(inputs.shape[1]))
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(Rewinder, "__call__", counted)
    fields: dict[str, Any] = {"max_tokens": 40, "sampling": GREEDY}
    if constrained:
        fields |= {"tools": (WEATHER,), "tool_choice": "required", "parallel_tool_calls": False}
    request = ask("lone", **fields)
    expected = _reference(model, request, constrained)
    hybrid, collector = engine
    kind = "c" if constrained else "f"
    run(hybrid, collector, attrs.evolve(request, request_id=f"{kind}-lone"))
    # Alone, it ran on the lone decoder's plain cache.
    assert calls
    assert list(hybrid.stats.recent_tokens[-1][1]) == expected
    for at in (1, 2, 3, 5, 8, 13):
        name, other = f"{kind}{at}", f"{kind}-other{at}"
        joined: list[str] = []

        def join(
            event: Any, at: int = at, name: str = name, other: str = other, joined: Any = joined
        ) -> None:
            # A second request arrives after `at` tokens: the lone one joins the batch.
            if event.request_id == name and not joined and event.usage.completion_tokens >= at:
                joined.append(other)
                hybrid.submit(ask(other, max_tokens=20, sampling=GREEDY))

        collector.on_event = join
        try:
            run(hybrid, collector, attrs.evolve(request, request_id=name))
            collector.wait(other)
        finally:
            collector.on_event = None
        tokens = next(t for rid, t in hybrid.stats.recent_tokens if rid == name)
        assert list(tokens) == expected, at
    assert hybrid.stats.peak_batch_size == 2
