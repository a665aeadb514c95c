"""Forced calls in each family's syntax (runner.tool_formats.grammars), walked at random.

For each format, the constraint of a request with `tool_choice` "required" is compiled for
the built-in model's tokenizer (wrapped with the family's markers and mlx-lm parser) and
walked: at each step a seeded random choice among the tokens the grammar allows (leaning
towards ones that may close a value, so that free text ends). Every walk must end in calls
that mlx-lm's own parser and Orchard's streaming parser both read back as the same calls,
whose arguments validate against their tool's schema."""

from __future__ import annotations

import importlib
import json
import random
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from protocol.frames import Tool
from runner.engine.constraint import Constraint, constraint_for
from runner.engine.masking import ConstraintProcessor
from runner.errors import RequestError
from runner.tool_calls import ToolCallSplitter
from runner.tool_formats import streamed_format
from tests.runner.engines import Reference, ask

WALKS = 50
"""Walks per format: the issue's "50 of 50 seeded samples"."""
MAX_STEPS = 800

CITY = {"type": "string", "enum": ["Paris", "Rio de Janeiro", "Köln"]}
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": CITY,
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["rain", "sun"]},
            "maxItems": 2,
        },
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NOTE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 12}},
    "required": ["text"],
    "additionalProperties": False,
}
FREE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
TOOLS = (
    Tool("get_weather", parameters=json.dumps(WEATHER_SCHEMA)),
    Tool("now"),
)
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "now": {"type": "object", "properties": {}}}
FORMATS = (
    "json_tools",
    "qwen3_coder",
    "minimax_m2",
    "glm47",
    "kimi_k2",
    "mistral",
    "pythonic",
    "gemma4",
)


def wrapped(reference: Reference, name: str) -> TokenizerWrapper:
    """The built-in tokenizer with the markers and parser of mlx-lm's `name` format."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    tokenizer = reference.tokenizer
    return TokenizerWrapper(
        tokenizer._tokenizer,
        eos_token_ids=tokenizer.eos_token_ids,
        tool_call_start=module.tool_call_start,
        tool_call_end=module.tool_call_end,
        tool_parser=module.parse_tool_call,
    )


def walk(constraint: Constraint, tokenizer: Any, seed: int) -> str:
    """A seeded random text the constraint allows, up to an end-of-sequence token."""
    rng = random.Random(seed)
    processor: ConstraintProcessor = constraint.processor()
    vocab = len(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    context = [7, 8, 9]
    texts = [tokenizer.decode([i]) for i in range(vocab)]
    closing = {i for i, text in enumerate(texts) if text[:1] in ("<", "\n", '"', "[", "]", "}")}
    for _ in range(MAX_STEPS):
        masked = processor(mx.array(context), mx.zeros((1, vocab)))
        allowed = [int(i) for i in np.flatnonzero(np.array(masked[0]) > -np.inf)]
        assert processor.error is None, processor.error
        assert allowed, "the grammar allows nothing"
        if set(allowed) <= eos or (eos & set(allowed) and rng.random() < 0.7):
            return str(tokenizer.decode(context[3:]))
        leaning = [i for i in allowed if i in closing and i not in eos]
        pool = leaning if len(allowed) > 40 and leaning and rng.random() < 0.6 else allowed
        pool = [i for i in pool if i not in eos] or pool
        context.append(rng.choice(pool))
    raise AssertionError(f"no end within {MAX_STEPS} tokens: {tokenizer.decode(context[3:])!r}")


def streamed_calls(name: str, text: str, tools: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The calls Orchard's splitter streams out of `text`, fed a token's worth at a time."""
    format = streamed_format(name)
    assert format is not None
    splitter = ToolCallSplitter(format, tools)
    content, deltas = [], []
    for i in range(0, len(text), 3):
        shown, more = splitter.feed(text[i : i + 3])
        content.append(shown)
        deltas += more
    shown, more = splitter.flush()
    content.append(shown)
    deltas += more
    assert "".join(content).strip() == "", f"content beside forced calls: {content!r}"
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
            arguments[delta.index] = ""
        arguments[delta.index] += delta.arguments
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)]


def mlx_calls(tokenizer: TokenizerWrapper, text: str, tools: list[dict[str, Any]]) -> list[Any]:
    """The calls mlx-lm's parser reads from each section of `text`."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    sections = text.split(start)[1:]
    found = []
    for section in sections:
        body = section.split(end)[0] if end else section
        parsed = tokenizer.tool_parser(body, tools)
        for call in parsed if isinstance(parsed, list) else [parsed]:
            found.append((call["name"], call["arguments"]))
    return found


def template_tools(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                **({"parameters": json.loads(tool.parameters)} if tool.parameters else {}),
            },
        }
        for tool in tools
    ]


@pytest.mark.parametrize("name", FORMATS)
def test_forced_calls_fit_their_schema_in_every_walk(reference: Reference, name: str) -> None:
    tokenizer = wrapped(reference, name)
    forced = TOOLS
    constraint = constraint_for(ask("r", tools=forced, tool_choice="required"), tokenizer)
    assert constraint is not None
    tools = template_tools(forced)
    seen = set()
    for seed in range(WALKS):
        text = walk(constraint, tokenizer, seed)
        ours = streamed_calls(name, text, tools)
        assert ours, f"no call in {text!r}"
        assert ours == mlx_calls(tokenizer, text, tools), text
        for call_name, arguments in ours:
            jsonschema.validate(arguments, SCHEMAS[call_name])
            seen.add((call_name, tuple(sorted(arguments))))
    # The walks reach both tools and the optional parameters, not one path only: the nested
    # array and object among them.
    assert {call_name for call_name, _ in seen} == {"get_weather", "now"}
    assert any(len(keys) > 2 for call_name, keys in seen if call_name == "get_weather")
    assert any("tags" in keys for _, keys in seen), seen
    assert any("where" in keys for _, keys in seen), seen


@pytest.mark.parametrize(("low", "high"), [(0, None), (2, None), (0, 2), (2, 3), (1, 1)], ids=str)
def test_gemma4s_arrays_keep_their_item_bounds(
    reference: Reference, low: int, high: int | None
) -> None:
    items: dict[str, Any] = {"type": "array", "items": {"type": "integer", "maximum": 9}}
    items |= {"minItems": low} | ({} if high is None else {"maxItems": high})
    nested = {
        "type": "object",
        "properties": {
            "n": items,
            "inner": {"type": "object", "properties": {"n": items}, "required": ["n"]},
        },
        "required": ["n", "inner"],
    }
    parameters = {"type": "object", "properties": {"x": nested}, "required": ["x"]}
    tool = Tool("f", parameters=json.dumps(parameters))
    tokenizer = wrapped(reference, "gemma4")
    constraint = constraint_for(ask("r", tools=(tool,), tool_choice="required"), tokenizer)
    assert constraint is not None
    lengths = set()
    for seed in range(20):
        text = walk(constraint, tokenizer, seed)
        calls = streamed_calls("gemma4", text, template_tools((tool,)))
        assert calls == mlx_calls(tokenizer, text, template_tools((tool,))), text
        for _, arguments in calls:
            jsonschema.validate(arguments, parameters)
            lengths |= {len(arguments["x"]["n"]), len(arguments["x"]["inner"]["n"])}
    assert min(lengths) >= low
    assert high is None or max(lengths) <= high
    # The walks reach more than one length where the bounds allow it.
    assert len(lengths) > 1 or low == high


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "its anyOf"),
        ({"type": ["string", "null"]}, 'a value of no single "type"'),
        ({"type": "array"}, 'an array without one "items" schema'),
        ({"type": "object", "properties": {}, "minProperties": 1}, "its minProperties"),
        ({"type": "array", "items": {"$ref": "#/$defs/x"}}, "its $ref"),
    ],
)
def test_what_gemma4s_syntax_cannot_force_is_refused_by_name(
    reference: Reference, schema: dict[str, Any], why: str
) -> None:
    parameters = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    tool, name = Tool("f", parameters=json.dumps(parameters)), "gemma4"
    with pytest.raises(RequestError) as raised:
        constraint_for(ask("r", tools=(tool,), tool_choice="required"), wrapped(reference, name))
    assert raised.value.param == "tools"
    where = "tools[0].function.parameters.properties.x" + (".items" if why == "its $ref" else "")
    assert str(raised.value) == (
        f"{where}: Gemma 4's tool-call syntax is enforced for strings, numbers, booleans, null, "
        f"objects of listed properties and arrays of one item schema; {why} cannot be forced."
    )


@pytest.mark.parametrize("name", FORMATS)
def test_a_named_function_without_parallel_calls_is_one_call_of_it(
    reference: Reference, name: str
) -> None:
    tokenizer = wrapped(reference, name)
    request = ask(
        "r",
        tools=TOOLS,
        tool_choice="function",
        tool_name="get_weather",
        parallel_tool_calls=False,
    )
    constraint = constraint_for(request, tokenizer)
    assert constraint is not None
    tools = template_tools(TOOLS)
    for seed in range(10):
        calls = streamed_calls(name, walk(constraint, tokenizer, seed), tools)
        assert [call_name for call_name, _ in calls] == ["get_weather"]


FREE_VALUE = 'It is "sunny" <b>\n</param and 2 < 3\n'
"""A free string with quotes, a newline, and what may start a closing tag."""


def accepts(constraint: Constraint, tokenizer: Any, text: str) -> bool:
    """Whether the constraint lets a model write `text` (as the tokenizer splits it), then end."""
    processor = constraint.processor()
    vocab = len(tokenizer)
    context = [7, 8, 9]
    for token in tokenizer.encode(text, add_special_tokens=False):
        masked = processor(mx.array(context), mx.zeros((1, vocab)))
        if not np.array(masked[0])[token] > -np.inf:
            return False
        context.append(token)
    masked = processor(mx.array(context), mx.zeros((1, vocab)))
    return any(np.array(masked[0])[list(tokenizer.eos_token_ids)] > -np.inf)


@pytest.mark.parametrize(
    ("name", "call", "cut"),
    [
        (
            "qwen3_coder",
            "<tool_call>\n<function=note>\n<parameter=text>\n{}\n</parameter>\n</function>\n"
            "</tool_call>",
            "\n</parameter>\n",
        ),
        (
            "minimax_m2",
            '<minimax:tool_call>\n<invoke name="note">\n<parameter name="text">{}</parameter>\n'
            "</invoke>\n</minimax:tool_call>",
            "</parameter>\n",
        ),
        (
            "glm47",
            "<tool_call>note<arg_key>text</arg_key><arg_value>{}</arg_value></tool_call>",
            "</arg_value>",
        ),
    ],
)
def test_a_free_string_parameter_is_any_text_up_to_its_closing_tag(
    reference: Reference, name: str, call: str, cut: str
) -> None:
    tokenizer = wrapped(reference, name)
    tool = Tool("note", parameters=json.dumps(FREE_SCHEMA))
    constraint = constraint_for(ask("r", tools=(tool,), tool_choice="required"), tokenizer)
    assert constraint is not None
    value = FREE_VALUE.strip() if name != "qwen3_coder" else FREE_VALUE
    text = call.format(value)
    assert accepts(constraint, tokenizer, text)
    assert streamed_calls(name, text, template_tools((tool,))) == [("note", {"text": value})]
    # The closing tag ends the value: a value holding it is another text.
    assert not accepts(constraint, tokenizer, call.format(f"a{cut}b"))
    if name != "qwen3_coder":
        # Values these parsers strip cannot start or end with whitespace.
        assert not accepts(constraint, tokenizer, call.format(" a"))
        assert not accepts(constraint, tokenizer, call.format("a "))


def test_a_length_on_a_string_holds_where_the_value_is_not_stripped(reference: Reference) -> None:
    tokenizer = wrapped(reference, "qwen3_coder")
    tool = Tool("note", parameters=json.dumps(NOTE_SCHEMA))
    constraint = constraint_for(ask("r", tools=(tool,), tool_choice="required"), tokenizer)
    assert constraint is not None
    for seed in range(10):
        calls = streamed_calls("qwen3_coder", walk(constraint, tokenizer, seed), [])
        jsonschema.validate(calls[0][1], NOTE_SCHEMA)


@pytest.mark.parametrize(
    ("name", "schema", "message"),
    [
        (
            "minimax_m2",
            NOTE_SCHEMA,
            "tools[0].function.parameters.properties.text: a pattern or length cannot be "
            "enforced on a string this model's tool-call format writes as plain text and "
            "strips.",
        ),
        (
            "qwen3_coder",
            {"type": "object", "properties": {"at": {"type": "string", "format": "date"}}},
            "tools[0].function.parameters.properties.at: format cannot be enforced on a "
            "string this model's tool-call format writes as plain text.",
        ),
        (
            "glm47",
            {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer"}]}}},
            "tools[0].function.parameters.properties.n: this model's tool-call format types "
            'each argument by one JSON type; give the parameter a single "type".',
        ),
    ],
)
def test_what_a_key_value_format_cannot_carry_is_refused_by_name(
    reference: Reference, name: str, schema: dict[str, Any], message: str
) -> None:
    tokenizer = wrapped(reference, name)
    tool = Tool("f", parameters=json.dumps(schema))
    with pytest.raises(RequestError) as raised:
        constraint_for(ask("r", tools=(tool,), tool_choice="required"), tokenizer)
    assert (str(raised.value), raised.value.param) == (message, "tools")
