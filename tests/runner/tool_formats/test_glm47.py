"""GLM-4.5/4.6/4.7's `<arg_key>` calls streamed, checked against mlx-lm's own `glm47` parser."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import glm47

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import Tools
from runner.tool_formats.glm47 import FORMAT, Glm47Parser
from tests.runner.tool_formats.support import (
    Num,
    assert_split_anywhere,
    batches,
    calls,
    dump,
    exact,
    read,
    split,
    tool,
    tricky_texts,
)

BIG = 18446744073709551617  # 2**64 + 1: a float would round it


def render(name: str, arguments: dict[str, Any], *, newlines: bool) -> str:
    """A call as GLM's chat template writes it, between `<tool_call>` and `</tool_call>`:
    GLM-4.7 without newlines, GLM-4.5/4.6 with them; strings as they are, the rest as JSON."""
    lf = "\n" if newlines else ""
    parts = [name + lf]
    for key, value in arguments.items():
        text = value if type(value) is str else dump(value)
        parts.append(f"<arg_key>{key}</arg_key>{lf}<arg_value>{text}</arg_value>{lf}")
    return "".join(parts)


def typed_tool(name: str, types: dict[str, str]) -> dict[str, Any]:
    """A tool whose parameters have these JSON Schema types."""
    return tool(name, {key: {"type": kind} for key, kind in types.items()})


def feed(text: str, cuts: list[int], tools: Tools) -> tuple[Glm47Parser, list[list[ToolCallDelta]]]:
    """The section fed in pieces cut at `cuts`; the deltas of each feed, then of `end()`."""
    parser = Glm47Parser(tools)
    return parser, batches(parser, split(text, cuts))


def whole(text: str, tools: Tools) -> list[tuple[str, str]]:
    return read(Glm47Parser(tools), [text])


def reference(text: str, tools: Tools) -> dict[str, Any]:
    """mlx-lm's reading, as its server sends it (through json.dumps)."""
    parsed = glm47.parse_tool_call(text, list(tools))
    return {"name": parsed["name"], "arguments": json.loads(json.dumps(parsed["arguments"]))}


TOOLS = [typed_tool("get_weather", {"city": "string", "days": "integer", "note": "string"})]
EXAMPLE = (
    'get_weather\n<arg_key>city</arg_key>\n<arg_value> São "Paulo"\\n </ </arg_value>\n'
    f"<arg_key>days</arg_key>\n<arg_value>{BIG}</arg_value>\n"
    "<arg_key>ratio</arg_key>\n<arg_value>0.10000000000000000001</arg_value>\n"
    '<arg_key>opts</arg_key>\n<arg_value>{"deep": [1, 2.50, null, true]}</arg_value>\n'
)
EXAMPLE_ARGUMENTS = (
    f'{{"city": "São \\"Paulo\\"\\\\n </", "days": {BIG}, "ratio": 0.10000000000000000001, '
    '"opts": {"deep": [1, 2.50, null, true]}}'
)


def test_the_format() -> None:
    assert (FORMAT.parser, FORMAT.start, FORMAT.end, FORMAT.streamed) == (
        "glm47",
        "<tool_call>",
        "</tool_call>",
        True,
    )
    assert isinstance(FORMAT.new_parser(TOOLS), Glm47Parser)


def test_a_call_is_read_as_mlx_lm_reads_it_with_its_numbers_as_written() -> None:
    assert whole(EXAMPLE, TOOLS) == [("get_weather", EXAMPLE_ARGUMENTS)]
    assert json.loads(EXAMPLE_ARGUMENTS) == reference(EXAMPLE, TOOLS)["arguments"]


def test_split_at_every_character_the_deltas_are_the_same() -> None:
    assert_split_anywhere(Glm47Parser, EXAMPLE, [("get_weather", EXAMPLE_ARGUMENTS)], TOOLS)


def test_glm47_writes_no_newlines() -> None:
    text = (
        "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value>"
    )
    assert whole(text, TOOLS) == [("get_weather", '{"city": "Paris", "days": 3}')]


def test_the_name_comes_at_the_first_key_and_each_key_as_soon_as_it_is_closed() -> None:
    parser = Glm47Parser(TOOLS)
    assert parser.feed("get_weather\n<arg_k") == []
    assert parser.calls == 0
    assert parser.feed("ey>ci") == [ToolCallDelta(0, "", name="get_weather")]
    assert parser.calls == 1
    assert parser.feed("ty</arg_key>") == [ToolCallDelta(0, '{"city": ')]
    assert parser.feed("\n<arg_value>") == [ToolCallDelta(0, '"')]


def test_a_string_is_streamed_holding_back_only_what_may_end_it() -> None:
    parser = Glm47Parser(TOOLS)
    parser.feed("get_weather<arg_key>city</arg_key><arg_value>")
    assert parser.feed("  \n") == []  # leading spaces are stripped
    assert parser.feed("Pa") == [ToolCallDelta(0, "Pa")]
    assert parser.feed("ris  ") == [ToolCallDelta(0, "ris")]  # spaces may end the value
    assert parser.feed("x </arg_v") == [ToolCallDelta(0, "  x")]
    assert parser.feed("a") == []
    assert parser.feed("l") == []
    assert parser.feed("ue>\n") == [ToolCallDelta(0, '"')]
    assert parser.end() == [ToolCallDelta(0, "}")]


def test_a_non_string_value_is_sent_whole_at_its_end() -> None:
    parser = Glm47Parser(TOOLS)
    parser.feed("get_weather<arg_key>days</arg_key><arg_value>1")
    assert parser.feed("23") == []
    assert parser.feed("</arg_value>") == [ToolCallDelta(0, "123")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("3", 3),
        (str(BIG), BIG),
        ("-1.50e3", -1500.0),
        ("true", True),
        ("True", True),  # a Python literal, as mlx-lm reads it
        ("None", None),
        ("{'a': (1, 2.5)}", {"a": [1, 2.5]}),
        ('"quoted"', "quoted"),
        ("0x10", 16),
        ("not json", "not json"),
        ("", ""),
    ],
)
def test_values_of_other_types_convert_as_in_mlx_lm(value: str, expected: Any) -> None:
    text = f"f<arg_key>x</arg_key><arg_value>{value}</arg_value>"
    [(_, arguments)] = whole(text, [])
    assert json.loads(arguments) == {"x": expected} == reference(text, [])["arguments"]


def test_decimals_stay_as_written() -> None:
    text = "f<arg_key>x</arg_key><arg_value>[1.50, 0.1000000000000000000001, 2E+3]</arg_value>"
    assert whole(text, []) == [("f", '{"x": [1.50, 0.1000000000000000000001, 2E+3]}')]
    python = "f<arg_key>x</arg_key><arg_value>{'a': 1.50, 'b': -2.50, 'c': 1_0.5}</arg_value>"
    assert whole(python, []) == [("f", '{"x": {"a": 1.50, "b": -2.50, "c": 10.5}}')]


def test_a_declared_string_is_kept_as_text() -> None:
    text = "get_weather<arg_key>city</arg_key><arg_value> 123 </arg_value>"
    assert whole(text, TOOLS) == [("get_weather", '{"city": "123"}')]
    assert whole(text, []) == [("get_weather", '{"city": 123}')]


@pytest.mark.parametrize(
    "text",
    [
        "get_time",
        "get_time\n",
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}',
        '[{"name": "get_weather", "arguments": "{\\"days\\": 3}"}]',
        '{"function": "get_weather", "arguments": {"days": 2}}',
        '{"tool": {"name": "get_weather", "arguments": {"city": 7}}}',
        '{"name": "get_weather"}',
        'get_weather\n{"city": "Paris", "days": 3}',
        'get_weather {"city": "Paris"}',
        "get_weather city='New York' days=3 note=x=y",
        "get_weather just some words",
        "get_weather a=1 b",
    ],
)
def test_a_section_without_arg_keys_is_read_whole_with_mlx_lm_fallbacks(text: str) -> None:
    [(name, arguments)] = whole(text, TOOLS)
    expected = reference(text, TOOLS)
    assert (name, json.loads(arguments)) == (expected["name"], expected["arguments"])


def test_fallbacks_keep_numbers_as_written() -> None:
    text = f'{{"name": "f", "arguments": {{"n": {BIG}, "x": 1.50, "s": "2.50"}}}}'
    assert whole(text, []) == [("f", f'{{"n": {BIG}, "x": 1.50, "s": 2.50}}')]
    assert whole(f"f n={BIG} x=1.50", []) == [("f", f'{{"n": {BIG}, "x": 1.50}}')]


@pytest.mark.parametrize("text", ["", "  \n "])
def test_an_empty_section_is_no_call(text: str) -> None:
    parser, batches = feed(text, [], TOOLS)
    assert batches == [[] for _ in batches]
    assert parser.calls == 0


def test_end_twice_sends_nothing_more() -> None:
    parser = Glm47Parser(TOOLS)
    parser.feed("get_time")
    assert parser.end()
    assert parser.end() == []


def test_a_call_cut_off_is_closed_as_far_as_it_got() -> None:
    cut = "get_weather<arg_key>city</arg_key><arg_value>Par  "
    assert whole(cut, TOOLS) == [("get_weather", '{"city": "Par"}')]
    assert whole("get_weather<arg_key>days</arg_key><arg_value>12", TOOLS) == [
        ("get_weather", '{"days": null}')
    ]
    assert whole("get_weather<arg_key>days</arg_key>", TOOLS) == [("get_weather", '{"days": null}')]
    assert whole("get_weather<arg_key>da", TOOLS) == [("get_weather", "{}")]


@pytest.mark.parametrize("newlines", [False, True])
def test_cut_at_every_character_the_arguments_parse(newlines: bool) -> None:
    text = render(
        "get_weather",
        {"city": 'a "b" </arg_v', "days": BIG, "x": [1, {"y": 2.5}]},
        newlines=newlines,
    )
    full = json.loads(whole(text, TOOLS)[0][1])
    for size in range(len(text) + 1):
        calls = whole(text[:size], TOOLS)
        assert len(calls) <= 1
        for _, arguments in calls:
            parsed = json.loads(arguments)
            assert isinstance(parsed, dict)
            assert list(parsed) == list(full)[: len(parsed)]
            # A cut-off string is what came of it (the start of its closing tag included).
            city = parsed.get("city")
            assert city is None or (full["city"] + "</arg_value>").startswith(city)


# Generated calls, rendered as the template renders them.

_TRICKY = [
    "</arg_value",
    "</arg_val",
    "</",
    "<",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "\\",
    '"',
    "\n",
    " ",
    "\t",
    "é",
    "日本",
    "😀",
    "\\n",
    "'",
]
_TEXT = tricky_texts(_TRICKY, size=4, count=8)
_STRING = _TEXT.filter(lambda s: "</arg_value>" not in s)
_KEY = st.from_regex(r"[a-zA-Zé_][a-zA-Z0-9é_]{0,7}", fullmatch=True)
_NAME = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_.-]{0,11}", fullmatch=True)
_INTEGER = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([BIG, -BIG, 2**64, 0]))
_DECIMAL = st.from_regex(
    r"-?(0|[1-9][0-9]{0,4})\.[0-9]{1,22}([eE][+-]?[0-9]{1,2})?", fullmatch=True
).map(Num)
_SCALAR = st.one_of(_INTEGER, _DECIMAL, st.booleans(), st.none(), _STRING)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEY, inner, max_size=3)),
    max_leaves=8,
)
_PY_LIKE = st.sampled_from(
    [
        "True",
        "None",
        "(1, 2)",
        "{'a': 1.50}",
        "0x10",
        "1_000",
        "NaN",
        "{1, 2}",
        "b'x'",
        "1j",
        "...",
        "[1, 'a']",
    ]
)

_KINDS: dict[str, st.SearchStrategy[Any]] = {
    "string": _STRING,
    "integer": _INTEGER,
    "number": st.one_of(_DECIMAL, _INTEGER),
    "boolean": st.booleans(),
    "object": st.dictionaries(_KEY, _JSON, max_size=3),
    "array": st.lists(_JSON, max_size=3),
    "undeclared": st.one_of(_JSON, _STRING, _PY_LIKE),
}


@st.composite
def generated_calls(draw: st.DrawFn) -> tuple[str, dict[str, Any], dict[str, str]]:
    """A call's name, arguments and the types its tool declares."""
    name = draw(_NAME)
    keys = draw(st.lists(_KEY, max_size=5, unique=True))
    kinds = {key: draw(st.sampled_from(sorted(_KINDS))) for key in keys}
    arguments = {key: draw(_KINDS[kind]) for key, kind in kinds.items()}
    return name, arguments, {k: v for k, v in kinds.items() if v != "undeclared"}


def _expected(
    name: str, arguments: dict[str, Any], types: dict[str, str], text: str
) -> dict[str, Any]:
    """mlx-lm's reading of the section, where it is JSON: a value mlx-lm turns into one JSON
    cannot hold (a set, bytes, NaN) stays the text it was."""
    parsed = glm47.parse_tool_call(text, [typed_tool(name, types)])
    result = {}
    for key, value in parsed["arguments"].items():
        try:
            result[key] = json.loads(json.dumps(value))
        except TypeError:
            result[key] = arguments[key].strip()
        if isinstance(result[key], float) and math.isnan(result[key]):
            result[key] = arguments[key].strip()
    return {"name": parsed["name"], "arguments": result}


@settings(max_examples=200, deadline=None)
@given(call=generated_calls(), newlines=st.booleans(), long=st.booleans(), data=st.data())
def test_generated_calls_stream_as_mlx_lm_reads_them(
    call: tuple[str, dict[str, Any], dict[str, str]],
    newlines: bool,
    long: bool,
    data: st.DataObject,
) -> None:
    name, arguments, types = call
    if long:
        rest = {key: value for key, value in arguments.items() if key != "long"}
        arguments = {"long": "word " * 8 + 'with "quotes" \\ and\nnewlines', **rest}
        types = {**types, "long": "string"}
    text = render(name, arguments, newlines=newlines)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    if long:
        start = text.index("<arg_value>") + len("<arg_value>")
        cuts.append(data.draw(st.integers(start + 1, start + 40)))
    tools = [typed_tool("a decoy", {"long": "integer"}), typed_tool(name, types)]
    parser, batches = feed(text, cuts, tools)
    [(got_name, got_arguments)] = calls([d for batch in batches for d in batch])
    assert parser.calls == 1
    expected = _expected(name, arguments, types, text)
    assert got_name == expected["name"] == name
    assert json.loads(got_arguments) == expected["arguments"]
    # The numbers as written: every value written as JSON is the same JSON, digit for digit.
    written = exact(got_arguments)
    for key, value in arguments.items():
        if types.get(key) == "string":
            assert written[key] == value.strip()
        elif not isinstance(value, str):  # JSON, numbers as written
            assert written[key] == exact(dump(value))
    if long:
        assert sum(any(d.arguments for d in batch) for batch in batches) >= 2
