"""A runner's sampling defaults for a model (`orchard runner --temp/--top-p/--top-k/--min-p`):
they replace exactly what the client left out (`SamplingParams.unset`), at the one place every
engine prepares a request, and the hello's ModelInfo says what they are."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol.frames import DEFAULTABLE, ModelInfo, SamplingDefaults, SamplingParams
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import Engine
from runner.engine.mlx_engine import MlxEngine, engine_version
from runner.engine.mlx_model import MlxModel
from runner.engine.model_info import with_options
from runner.engine.sampling import with_defaults
from runner.model_options import ModelOptions
from tests.runner.collect import Collector, engine_starter, final, run, text_of
from tests.runner.engines import GREEDY, MLX_ENGINES, Reference, ask

DEFAULTS = SamplingDefaults(temperature=0.3, top_k=1, min_p=0.05, max_tokens=7)


# with_defaults, on its own.


def test_each_unset_parameter_takes_the_default_the_model_has() -> None:
    params = SamplingParams(seed=3, unset=DEFAULTABLE)
    assert with_defaults(params, DEFAULTS) == SamplingParams(
        temperature=0.3, top_p=1.0, top_k=1, min_p=0.05, seed=3, unset=("top_p",)
    )


def test_what_the_client_set_wins() -> None:
    params = SamplingParams(temperature=1.0, top_k=0, unset=("top_p", "min_p"))
    assert with_defaults(params, DEFAULTS) == SamplingParams(
        temperature=1.0, top_k=0, min_p=0.05, unset=("top_p",)
    )


def test_a_default_of_zero_or_off_replaces_a_dialects_own() -> None:
    ollama = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, unset=DEFAULTABLE)
    off = SamplingDefaults(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    assert with_defaults(ollama, off) == SamplingParams(0.0, 1.0, 0, 0.0)


def test_nothing_to_apply_gives_the_same_params_back() -> None:
    everything_set = SamplingParams(temperature=0.7, top_k=5)
    assert with_defaults(everything_set, DEFAULTS) is everything_set
    unset = SamplingParams(unset=DEFAULTABLE)
    assert with_defaults(unset, SamplingDefaults()) is unset
    assert with_defaults(unset, SamplingDefaults(max_tokens=9)) is unset
    # Applying twice is applying once.
    once = with_defaults(unset, DEFAULTS)
    assert with_defaults(once, DEFAULTS) is once


# MlxModel.prepare: where every engine path (solo, interleaved, batched, group) takes them.


@pytest.fixture(scope="module")
def model(demo_model_path: Path) -> MlxModel:
    return MlxModel.load(DEMO_MODEL_ID)


@pytest.fixture
def with_model_defaults(model: MlxModel) -> Iterator[MlxModel]:
    plain = model.options
    model.options = ModelOptions(sampling=DEFAULTS)
    try:
        yield model
    finally:
        model.options = plain


def test_prepare_applies_the_models_defaults(with_model_defaults: MlxModel) -> None:
    request = with_model_defaults.prepare(ask("a", sampling=SamplingParams(unset=DEFAULTABLE)), 0)
    assert request.generate.sampling == SamplingParams(
        temperature=0.3, top_k=1, min_p=0.05, unset=("top_p",)
    )
    assert request.max_tokens == 7  # --max-tokens, as before


def test_prepare_keeps_what_the_client_set(with_model_defaults: MlxModel) -> None:
    given = ask("b", max_tokens=3, sampling=SamplingParams(top_k=0, unset=("temperature",)))
    request = with_model_defaults.prepare(given, 0)
    assert request.generate.sampling == SamplingParams(temperature=0.3, top_k=0)
    assert request.max_tokens == 3
    explicit = ask("c", sampling=SamplingParams(temperature=1.0))
    assert with_model_defaults.prepare(explicit, 0).generate is explicit


def test_without_defaults_prepare_changes_nothing(model: MlxModel) -> None:
    assert model.options == ModelOptions()
    unset = ask("d", sampling=SamplingParams(unset=DEFAULTABLE))
    assert model.prepare(unset, 0).generate is unset


def test_every_choice_gets_the_defaults(with_model_defaults: MlxModel) -> None:
    given = ask("e", n=3, sampling=SamplingParams(seed=11, unset=("top_k",)))
    choices = with_model_defaults.prepare_choices(given, 0)
    assert [c.generate.sampling.top_k for c in choices] == [1, 1, 1]
    assert [c.generate.sampling.unset for c in choices] == [(), (), ()]
    assert len({c.generate.sampling.seed for c in choices}) == 3


# The engines: the hello's ModelInfo, and a default that changes what is generated.


def test_model_info_carries_the_options() -> None:
    info = ModelInfo("m", 8, "mlx")
    assert with_options(info, ModelOptions()) == info
    options = ModelOptions(
        sampling=SamplingDefaults(top_p=0.5), draft_model="d", kv_bits=4, adapter_path="/a"
    )
    assert with_options(info, options) == ModelInfo(
        "m",
        8,
        "mlx",
        defaults=SamplingDefaults(top_p=0.5),
        draft_model="d",
        kv_bits=4,
        adapter="/a",
    )


@pytest.fixture(params=sorted(MLX_ENGINES))
def top_k_one(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Collector]]:
    """Each mlx engine, on a model whose default top_k is 1."""
    options = ModelOptions(sampling=SamplingDefaults(top_k=1))
    with engine_starter(MLX_ENGINES[request.param]) as start:
        yield start(model=DEMO_MODEL_ID, options=options)


def test_a_default_top_k_of_one_makes_a_default_request_greedy(
    top_k_one: tuple[Engine, Collector], reference: Reference
) -> None:
    engine, collector = top_k_one
    assert isinstance(engine, MlxEngine)
    (info,) = engine.models
    assert info == ModelInfo(
        DEMO_MODEL_ID,
        info.context_length,
        engine_version(),
        size_bytes=engine.weights_bytes,
        defaults=SamplingDefaults(top_k=1),
    )
    prompt = "Tell me about apples."
    tokens, texts = reference.greedy(ask("g", prompt, max_tokens=12, sampling=GREEDY))
    # Temperature 1, unseeded: with the default top_k of 1 only the likeliest token is left.
    unset = SamplingParams(unset=DEFAULTABLE)
    events = run(engine, collector, ask("u", prompt, max_tokens=12, sampling=unset))
    assert text_of(events) == "".join(texts)
    assert final(events).usage.completion_tokens == len(tokens)
    # A top_k the client set (0: off) is not replaced: seeded, it leaves the greedy path.
    own = SamplingParams(top_k=0, seed=1, unset=("temperature", "top_p", "min_p"))
    sampled = run(engine, collector, ask("s", prompt, max_tokens=12, sampling=own))
    assert text_of(sampled) != "".join(texts)
