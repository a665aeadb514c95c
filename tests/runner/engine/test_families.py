"""Each model family's built-in random model (runner.demo_families) through the batched mlx
engine: forced tool calls in the family's own syntax, streamed, fitting their schema in every
seeded sample; JSON answers; no markup in content or reasoning; usage exact against mlx-lm
run in-process with the same grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from protocol.frames import Generate, ResponseFormat, SamplingParams, Tool
from runner.demo_families import FAMILIES
from runner.engine.base import Output
from runner.engine.batched import batched_engine
from runner.engine.constraint import constraint_for
from runner.engine.mlx_engine import MlxEngine
from runner.engine.mlx_model import MlxModel
from runner.harmony import MARKERS
from tests.runner.collect import Collector, outputs
from tests.runner.engine.family_cases import SCHEMA, WEATHER, ask

ANSWER: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
SAMPLES = 50

MARKUP = (*MARKERS, "<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]")


class Fleet:
    """One started engine per family, made on first use."""

    def __init__(self) -> None:
        self.engines: dict[str, tuple[MlxEngine, Collector]] = {}

    def __call__(self, family: str) -> tuple[MlxEngine, Collector]:
        if family not in self.engines:
            collector = Collector()
            engine = batched_engine(FAMILIES[family].model_id, max_concurrent=16)
            engine.start(collector)
            self.engines[family] = engine, collector
        return self.engines[family]

    def run(self, family: str, *requests: Generate) -> list[list[Output]]:
        engine, collector = self(family)
        for request in requests:
            engine.submit(request)
        return [outputs(collector.wait(request.request_id)) for request in requests]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    fleet = Fleet()
    yield fleet
    for engine, _ in fleet.engines.values():
        engine.close()


def calls_of(events: list[Output]) -> list[tuple[str, str, int]]:
    """(name, arguments, argument deltas) per call, checking OpenAI's delta order."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for output in events:
        for delta in output.tool_calls:
            if delta.id is not None:
                assert delta.index == len(names), "a call's index out of order"
                assert (delta.name, delta.arguments) != (None, "") or delta.name
                names[delta.index] = delta.name or ""
                arguments[delta.index] = []
            elif delta.arguments:
                assert delta.index in names, "arguments before the call's name"
                arguments[delta.index].append(delta.arguments)
    return [(names[i], "".join(arguments[i]), len(arguments[i])) for i in sorted(names)]


def no_markup(events: list[Output]) -> None:
    for output in events:
        for marker in MARKUP:
            assert marker not in output.text, f"{marker} in content: {output.text!r}"
            assert marker not in output.reasoning, f"{marker} in reasoning: {output.reasoning!r}"


def in_process(
    family: str, request: Generate, max_tokens: int
) -> tuple[MlxModel, list[int], list[int]]:
    """The request through mlx-lm itself (`stream_generate`), greedy, with the same grammar:
    the model, the prompt's tokens and the generated ones."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model = MlxModel.load(FAMILIES[family].model_id)
    prompt = model.prepare(request, 0.0).prompt
    constraint = constraint_for(request, model.tokenizer, vocab_size=model.vocab_size)
    assert constraint is not None
    responses = stream_generate(
        model.model,
        model.tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampler=make_sampler(0.0),
        logits_processors=[constraint.processor()],
    )
    return model, list(prompt), [response.token for response in responses]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forced_call_is_streamed_in_the_familys_syntax_with_exact_usage(
    fleet: Fleet, family: str
) -> None:
    request = ask(
        family,
        f"{family}-forced",
        tools=(WEATHER,),
        tool_choice="required",
        parallel_tool_calls=False,
        sampling=SamplingParams(temperature=0),
    )
    (events,) = fleet.run(family, request)
    no_markup(events)
    last = events[-1]
    assert last.finish_reason == "tool_calls"
    ((name, arguments, pieces),) = calls_of(events)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), SCHEMA)
    assert pieces >= 2, f"arguments came whole: {arguments!r}"
    assert "".join(o.text for o in events).strip() == ""
    # The same request through mlx-lm itself, with the same grammar: the same tokens.
    model, prompt, tokens = in_process(family, request, 200)
    usage = last.usage
    assert usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == len(tokens) == sum(o.tokens for o in events)
    if family == "harmony":
        # Every token of the analysis message, if the model wrote one before its call.
        ids = {marker: model.tokenizer.convert_tokens_to_ids(marker) for marker in MARKERS}
        analysis = tokens.index(ids["<|end|>"]) + 1 if ids["<|end|>"] in tokens else 0
        assert usage.reasoning_tokens == analysis
        assert bool(last.reasoning or any(o.reasoning for o in events)) == (analysis > 0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forced_calls_fit_their_schema_in_every_seeded_sample(fleet: Fleet, family: str) -> None:
    _fit_every_sample(fleet, family, WEATHER, SCHEMA)


NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "where": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["rain", "sun"]}, "minItems": 1},
    },
    "required": ["where", "tags"],
    "additionalProperties": False,
}


def test_gemma4s_nested_arguments_fit_their_schema_in_every_seeded_sample(fleet: Fleet) -> None:
    # Gemma 4 writes nested objects and arrays in its own syntax (bare keys, <|"|> strings).
    nested = Tool("get_weather", "The weather in a city.", json.dumps(NESTED))
    _fit_every_sample(fleet, "gemma4", nested, NESTED)


def _fit_every_sample(fleet: Fleet, family: str, tool: Tool, schema: dict[str, Any]) -> None:
    requests = [
        ask(
            family,
            f"{family}-sample-{seed}-{len(schema['properties'])}",
            tools=(tool,),
            tool_choice="required",
            parallel_tool_calls=False,
            sampling=SamplingParams(temperature=1.0, seed=seed),
        )
        for seed in range(SAMPLES)
    ]
    fitted = 0
    for events in fleet.run(family, *requests):
        no_markup(events)
        calls = calls_of(events)
        assert calls, "no call"
        for name, arguments, _ in calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), schema)
        fitted += 1
    assert fitted == SAMPLES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_json_answer_follows_its_schema_in_every_family(fleet: Fleet, family: str) -> None:
    fmt = ResponseFormat("json_schema", json.dumps(ANSWER), "answer", strict=True)
    requests = [
        ask(
            family,
            f"{family}-json-{seed}",
            response_format=fmt,
            sampling=SamplingParams(temperature=1.0, seed=seed),
        )
        for seed in range(8)
    ]
    for events in fleet.run(family, *requests):
        no_markup(events)
        assert events[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(o.text for o in events)), ANSWER)


def test_harmonys_analysis_is_reasoning_counted_token_by_token(fleet: Fleet) -> None:
    # At temperature 0 the Harmony model reasons before its JSON answer, up to the grammar's
    # bound at low effort; every token of the analysis message is a reasoning token.
    fmt = ResponseFormat("json_schema", json.dumps(ANSWER), "answer", strict=True)
    request = ask(
        "harmony",
        "harmony-analysis",
        response_format=fmt,
        max_tokens=400,
        sampling=SamplingParams(temperature=0),
    )
    (events,) = fleet.run("harmony", request)
    no_markup(events)
    reasoning = "".join(o.reasoning for o in events)
    assert reasoning.strip()
    jsonschema.validate(json.loads("".join(o.text for o in events)), ANSWER)
    model, _, tokens = in_process("harmony", request, 400)
    end = model.tokenizer.convert_tokens_to_ids("<|end|>")
    usage = events[-1].usage
    # The analysis message: from the answer's first token through its <|end|>.
    assert usage.reasoning_tokens == tokens.index(end) + 1
    assert usage.completion_tokens == len(tokens)
    thought = tokens[
        tokens.index(model.tokenizer.convert_tokens_to_ids("<|message|>")) + 1 : tokens.index(end)
    ]
    assert reasoning == model.tokenizer.decode(thought)


REUSES_PROMPTS = [family for family in FAMILIES if family not in ("harmony", "lfm2", "gemma4")]
"""Families whose caches mlx-lm can trim to a prefix (sliding windows and LFM2's convolutions
cannot be: docs/models.md)."""


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forced_call_cancelled_mid_way_then_the_same_prompt_again(
    fleet: Fleet, family: str
) -> None:
    engine, collector = fleet(family)
    # Parallel calls allowed: the random model calls on and on until it is cancelled.
    long = ask(
        family,
        f"{family}-cancel",
        tools=(WEATHER,),
        tool_choice="required",
        max_tokens=400,
        sampling=SamplingParams(temperature=0),
    )
    seen: list[int] = []

    def on_event(event: Any) -> None:
        if isinstance(event, Output) and event.request_id == long.request_id:
            seen.append(event.usage.completion_tokens)
            if len(seen) == 6:
                engine.cancel(long.request_id)

    collector.on_event = on_event
    try:
        engine.submit(long)
        events = outputs(collector.wait(long.request_id))
    finally:
        collector.on_event = None
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].usage.completion_tokens == seen[5] == sum(o.tokens for o in events)
    no_markup(events)
    # The same prompt again, forced to one call: it fits its schema, and where the family's
    # cache can be cut back, all of its prompt but the last token came from the cancelled
    # request's cache (the others reuse at most what lies inside their window, not checked).
    again = ask(
        family,
        f"{family}-again",
        tools=(WEATHER,),
        tool_choice="required",
        parallel_tool_calls=False,
        sampling=SamplingParams(temperature=0),
    )
    (events,) = fleet.run(family, again)
    ((name, arguments, _),) = calls_of(events)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), SCHEMA)
    usage = events[-1].usage
    if family in REUSES_PROMPTS:
        assert usage.cached_tokens == usage.prompt_tokens - 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_lone_forced_call_handed_to_the_batch_writes_what_it_writes_alone(
    fleet: Fleet, family: str
) -> None:
    # A second request arrives after `at` tokens of the first, which ran alone: it joins the
    # batch with its cache, or, where its sliding window has passed its size (Harmony's and
    # Gemma 4's caches cannot go back a token there), goes on alone beside it.
    def forced(request_id: str) -> Generate:
        return ask(
            family,
            request_id,
            tools=(WEATHER,),
            tool_choice="required",
            parallel_tool_calls=False,
            sampling=SamplingParams(temperature=0),
        )

    engine, collector = fleet(family)
    (alone,) = fleet.run(family, forced(f"{family}-alone"))
    made = dict(engine.stats.recent_tokens)
    expected = list(made[f"{family}-alone"])
    for at in (1, 2, 3, 5, 8, 13):
        name = f"{family}-at{at}"
        joined: list[str] = []

        def join(event: Any, at: int = at, name: str = name, joined: list[str] = joined) -> None:
            if event.request_id == name and not joined and event.usage.completion_tokens >= at:
                joined.append(f"{name}-other")
                engine.submit(ask(family, joined[0], "Will it rain in London this week?"))

        collector.on_event = join
        try:
            (events,) = fleet.run(family, forced(name))
            if joined:
                collector.wait(joined[0])
        finally:
            collector.on_event = None
        assert list(dict(engine.stats.recent_tokens)[name]) == expected, at
        assert calls_of(events) == calls_of(alone), at
