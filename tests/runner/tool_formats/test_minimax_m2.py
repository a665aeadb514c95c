"""MiniMax-M2's streamed tool calls against mlx-lm's `minimax_m2` parser, no mlx."""

from __future__ import annotations

import ast
import json
import math
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import minimax_m2 as mlx_minimax_m2

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import Tools, string_fragment
from runner.tool_formats.minimax_m2 import (
    FORMAT,
    INVOKE_END,
    PARAMETER_END,
    MiniMaxM2Parser,
)
from tests.runner.tool_formats.support import (
    Param,
    ParamCall,
    assert_split_anywhere,
    big_integers,
    calls,
    decimal_texts,
    decimals,
    json_values,
    read_cut_off,
    split,
    stream,
    tricky_texts,
)

# --- running a parser and reading its calls ----------------------------------------------


def run(pieces: list[str], tools: Tools = ()) -> tuple[list[ToolCallDelta], int]:
    """Feed `pieces`, then end: the deltas and the parser's `calls`."""
    parser = FORMAT.new_parser(tools)
    return stream(parser, pieces), parser.calls


def mlx_calls(text: str, tools: Tools) -> list[dict[str, Any]]:
    parsed = mlx_minimax_m2.parse_tool_call(text, list(tools))
    return parsed if isinstance(parsed, list) else [parsed]


# --- generated calls, rendered as MiniMax-M2's chat template renders them ------------------

TRICKY = [
    "\n",
    "  ",
    '"',
    "'",
    "\\",
    "<",
    ">",
    "</",
    "</param",
    "</parameter",
    "</invoke",
    "</parameter >",
    '<parameter name="x">',
    '<invoke name="g">',
    "null",
    "NULL",
    "None",
    "nil",
    "é",
    "🙂",
    "\t",
    "\u2003",
    "\x01",
]
texts = tricky_texts(TRICKY, size=6, count=8).filter(
    lambda text: "</minimax:tool_call>" not in text
)


def plain_json(text: str) -> bool:
    """Not what mlx-lm reads as no JSON can hold (NaN, Infinity, a float that overflows, a
    Python set or complex), which it would send no arguments for."""
    if "NaN" in text or "Infinity" in text:
        return False
    try:
        if not math.isfinite(float(text)):
            return False
    except ValueError:
        pass
    try:
        json.dumps(ast.literal_eval(text), allow_nan=False)
    except (TypeError, ValueError, OverflowError):
        return False
    except (SyntaxError, MemoryError, RecursionError):
        pass
    return True


names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)
keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_. \-]{0,12}", fullmatch=True)
values = json_values(texts)


def tojson(value: Any) -> str:
    """The template's `v | tojson if v is not string else v`."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


STRING_SCHEMAS: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "text"},
    {"type": ["string", "null"]},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {"enum": ["a", "b"]},
    {"description": "no type"},
]
VALUE_SCHEMAS: list[dict[str, Any]] = [
    {"type": "integer"},
    {"type": ["integer", "null"]},
    {"type": ["integer", "string"]},
    {"enum": [1, 2, 3]},
    {"type": "number"},
    {"type": "Float"},
    {"type": "boolean"},
    {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
    {"type": "object"},
    {"type": "array"},
    {"type": "null"},
    {"type": "mystery"},
]


def exact_number(schema: dict[str, Any], written: str) -> Decimal | None:
    """The number a value of a number parameter is, digit for digit, where mlx-lm reads it
    through a float (`2**53 + 1` becomes `2**53`): Orchard keeps the digits, on purpose."""
    if str(schema.get("type")).lower() not in ("number", "float"):
        return None
    try:
        float(written)
    except ValueError:
        return None
    return Decimal(written.strip())


@st.composite
def params(draw: st.DrawFn, key: str) -> Param:
    kind = draw(
        st.sampled_from(
            ["string", "integer", "number", "boolean", "null", "object", "other", "undeclared"]
        )
    )
    if kind == "string":
        return Param(key, draw(st.sampled_from(STRING_SCHEMAS)), draw(texts))
    if kind == "integer":
        schema = draw(st.sampled_from(VALUE_SCHEMAS[:4]))
        number = draw(big_integers)
        return Param(key, schema, draw(st.sampled_from([str(number), f" {number}\n"])), number)
    if kind == "number":
        schema = draw(st.sampled_from(VALUE_SCHEMAS[4:6]))
        written = draw(st.one_of(decimal_texts(), big_integers.map(str)))
        return Param(key, schema, written, Decimal(written))
    if kind == "boolean":
        schema = draw(st.sampled_from(VALUE_SCHEMAS[6:8]))
        written = draw(st.sampled_from(["true", "false", "True", "yes", "0", "on", " off ", "?"]))
        return Param(key, schema, written)
    if kind == "null":
        schema = draw(st.sampled_from(STRING_SCHEMAS[:4] + VALUE_SCHEMAS))
        return Param(key, schema, draw(st.sampled_from(["null", "NULL", "None", "nil", " Nil "])))
    if kind == "object":
        schema = draw(st.sampled_from(VALUE_SCHEMAS[8:10]))
        value = draw(
            st.dictionaries(st.text(max_size=5), values, max_size=4)
            if schema["type"] == "object"
            else st.lists(values, max_size=4)
        )
        # As JSON (the template's tojson) or as Python would write it (read by literal_eval).
        written = draw(st.sampled_from([tojson(value), str(value)]))
        return Param(key, schema, written)
    if kind == "other":
        # A value of another type than declared: mlx-lm tries each type, then JSON.
        schema = draw(st.sampled_from(VALUE_SCHEMAS))
        written = draw(st.one_of(texts, values.map(tojson)).filter(plain_json))
        return Param(key, schema, written, exact_number(schema, written))
    return Param(key, None, draw(st.one_of(texts, values.map(tojson))))


def clean(value: str) -> str:
    """A value cannot hold the tags that end it (what mlx-lm reads of it is the reference)."""
    return value.replace(PARAMETER_END, "</parameter >").replace(INVOKE_END, "</invoke >")


class Call(ParamCall):
    def text(self) -> str:
        body = "".join(
            f'<parameter name="{param.key}">{clean(param.written)}{PARAMETER_END}\n'
            for param in self.params
        )
        return f'<invoke name="{self.name}">\n{body}{INVOKE_END}'


@st.composite
def generated_calls(draw: st.DrawFn) -> Call:
    name = draw(names)
    found = draw(st.lists(keys, unique=True, max_size=4))
    return Call(name, [draw(params(key)) for key in found])


def section(items: list[Call]) -> str:
    """The text between `<minimax:tool_call>` and `</minimax:tool_call>`."""
    return "\n" + "".join(f"{call.text()}\n" for call in items)


# --- properties ----------------------------------------------------------------------------


@settings(max_examples=200)
@given(
    st.lists(generated_calls(), min_size=1, max_size=3, unique_by=lambda call: call.name), st.data()
)
def test_generated_calls_match_mlx_lm(items: list[Call], data: st.DataObject) -> None:
    tools = [call.tool() for call in items]
    text = section(items)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    deltas, count = run(split(text, cuts), tools)
    result = calls(deltas)
    assert len(result) == count == len(items)
    assert [name for name, _ in result] == [call.name for call in items]
    parsed = mlx_calls(text, tools)
    assert len(parsed) == len(items)
    for (_, arguments), call, reference in zip(result, items, parsed, strict=True):
        assert json.loads(arguments, parse_float=Decimal) == call.expected(reference)
    assert calls(run([text], tools)[0]) == result


@settings(max_examples=100)
@given(
    st.text(st.characters(codec="utf-8", exclude_characters="<"), min_size=2).filter(
        lambda head: not head[-1].isspace()
    ),
    texts,
    st.data(),
)
def test_a_long_string_streams_as_it_comes(head: str, tail: str, data: st.DataObject) -> None:
    head = "Q" + head
    text = f'\n<invoke name="write">\n<parameter name="body">{head}{clean(tail)}</parameter>\n'
    text += "</invoke>\n"
    start = text.index(head)
    cut = start + data.draw(st.integers(1, len(head)))
    while text[cut - 1].isspace():
        cut -= 1
    parser = MiniMaxM2Parser([])
    first = parser.feed(text[:cut])
    assert calls(first) == [("write", '{"body": "' + string_fragment(head[: cut - start]))]
    rest = parser.feed(text[cut:]) + parser.end()
    assert len([delta for delta in first + rest if delta.name is None]) >= 2
    expected = mlx_calls(text, [])[0]["arguments"]
    assert json.loads(calls(first + rest)[0][1]) == expected


@settings(max_examples=100)
@given(
    st.lists(generated_calls(), min_size=1, max_size=2, unique_by=lambda call: call.name), st.data()
)
def test_a_cut_off_section_still_parses(items: list[Call], data: st.DataObject) -> None:
    tools = [call.tool() for call in items]
    text = section(items)
    text = text[: data.draw(st.integers(0, len(text)))]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    read_cut_off(MiniMaxM2Parser, split(text, cuts), tools)


# --- one example, every split --------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "hourly": {"type": "boolean"},
                    "when": {"type": ["string", "null"]},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]
EXAMPLE = (
    '\n<invoke name="get_weather">\n'
    '<parameter name="city"> Paris "</par\\ é\n</parameter>\n'
    '<parameter name="days">18446744073709551617</parameter>\n'
    '<parameter name="scale">0.10000000000000000001</parameter>\n'
    '<parameter name="hourly">yes</parameter>\n'
    '<parameter name="when">None</parameter>\n'
    '<parameter name="opts">{"a": [1, 2.50, true, "</inv"]}</parameter>\n'
    '<parameter name="note">\n line </invoke\n\n</parameter>\n'
    "</invoke>\n"
    '<invoke name="ping">\n</invoke>\n'
)
EXAMPLE_CALLS = [
    (
        "get_weather",
        '{"city": "Paris \\"</par\\\\ é", "days": 18446744073709551617, '
        '"scale": 0.10000000000000000001, "hourly": true, "when": null, '
        '"opts": {"a": [1, 2.50, true, "</inv"]}, "note": "line </invoke"}',
    ),
    ("ping", "{}"),
]


def test_the_example_is_mlx_lms_calls_with_exact_numbers() -> None:
    parsed = mlx_calls(EXAMPLE, TOOLS)
    assert [call["name"] for call in parsed] == ["get_weather", "ping"]
    arguments = decimals(parsed[0]["arguments"])
    # mlx-lm reads a number through a float: the digits past a float's are lost.
    assert arguments["scale"] != Decimal("0.10000000000000000001")
    arguments["scale"] = Decimal("0.10000000000000000001")
    assert json.loads(EXAMPLE_CALLS[0][1], parse_float=Decimal) == arguments
    assert parsed[1]["arguments"] == {}


def test_the_example_split_anywhere() -> None:
    assert_split_anywhere(MiniMaxM2Parser, EXAMPLE, EXAMPLE_CALLS, TOOLS)


def test_the_example_cut_off_anywhere() -> None:
    first = EXAMPLE.index('"get_weather">') + len('"get_weather">')
    second = EXAMPLE.index('"ping">') + len('"ping">')
    for cut in range(len(EXAMPLE) + 1):
        got = read_cut_off(MiniMaxM2Parser, list(EXAMPLE[:cut]), TOOLS)
        assert len(got) == (cut >= first) + (cut >= second), cut


# --- the shape of the stream ---------------------------------------------------------------


def test_names_keys_and_string_characters_go_out_as_soon_as_known() -> None:
    parser = MiniMaxM2Parser(TOOLS)
    assert parser.feed('\n<invoke name="get_weather"') == []
    assert parser.feed(">") == [ToolCallDelta(0, "", name="get_weather")]
    assert parser.feed('\n<parameter name="city">') == [ToolCallDelta(0, '{"city": ')]
    # Whitespace around the value is stripped, so held until more text follows it.
    assert parser.feed(" \nPar") == [ToolCallDelta(0, '"Par')]
    assert parser.feed("is \n</para") == [ToolCallDelta(0, "is")]
    assert parser.feed('meter>\n<parameter name="days">3') == [ToolCallDelta(0, '", "days": ')]
    assert parser.feed("</parameter>\n</invoke>\n") == [ToolCallDelta(0, "3}")]
    assert parser.feed('<invoke name="ping">') == [ToolCallDelta(1, "", name="ping")]
    assert parser.end() == [ToolCallDelta(1, "{}")]
    assert parser.calls == 2


def test_a_string_that_may_be_null_is_held() -> None:
    parser = MiniMaxM2Parser(TOOLS)
    parser.feed('<invoke name="get_weather">\n<parameter name="when">Ni')
    assert parser.feed("l") == []
    assert parser.feed("e") == [ToolCallDelta(0, '"Nile')]
    parser = MiniMaxM2Parser(TOOLS)
    parser.feed('<invoke name="get_weather">\n<parameter name="when">no')
    assert parser.feed("ne </parameter>") == [ToolCallDelta(0, "null")]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "just text",
        "<invoke name=",
        '<invoke name="a"',
        "<invoke name=>\n</invoke>",
        '<parameter name="a">1</parameter>',
    ],
)
def test_a_section_without_a_call(text: str) -> None:
    deltas, count = run([text], TOOLS)
    assert (deltas, count) == ([], 0)


@pytest.mark.parametrize(
    "text",
    [
        '<invoke name="a"</invoke>',
        "<invoke name='a'>\n<parameter name=x>1</parameter>\n</invoke>",
        '<invoke name="a">\n<parameter name="x"</parameter>\n</invoke>',
        '<invoke name="a">\n<parameter name=>v</parameter><parameter name="y">2</parameter>'
        "</invoke>",
        '<invoke name=>\n<parameter name="x">1</parameter>\n</invoke>\n<invoke name="b"></invoke>',
        'junk<invoke name=" a ">junk<parameter name="x"> 1 </parameter>junk</invoke>junk',
        '<invoke name="a">\n<parameter name="x">1</parameter>\n<parameter name="x">2</parameter>'
        "\n</invoke>",
    ],
)
def test_odd_text_read_as_mlx_lm_reads_it(text: str) -> None:
    deltas, _ = run([text], TOOLS)
    result = [(name, json.loads(arguments)) for name, arguments in calls(deltas)]
    assert result == [(call["name"], call["arguments"]) for call in mlx_calls(text, TOOLS)]
    assert calls(run(list(text), TOOLS)[0]) == calls(deltas)


# --- where it parts from mlx-lm, on purpose ------------------------------------------------


def test_an_invocation_ending_inside_a_value_keeps_the_value() -> None:
    # mlx-lm drops a parameter that `</invoke>` cuts short; here it ends there, as far as it got.
    text = '<invoke name="a">\n<parameter name="x">1</invoke>\n<invoke name="b">\n</invoke>'
    assert [call["arguments"] for call in mlx_calls(text, TOOLS)] == [{}, {}]
    assert calls(run([text], TOOLS)[0]) == [("a", '{"x": "1"}'), ("b", "{}")]


@pytest.mark.parametrize(
    ("written", "arguments"),
    [
        ("NaN", '{"scale": "NaN"}'),  # mlx-lm's NaN is no JSON
        ("inf", '{"scale": "inf"}'),  # mlx-lm fails the whole section on an infinity
        ("2.50E+3", '{"scale": 2.50E+3}'),  # as written, where mlx-lm makes it 2500
        ("+.5", '{"scale": 0.5}'),
        ("1_000", '{"scale": 1000}'),
    ],
)
def test_a_number_mlx_lm_reads_otherwise(written: str, arguments: str) -> None:
    text = f'<invoke name="get_weather">\n<parameter name="scale">{written}</parameter>\n</invoke>'
    assert calls(run([text], TOOLS)[0]) == [("get_weather", arguments)]


def test_the_format() -> None:
    assert (FORMAT.parser, FORMAT.start, FORMAT.end, FORMAT.streamed) == (
        "minimax_m2",
        mlx_minimax_m2.tool_call_start,
        mlx_minimax_m2.tool_call_end,
        True,
    )
