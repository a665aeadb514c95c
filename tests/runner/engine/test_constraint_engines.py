"""Constrained decoding in both mlx engines on the demo model: JSON that validates and stops,
alongside other rows, joining a running batch, cancelled with the prefix cache kept, forced
tool calls, and any schema in the supported subset."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools

from protocol.frames import Generate, LogitBias, ResponseFormat, SamplingParams, Tool
from runner.demo_model import DEMO_MODEL_ID
from runner.engine import masking
from runner.engine.base import Failure, Output
from runner.engine.batched import Batched, batched_engine
from runner.engine.constraint import NO_PARAMETERS
from runner.engine.masking import BatchConstraints
from runner.engine.mlx_engine import MlxEngine
from tests.runner.collect import (
    Collector,
    SharedEngine,
    engine_starter,
    final,
    hold,
    outputs,
    run,
    shared_engine,
    text_of,
)
from tests.runner.engine.constraint_cases import NOW, SMALL, WEATHER, compile_for, schema_format
from tests.runner.engines import GREEDY, MLX_ENGINES, MakeMlxEngine, Reference, ask

FREE_STRINGS = pytest.mark.usefixtures("closes_free_strings")
"""Tests of output with free strings: they need a demo model trained to close them."""


@pytest.fixture(scope="module")
def closes_free_strings(reference: Reference) -> None:
    """The built-in model, constrained to any JSON object, closes it by itself within 96
    tokens, as a real model does (a model with random weights would write its first string
    forever; runner.demo_shaping is what makes this hold)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    constraint = compile_for(reference.tokenizer, response_format=ResponseFormat("json_object"))
    responses = list(
        stream_generate(
            reference.model,
            reference.tokenizer,
            reference.prompt(ask("probe", "An orchard, as JSON.")),
            max_tokens=96,
            sampler=make_sampler(0.0),
            logits_processors=[constraint.processor()],
        )
    )
    assert responses, "no output"
    assert responses[-1].finish_reason == "stop", "the built-in model never closed the JSON"


# Both engines, on the demo model.

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
    """The module's engine of this kind, for a test that needs no options."""
    with shared.borrow() as lent:
        yield lent


@pytest.fixture
def start_engine(make_engine: MakeMlxEngine, demo_model_path: Path) -> Iterator[StartEngine]:
    """Engines of this kind of the test's own."""
    with engine_starter(lambda **options: make_engine(DEMO_MODEL_ID, **options)) as start:
        yield start


def _closing_brace(reference: Reference) -> LogitBias:
    """A bias that makes any model close a JSON object as soon as it may."""
    (brace,) = reference.tokenizer.encode("}", add_special_tokens=False)
    return LogitBias(brace, 100.0)


def test_json_schema_output_validates_and_stops(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    request = ask("r1", max_tokens=200, sampling=GREEDY, response_format=schema_format(SMALL))
    events = run(engine, collector, request)
    jsonschema.validate(json.loads(text_of(events)), SMALL)
    last = final(events)
    assert last.finish_reason == "stop"
    assert last.usage.completion_tokens == len(engine.stats.recent_tokens[-1][1])


def test_logit_bias_cannot_escape_the_mask(
    lent: tuple[MlxEngine, Collector], reference: Reference
) -> None:
    engine, collector = lent
    (bracket,) = reference.tokenizer.encode("[", add_special_tokens=False)
    sampling = SamplingParams(
        temperature=0, logit_bias=(LogitBias(bracket, 100.0), _closing_brace(reference))
    )
    request = ask(
        "r1", max_tokens=50, sampling=sampling, response_format=ResponseFormat("json_object")
    )
    events = run(engine, collector, request)
    assert text_of(events) == "{}"
    assert final(events).finish_reason == "stop"


@pytest.mark.parametrize("parallel", [False, True], ids=["masks-in-turn", "masks-on-pool"])
def test_rows_with_different_grammars_and_none_share_a_batch(
    start_engine: StartEngine,
    reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
    parallel: bool,
) -> None:
    # llguidance's thread pool computes a batch's masks on machines with 4 cores or more.
    monkeypatch.setattr(masking, "_PARALLEL_MASKS", parallel)
    steps: list[int] = []
    mask = BatchConstraints.mask

    def counted(self: BatchConstraints, uids: list[int], inputs: Any, logits: Any) -> Any:
        steps.append(sum(uid in self._rows for uid in uids))
        return mask(self, uids, inputs, logits)

    monkeypatch.setattr(BatchConstraints, "mask", counted)
    engine, collector = start_engine(max_concurrent=8)
    other: dict[str, Any] = {
        "type": "object",
        "properties": {
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
            "kind": {"const": "orchard"},
            "size": {"anyOf": [{"type": "null"}, {"enum": [1, 2, 3]}]},
        },
        "required": ["flags", "kind", "size"],
        "additionalProperties": False,
    }
    requests = {
        "small": (
            ask(
                "small",
                "Apples?",
                max_tokens=200,
                sampling=GREEDY,
                response_format=schema_format(SMALL),
            ),
            SMALL,
        ),
        "other": (
            ask(
                "other",
                "Pears?",
                max_tokens=200,
                sampling=GREEDY,
                response_format=schema_format(other),
            ),
            other,
        ),
        "sampled": (
            ask(
                "sampled",
                "Plums?",
                max_tokens=200,
                sampling=SamplingParams(temperature=1.0),
                response_format=schema_format(SMALL),
            ),
            SMALL,
        ),
        "object": (
            ask(
                "object",
                "Figs?",
                max_tokens=50,
                sampling=SamplingParams(temperature=0, logit_bias=(_closing_brace(reference),)),
                response_format=ResponseFormat("json_object"),
            ),
            {"type": "object"},
        ),
    }
    free = ask("free", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    gate = hold(engine, collector, ask("gate", max_tokens=1, sampling=GREEDY))
    for request, _ in requests.values():
        engine.submit(request)
    engine.submit(free)
    gate.set()
    for name, (_, schema) in requests.items():
        events = collector.wait(name)
        jsonschema.validate(json.loads(text_of(events)), schema)
        assert final(events).finish_reason == "stop", name
    # The unconstrained row decodes exactly as it would alone.
    assert [o.text for o in outputs(collector.wait("free"))] == reference.greedy(free)[1]
    if isinstance(engine.strategy, Batched):
        assert engine.stats.peak_batch_size == 5
        # The constrained rows were masked together, once a step, in the batch's model call.
        assert max(steps) == 4


def test_constrained_rows_join_a_running_batch(start_engine: StartEngine) -> None:
    engine, collector = start_engine(max_concurrent=8)
    crates = {
        "type": "object",
        "properties": {
            "crates": {
                "type": "array",
                "items": {"type": "boolean"},
                "minItems": 40,
                "maxItems": 44,
            },
            "done": {"const": True},
        },
        "required": ["crates", "done"],
        "additionalProperties": False,
    }
    first = ask(
        "first", "Crates?", max_tokens=400, sampling=GREEDY, response_format=schema_format(crates)
    )
    joiners = [
        ask(
            "small",
            "Apples?",
            max_tokens=200,
            sampling=GREEDY,
            response_format=schema_format(SMALL),
        ),
        ask("free", "Pears?", max_tokens=30, sampling=GREEDY),
        ask(
            "crates",
            "More?",
            max_tokens=400,
            sampling=GREEDY,
            response_format=schema_format(crates),
        ),
    ]
    joined: list[str] = []

    def join(event: Any) -> None:
        # Each joiner arrives while the rows before it are decoding.
        if isinstance(event, Output) and event.usage.completion_tokens == 3 and joiners:
            request = joiners.pop(0)
            joined.append(request.request_id)
            engine.submit(request)

    collector.on_event = join
    engine.submit(first)
    for name, schema in (("first", crates), ("small", SMALL), ("crates", crates)):
        events = collector.wait(name)
        jsonschema.validate(json.loads(text_of(events)), schema)
        assert final(events).finish_reason == "stop"
    assert final(collector.wait("free")).usage.completion_tokens == 30
    assert joined == ["small", "free", "crates"]


def test_cancel_mid_constraint_keeps_the_cache(
    lent: tuple[MlxEngine, Collector], reference: Reference
) -> None:
    engine, collector = lent
    # Any object: the demo model's strings may run on; it is cancelled after a few tokens.
    request = ask(
        "long",
        "Orchards?",
        max_tokens=1500,
        sampling=GREEDY,
        response_format=ResponseFormat("json_object"),
    )
    started: list[int] = []

    def on_event(event: Any) -> None:
        if isinstance(event, Output) and event.request_id == "long":
            started.append(event.usage.completion_tokens)
            if len(started) == 5:
                engine.cancel("long")

    collector.on_event = on_event
    engine.submit(request)
    events = collector.wait("long")
    last = final(events)
    assert last.finish_reason == "cancelled"
    # The cancel lands between two steps: nothing is generated after the fifth output.
    assert last.usage.completion_tokens == started[4] == sum(o.tokens for o in outputs(events))
    assert text_of(events).startswith("{")
    collector.on_event = None
    # The next request on the same prompt starts from the cancelled one's KV cache.
    again = ask(
        "again", "Orchards?", max_tokens=200, sampling=GREEDY, response_format=schema_format(SMALL)
    )
    events = run(engine, collector, again)
    # All of the prompt but its last token, whose logits start the answer.
    assert final(events).usage.cached_tokens == len(reference.prompt(again)) - 1
    jsonschema.validate(json.loads(text_of(events)), SMALL)


def test_a_schema_that_cannot_be_enforced_fails_at_intake(
    lent: tuple[MlxEngine, Collector],
) -> None:
    engine, collector = lent
    fmt = schema_format({"type": "object", "if": {"required": ["a"]}, "then": {}})
    (event,) = run(engine, collector, ask("r1", response_format=fmt))
    assert event == Failure(
        "r1",
        "invalid_request",
        "response_format.json_schema.schema: this schema cannot be enforced: Unimplemented "
        'keys: ["if", "then"]',
        "response_format",
    )


@FREE_STRINGS
def test_json_object_with_free_strings_closes(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    request = ask(
        "r1", max_tokens=300, sampling=GREEDY, response_format=ResponseFormat("json_object")
    )
    events = run(engine, collector, request)
    assert isinstance(json.loads(text_of(events)), dict)
    assert final(events).finish_reason == "stop"


COUNT = Tool(
    "count",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": 9},
                "unit": {"enum": ["crates", "trees"]},
            },
            "required": ["n", "unit"],
            "additionalProperties": False,
        }
    ),
)
"""Bounded arguments: any model finishes the call in a few tokens."""


def test_forced_tool_calls_with_bounded_arguments(
    lent: tuple[MlxEngine, Collector], reference: Reference
) -> None:
    assert reference.tokenizer.tool_parser.__module__ == json_tools.__name__
    engine, collector = lent
    for choice, name in (("function", "count"), ("required", None)):
        request = ask(
            f"r-{choice}",
            max_tokens=200,
            sampling=GREEDY,
            tools=(NOW, COUNT),
            tool_choice=choice,
            tool_name=name,
            parallel_tool_calls=False,
        )
        events = run(engine, collector, request)
        assert final(events).finish_reason == "tool_calls"
        deltas = [delta for o in outputs(events) for delta in o.tool_calls]
        assert {delta.index for delta in deltas} == {0}
        (called,) = [delta.name for delta in deltas if delta.name is not None]
        arguments = json.loads("".join(delta.arguments for delta in deltas))
        if choice == "function":
            assert called == "count"
        tool = {"now": NOW, "count": COUNT}[called]
        jsonschema.validate(arguments, json.loads(tool.parameters or json.dumps(NO_PARAMETERS)))
        assert text_of(events) == ""


@FREE_STRINGS
def test_forced_tool_calls_come_out_as_tool_calls(lent: tuple[MlxEngine, Collector]) -> None:
    engine, collector = lent
    for choice, name in (("function", "weather"), ("required", None)):
        request = ask(
            f"r-{choice}",
            max_tokens=300,
            sampling=GREEDY,
            tools=(NOW, WEATHER),
            tool_choice=choice,
            tool_name=name,
            parallel_tool_calls=False,
        )
        events = run(engine, collector, request)
        last = final(events)
        assert last.finish_reason == "tool_calls"
        deltas = [delta for o in outputs(events) for delta in o.tool_calls]
        assert {delta.index for delta in deltas} == {0}
        (called,) = [delta.name for delta in deltas if delta.name is not None]
        arguments = json.loads("".join(delta.arguments for delta in deltas))
        tool = {"now": NOW, "weather": WEATHER}[called]
        assert tool is WEATHER or choice == "required"
        jsonschema.validate(arguments, json.loads(tool.parameters or json.dumps(NO_PARAMETERS)))


# Any schema in the supported subset: the output always validates.


def _schemas(strings: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """JSON Schemas of objects, nested, over the given string schemas and bounded scalars."""
    scalars = st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.integers(-50, 50).map(
            lambda low: {"type": "integer", "minimum": low, "maximum": low + 30}
        ),
        st.lists(
            st.sampled_from(["a", "b", "cherry", 1, 2.5, True, None]),
            min_size=1,
            max_size=4,
            unique=True,
        ).map(lambda values: {"enum": values}),
        st.sampled_from(["x", 7, False]).map(lambda value: {"const": value}),
        strings,
    )

    def extend(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        objects = st.dictionaries(
            st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, min_size=1, max_size=4
        ).flatmap(
            lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
                lambda required: {
                    "type": "object",
                    "properties": properties,
                    "required": required,
                    "additionalProperties": False,
                }
            )
        )
        arrays = st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
        )
        unions = st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
        return st.one_of(objects, arrays, unions)

    tree = st.recursive(scalars, extend, max_leaves=8)
    return st.dictionaries(
        st.from_regex(r"[a-z]{1,6}", fullmatch=True), tree, min_size=1, max_size=4
    ).map(
        lambda properties: {
            "type": "object",
            "properties": properties,
            "required": sorted(properties),
            "additionalProperties": False,
        }
    )


BOUNDED_STRINGS = st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n})
FREE = st.one_of(
    st.just({"type": "string"}),
    st.just({"type": "array", "items": {"type": "string"}, "maxItems": 3}),
)
"""Free strings (what the v2 demo model is trained to close); everything else stays bounded."""


@pytest.fixture(scope="module")
def batched(demo_model_path: Path) -> Iterator[tuple[MlxEngine, Collector]]:
    with engine_starter(lambda: batched_engine(DEMO_MODEL_ID)) as start:
        yield start()


_ids = itertools.count()


def _generated_validates(
    engine: MlxEngine, collector: Collector, schema: dict[str, Any], seed: int
) -> None:
    request = Generate(
        f"h{next(_ids)}",
        DEMO_MODEL_ID,
        ask("x", f"Item {seed}").messages,
        max_tokens=400,
        sampling=SamplingParams(temperature=1.0),
        response_format=schema_format(schema),
    )
    events = run(engine, collector, request)
    assert final(events).finish_reason == "stop", text_of(events)
    jsonschema.validate(json.loads(text_of(events)), schema)


@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas(BOUNDED_STRINGS), seed=st.integers(0, 10**6))
def test_any_bounded_schema_produces_output_that_validates(
    batched: tuple[MlxEngine, Collector], schema: dict[str, Any], seed: int
) -> None:
    _generated_validates(*batched, schema, seed)


@FREE_STRINGS
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas(FREE), seed=st.integers(0, 10**6))
def test_any_schema_produces_output_that_validates(
    batched: tuple[MlxEngine, Collector], schema: dict[str, Any], seed: int
) -> None:
    _generated_validates(*batched, schema, seed)
