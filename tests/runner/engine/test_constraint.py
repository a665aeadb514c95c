"""Constrained decoding (runner.engine.constraint) on the demo model's real tokenizer: the
grammars a request asks for, the logits processor token by token, and both mlx engines
producing JSON that validates, alongside other rows, cancelled, and with the prefix cache."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools, longcat

from protocol.frames import Generate, LogitBias, ResponseFormat, SamplingParams, Tool
from runner.demo_model import DEMO_MODEL_ID
from runner.engine import constraint as constraint_module
from runner.engine.base import Failure, Output
from runner.engine.batched import Batched, batched_engine
from runner.engine.constraint import (
    NO_PARAMETERS,
    BatchConstraints,
    Constraint,
    ConstraintProcessor,
    apply_bitmask,
    constraint_for,
)
from runner.engine.mlx_engine import MlxEngine
from runner.errors import RequestError
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
from tests.runner.engines import GREEDY, MLX_ENGINES, MakeMlxEngine, Reference, ask

FREE_STRINGS = pytest.mark.usefixtures("closes_free_strings")
"""Tests of output with free strings: they need a demo model trained to close them."""

WEATHER = Tool(
    "weather",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    ),
)
NOW = Tool("now")
"""No parameters: its arguments are `{}`."""

SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "color"],
    "additionalProperties": False,
}
"""A schema whose every value is bounded: any model finishes it in a few tokens."""


def schema_format(schema: dict[str, Any]) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema), "answer", strict=True)


def call(name: str, arguments: dict[str, Any]) -> str:
    """One call in the json_tools (Hermes, Qwen) format."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(reference: Reference) -> Any:
    """The demo model's mlx-lm tokenizer."""
    return reference.tokenizer


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer: Any) -> Any:
    """The demo tokenizer with mlx-lm's json_tools tool-call format (v2 has it already)."""
    if getattr(tokenizer.tool_parser, "__module__", None) == json_tools.__name__:
        return tokenizer
    return TokenizerWrapper(
        tokenizer._tokenizer,
        eos_token_ids=tokenizer.eos_token_ids,
        tool_call_start=json_tools.tool_call_start,
        tool_call_end=json_tools.tool_call_end,
        tool_parser=json_tools.parse_tool_call,
    )


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


def compile_for(tokenizer: Any, **fields: Any) -> Constraint:
    constraint = constraint_for(ask("r", **fields), tokenizer)
    assert constraint is not None
    return constraint


def allowed(processor: ConstraintProcessor, context: list[int], vocab: int) -> set[int]:
    """The token ids the processor leaves open after `context` (the last one just sampled)."""
    masked = processor(mx.array(context), mx.zeros((1, vocab)))
    return {int(i) for i in np.flatnonzero(np.array(masked[0]) > -np.inf)}


def accepts(constraint: Constraint, tokenizer: Any, text: str) -> bool:
    """Whether the processor lets a model write `text` (tokenized as the tokenizer does), then
    end."""
    processor = constraint.processor()
    vocab = len(tokenizer)
    context = [7, 8, 9]  # a prompt
    for token in tokenizer.encode(text, add_special_tokens=False):
        if token not in allowed(processor, context, vocab):
            return False
        context.append(token)
    return bool(allowed(processor, context, vocab) & set(tokenizer.eos_token_ids))


# The grammars.


def test_free_text_has_no_constraint(tokenizer: Any) -> None:
    assert constraint_for(ask("r"), tokenizer) is None
    assert constraint_for(ask("r", response_format=ResponseFormat("text")), tokenizer) is None
    for choice in ("auto", "none"):
        assert constraint_for(ask("r", tools=(WEATHER,), tool_choice=choice), tokenizer) is None
    # Without tools, tool_choice means nothing (the gateway refuses it; here it is ignored).
    assert constraint_for(ask("r", tool_choice="required"), tokenizer) is None


def test_json_object_is_any_object_written_compactly(tokenizer: Any) -> None:
    constraint = compile_for(tokenizer, response_format=ResponseFormat("json_object"))
    assert accepts(constraint, tokenizer, '{"a": [1, "x", {"b": null}], "c": true}')
    assert accepts(constraint, tokenizer, "{}")
    for wrong in ("[1, 2]", '"text"', '{"a":1}', '{ "a": 1}', '{"a": 1}\n', '{"a": 1'):
        assert not accepts(constraint, tokenizer, wrong), wrong


def test_json_schema_is_enforced(tokenizer: Any) -> None:
    constraint = compile_for(tokenizer, response_format=schema_format(SMALL))
    assert accepts(constraint, tokenizer, '{"ok": true, "n": 42, "color": "red"}')
    for wrong in (
        '{"ok": true, "n": 100, "color": "red"}',
        '{"ok": true, "n": 4, "color": "pink"}',
        '{"ok": true, "n": 4}',
        '{"ok": 1, "n": 4, "color": "red"}',
        '{"ok": true, "n": 4, "color": "red", "x": 1}',
    ):
        assert not accepts(constraint, tokenizer, wrong), wrong


def test_schemas_with_references_and_recursion(tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "required": ["root"],
        "additionalProperties": False,
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
    }
    constraint = compile_for(tokenizer, response_format=schema_format(schema))
    tree = {"root": {"v": 1, "kids": [{"v": None, "kids": [{"v": 3, "kids": []}]}]}}
    assert accepts(constraint, tokenizer, json.dumps(tree))
    assert not accepts(constraint, tokenizer, json.dumps({"root": {"v": 1, "kids": [1]}}))


def test_tool_choice_function_is_one_call_of_that_function(tools_tokenizer: Any) -> None:
    constraint = compile_for(
        tools_tokenizer, tools=(NOW, WEATHER), tool_choice="function", tool_name="weather"
    )
    one = call("weather", {"city": "Oslo", "days": 3})
    assert accepts(constraint, tools_tokenizer, one)
    assert not accepts(constraint, tools_tokenizer, call("now", {}))
    assert not accepts(constraint, tools_tokenizer, call("weather", {"city": "Oslo"}))
    assert not accepts(constraint, tools_tokenizer, f"{one}\n{one}")
    assert not accepts(constraint, tools_tokenizer, "It is sunny.")


def test_tool_choice_required_is_calls_of_any_tool_each_with_its_schema(
    tools_tokenizer: Any,
) -> None:
    constraint = compile_for(tools_tokenizer, tools=(NOW, WEATHER), tool_choice="required")
    weather, now = call("weather", {"city": "Oslo", "days": 3}), call("now", {})
    assert accepts(constraint, tools_tokenizer, now)
    assert accepts(constraint, tools_tokenizer, f"{weather}\n{now}\n{weather}")
    assert not accepts(constraint, tools_tokenizer, call("now", {"city": "Oslo"}))
    assert not accepts(constraint, tools_tokenizer, call("sleep", {}))
    assert not accepts(constraint, tools_tokenizer, "")
    single = compile_for(
        tools_tokenizer, tools=(NOW, WEATHER), tool_choice="required", parallel_tool_calls=False
    )
    assert accepts(single, tools_tokenizer, weather)
    assert not accepts(single, tools_tokenizer, f"{weather}\n{now}")


def test_tools_win_over_the_response_format_unless_the_choice_is_auto(
    tools_tokenizer: Any,
) -> None:
    weather, body = (
        call("weather", {"city": "Oslo", "days": 3}),
        '{"ok": false, "n": 0, "color": "blue"}',
    )
    fmt = schema_format(SMALL)
    forced = compile_for(
        tools_tokenizer, tools=(WEATHER,), tool_choice="required", response_format=fmt
    )
    assert accepts(forced, tools_tokenizer, weather)
    assert not accepts(forced, tools_tokenizer, body)
    either = compile_for(tools_tokenizer, tools=(WEATHER,), response_format=fmt)
    assert accepts(either, tools_tokenizer, weather)
    assert accepts(either, tools_tokenizer, body)
    # "none": the model is not told about tools; only the format.
    neither = compile_for(
        tools_tokenizer, tools=(WEATHER,), tool_choice="none", response_format=fmt
    )
    assert not accepts(neither, tools_tokenizer, weather)
    assert accepts(neither, tools_tokenizer, body)


def test_forced_calls_need_a_format_with_a_grammar(tokenizer: Any, tools_tokenizer: Any) -> None:
    # LongCat's format is read whole by mlx-lm's parser, and has no grammar here.
    longcat_tokenizer = TokenizerWrapper(
        tools_tokenizer._tokenizer,
        eos_token_ids=tools_tokenizer.eos_token_ids,
        tool_call_start=longcat.tool_call_start,
        tool_call_end=longcat.tool_call_end,
        tool_parser=longcat.parse_tool_call,
    )
    for choice in ("required", "function"):
        request = ask("r", tools=(WEATHER,), tool_choice=choice, tool_name="weather")
        with pytest.raises(RequestError) as raised:
            constraint_for(request, longcat_tokenizer)
        assert raised.value.code == "invalid_request"
        assert raised.value.param == "tool_choice"
        assert str(raised.value) == (
            f'tool_choice "{choice}" is not supported for this model\'s tool-call format '
            "(longcat): calls can be enforced in these formats: json_tools, qwen3_coder, "
            "minimax_m2, glm47, kimi_k2, mistral, pythonic, gemma4."
        )
    request = ask("r", tools=(WEATHER,), response_format=ResponseFormat("json_object"))
    with pytest.raises(RequestError, match="A JSON response_format with tools is not supported"):
        constraint_for(request, longcat_tokenizer)


def test_what_cannot_be_enforced_is_named_with_its_place(tools_tokenizer: Any) -> None:
    def refusal(**fields: Any) -> RequestError:
        with pytest.raises(RequestError) as raised:
            constraint_for(ask("r", **fields), tools_tokenizer)
        assert raised.value.code == "invalid_request"
        return raised.value

    error = refusal(response_format=schema_format({"type": "object", "not": {"required": ["a"]}}))
    assert str(error) == (
        "response_format.json_schema.schema: this schema cannot be enforced: Unimplemented keys: "
        '["not"]'
    )
    assert error.param == "response_format"
    unique = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    bad_tool = Tool(
        "ids", parameters=json.dumps({"type": "object", "properties": {"x": json.loads(unique)}})
    )
    error = refusal(tools=(WEATHER, bad_tool), tool_choice="required")
    assert str(error).startswith("tools[1].function.parameters: this schema cannot be enforced:")
    assert "uniqueItems" in str(error)
    assert error.param == "tools"
    lookahead = {"type": "string", "pattern": "^(?=.*[0-9]).+$"}
    error = refusal(
        response_format=schema_format({"type": "object", "properties": {"p": lookahead}})
    )
    assert "look-around" in str(error)
    error = refusal(response_format=ResponseFormat("json_schema", "{not json"))
    assert str(error).startswith("response_format.json_schema.schema: not valid JSON:")
    error = refusal(response_format=ResponseFormat("json_schema", "[1]"))
    assert str(error) == "response_format.json_schema.schema: must be a JSON object."
    error = refusal(tools=(WEATHER,), tool_choice="function", tool_name="sleep")
    assert str(error) == (
        "tool_choice names the function 'sleep', which is not among the request's tools."
    )
    assert error.param == "tool_choice"


def test_compiled_grammars_are_cached_least_recently_used_first_out(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constraint_module, "CACHE_SIZE", 2)

    def compiled(n: int) -> Any:
        schema = {"type": "object", "properties": {f"p{n}": {"type": "integer"}}}
        # The matcher itself: the same object when it came from the cache.
        return compile_for(tokenizer, response_format=schema_format(schema))._matcher

    first = compiled(1)
    assert compiled(1) is first
    compiled(2)
    assert compiled(1) is first  # now the most recently used
    compiled(3)  # evicts 2
    assert compiled(1) is first
    second = compiled(2)
    assert compiled(2) is second
    compiled(3)
    compiled(2)
    assert compiled(1) is not first


def test_an_open_think_span_comes_first(tokenizer: Any) -> None:
    request = ask("r", response_format=schema_format(SMALL))
    constraint = constraint_for(request, tokenizer, starts_in_reasoning=True)
    assert constraint is not None
    body = '{"ok": true, "n": 1, "color": "red"}'
    assert accepts(constraint, tokenizer, f"Let me think.\nRed.{tokenizer.think_end}{body}")
    assert not accepts(constraint, tokenizer, body)


# The processor, token by token.


def _token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Each ordinary token's bytes (the demo tokenizer is a byte-level BPE)."""
    table = _byte_level_table()
    added = set(tokenizer._tokenizer.added_tokens_decoder)  # markers: not byte-level text
    return {
        i: bytes(table[c] for c in token)
        for token, i in tokenizer.get_vocab().items()
        if i not in added
    }


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-character table, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def test_the_processor_allows_only_tokens_that_keep_the_text_valid(tokenizer: Any) -> None:
    # A schema with three possible documents, walked token by token along one of them. At
    # every step: no token is allowed whose bytes would leave the three documents (checked
    # over the whole vocabulary), the document's own next token is allowed, and once it is
    # complete only the end-of-sequence tokens are. llguidance may refuse a valid but odd
    # spelling of forced text (" " then '"' where the BPE has ' "'), so the allowed set can
    # be smaller than every valid extension; where the documents part ways, it has a token
    # for each.
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["yes", "no", "yesterday"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    documents = [json.dumps({"a": value}).encode() for value in ("yes", "no", "yesterday")]
    constraint = compile_for(tokenizer, response_format=schema_format(schema))
    processor = constraint.processor()
    vocab = len(tokenizer)
    pieces = _token_bytes(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    # The tokens mlx-lm passes start wherever the prefix cache left off: only the last one of a
    # later call is new.
    context = list(tokenizer.encode("any prompt at all", add_special_tokens=False))
    written = b""
    for token in tokenizer.encode(documents[2].decode(), add_special_tokens=False):
        ways = [d for d in documents if d.startswith(written)]
        valid = {
            t for t, piece in pieces.items() if any(d.startswith(written + piece) for d in ways)
        }
        now = allowed(processor, context, vocab)
        assert token in now <= valid | (eos if written in documents else set()), written
        if written == b'{"a": "':
            assert {pieces[t][:1] for t in now} == {b"y", b"n"}
        if written == documents[0]:  # "yes" is complete, "yesterday" goes on
            assert eos <= now
        context.append(token)
        written += pieces[token]
    assert written == documents[2]
    assert allowed(processor, context, vocab) == eos
    assert processor.error is None


def test_a_refused_token_leaves_only_the_end_and_says_why(tokenizer: Any) -> None:
    constraint = compile_for(tokenizer, response_format=ResponseFormat("json_object"))
    processor = constraint.processor()
    vocab = len(tokenizer)
    context = [5]
    pieces = _token_bytes(tokenizer)
    first = allowed(processor, context, vocab)
    assert first
    assert all(pieces[t].startswith(b"{") for t in first)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    assert allowed(processor, [*context, letter], vocab) == set(tokenizer.eos_token_ids)
    assert processor.error is not None
    assert processor.error.startswith(f"the grammar refused token {letter}")
    # Fresh processors start over.
    assert constraint.processor().error is None


def test_a_batch_masks_its_constrained_rows_together(tokenizer: Any) -> None:
    # Three rows: uid 8 unconstrained, 7 and 9 under json_object; 9 then takes a token the
    # grammar refuses. The logits are 4 wider than the tokenizer's vocabulary (a padded
    # embedding): constrained rows refuse those, the free row keeps them.
    constraint = compile_for(tokenizer, response_format=ResponseFormat("json_object"))
    batch = BatchConstraints()
    rows = {7: constraint.processor(), 9: constraint.processor()}
    for uid, processor in rows.items():
        batch.add(uid, processor)
    vocab = len(tokenizer) + 4
    logits = mx.zeros((3, 1, vocab))
    pieces = _token_bytes(tokenizer)

    def kept(masked: Any, row: int) -> set[int]:
        return set(np.flatnonzero(np.array(masked)[row, 0] > -np.inf).tolist())

    # The rows' first step: the tokens given are the prompts' last, not consumed.
    first = batch.mask([8, 7, 9], mx.array([5, 5, 5]), logits)
    assert kept(first, 0) == set(range(vocab))
    assert kept(first, 1) == kept(first, 2)
    assert kept(first, 1)
    assert all(pieces[t].startswith(b"{") for t in kept(first, 1))
    (brace,) = tokenizer.encode("{", add_special_tokens=False)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    second = batch.mask([8, 7, 9], mx.array([letter, brace, letter]), logits)
    assert kept(second, 0) == set(range(vocab))
    assert kept(second, 1)
    assert {pieces[t][:1] for t in kept(second, 1)} <= {b'"', b"}"}
    assert kept(second, 2) == set(tokenizer.eos_token_ids)
    assert rows[7].error is None
    assert rows[9].error is not None
    assert rows[9].error.startswith(f"the grammar refused token {letter}")
    # A step without constrained rows is the model's own logits, and so is any call that is
    # not mlx-lm's generation step (a prefill chunk): the wrapped model passes it through.
    head = logits[:1]
    assert batch.mask([8], mx.array([1]), head) is head
    wrapped = batch.wrap(lambda inputs, cache=None: logits)
    assert wrapped(mx.array([[1], [2], [3]]), cache=None) is logits
    assert rows[7].error is None  # nothing consumed


def test_apply_bitmask_keeps_the_dtype_and_refuses_tokens_past_the_mask() -> None:
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    bitmask[0, 1] = np.int32(-(2**31))  # token 63, the sign bit
    logits = mx.arange(70, dtype=mx.bfloat16).reshape(1, 70)
    masked = apply_bitmask(logits, bitmask)
    assert masked.dtype == mx.bfloat16
    kept = np.flatnonzero(np.array(masked.astype(mx.float32)[0]) > -np.inf)
    assert kept.tolist() == [1, 3, 63]  # 64..69 are past the mask: refused
    assert np.array(masked.astype(mx.float32))[0, 3] == 3
    narrow = apply_bitmask(mx.zeros((1, 2)), bitmask)
    assert np.array(narrow)[0].tolist() == [-np.inf, 0.0]


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
    monkeypatch.setattr(constraint_module, "_PARALLEL_MASKS", parallel)
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
