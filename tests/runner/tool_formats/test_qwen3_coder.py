"""Qwen3-Coder's streamed tool calls against mlx-lm's `qwen3_coder` parser, no mlx."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import qwen3_coder as mlx_qwen3_coder

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import Tools, string_fragment
from runner.tool_formats.qwen3_coder import FORMAT, PARAMETER_END, Qwen3CoderParser
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


# --- generated calls, rendered as Qwen3-Coder's chat template renders them -----------------

TRICKY = [
    "\n",
    "\n\n",
    '"',
    "\\",
    "\\n",
    "<",
    ">",
    "</",
    "</param",
    "</parameter",
    "</parameter >",
    "<parameter=x>",
    "</function>",
    "<function=g>",
    "null",
    "NULL",
    "None",
    "é",
    "🙂",
    "\t",
    " ",
    "\u2028",
    "\x01",
]
texts = tricky_texts(TRICKY, size=6, count=8).filter(
    lambda text: "</parameter>" not in text and "</tool_call>" not in text
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)
values = json_values(texts)


def render(value: Any, *, python: bool = False) -> str:
    """The template's `args_value | tojson` for a mapping or a list, else `| string`."""
    if isinstance(value, dict | list):
        # Older Qwen3-Coder templates wrote these with `| string`: Python's repr.
        return str(value) if python else json.dumps(value, ensure_ascii=False)
    return str(value)


anything = st.one_of(texts, values.map(render))


@st.composite
def params(draw: st.DrawFn, key: str) -> Param:
    kind = draw(
        st.sampled_from(
            [
                "string",
                "integer",
                "number",
                "boolean",
                "null",
                "object",
                "array",
                "undeclared",
                "untyped",
            ]
        )
    )
    if kind == "string":
        kind_name = draw(st.sampled_from(["string", "str", "text", "varchar", "enum", " String"]))
        return Param(key, {"type": kind_name}, draw(texts))
    if kind == "integer":
        kind_name = draw(st.sampled_from(["integer", "int", "int64", "uint32", "long"]))
        number = draw(big_integers)
        written = draw(st.sampled_from([str(number), f"{number}.0", f" {number} "]))
        return Param(key, {"type": kind_name}, written, number)
    if kind == "number":
        kind_name = draw(st.sampled_from(["number", "float", "numeric"]))
        written = draw(st.one_of(decimal_texts(), big_integers.map(str)))
        return Param(key, {"type": kind_name}, written, Decimal(written))
    if kind == "boolean":
        kind_name = draw(st.sampled_from(["boolean", "bool", "binary"]))
        written = draw(st.sampled_from(["True", "False", "true", "false", "yes"]))
        return Param(key, {"type": kind_name}, written)
    if kind == "null":
        kind_name = draw(st.sampled_from(["integer", "number", "boolean", "object", "string"]))
        return Param(key, {"type": kind_name}, draw(st.sampled_from(["null", "NULL", "Null"])))
    if kind in ("object", "array"):
        kind_name = draw(st.sampled_from([kind, "dict" if kind == "object" else "list"]))
        inner = st.dictionaries(st.text(max_size=5), values, max_size=4)
        value = draw(inner if kind == "object" else st.lists(values, max_size=4))
        return Param(key, {"type": kind_name}, render(value, python=draw(st.booleans())))
    if kind == "untyped":
        # mlx-lm would read JSON's NaN and Infinity, which are no JSON to send.
        written = draw(anything.filter(lambda text: "NaN" not in text and "Infinity" not in text))
        return Param(key, {"description": "no type"}, written)
    return Param(key, None, draw(anything))


class Call(ParamCall):
    def text(self) -> str:
        # A value cannot hold its closing tag (what mlx-lm reads of it is the reference).
        body = "".join(
            f"<parameter={param.key}>\n{param.written.replace(PARAMETER_END, '</parameter >')}"
            f"\n{PARAMETER_END}\n"
            for param in self.params
        )
        return f"<function={self.name}>\n{body}</function>"


@st.composite
def generated_calls(draw: st.DrawFn) -> Call:
    name = draw(names)
    keys = draw(st.lists(names, unique=True, max_size=4))
    return Call(name, [draw(params(key)) for key in keys])


def section(items: list[Call]) -> str:
    """The text between `<tool_call>` and `</tool_call>` (one call per section in the
    template; the parser reads several)."""
    return "".join(f"\n{call.text()}" for call in items) + "\n"


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
    for (_, arguments), call in zip(result, items, strict=True):
        parsed = mlx_qwen3_coder.parse_tool_call(call.text(), tools)
        assert json.loads(arguments, parse_float=Decimal) == call.expected(parsed)
    assert calls(run([text], tools)[0]) == result
    if len(items) == 1:
        # The whole section as mlx-lm's server hands it over.
        whole = mlx_qwen3_coder.parse_tool_call(text, tools)
        assert (whole["name"], decimals(whole["arguments"])) == (
            items[0].name,
            decimals(mlx_qwen3_coder.parse_tool_call(items[0].text(), tools)["arguments"]),
        )


@settings(max_examples=100)
@given(
    st.text(st.characters(codec="utf-8", exclude_characters="nN<\n \t\r"), min_size=2),
    texts,
    st.data(),
)
def test_a_long_string_streams_as_it_comes(head: str, tail: str, data: st.DataObject) -> None:
    head = "Q" + head
    text = f"\n<function=write>\n<parameter=body>\n{head}{tail}\n</parameter>\n</function>\n"
    start = text.index(head)
    cut = start + data.draw(st.integers(1, len(head)))
    parser = Qwen3CoderParser([])
    first = parser.feed(text[:cut])
    assert calls(first) == [("write", '{"body": "' + string_fragment(head[: cut - start]))]
    rest = parser.feed(text[cut:]) + parser.end()
    assert len([delta for delta in first + rest if delta.name is None]) >= 2
    expected = mlx_qwen3_coder.parse_tool_call(text, [])["arguments"]
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
    read_cut_off(Qwen3CoderParser, split(text, cuts), tools)


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
                    "when": {"type": "string"},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]
EXAMPLE = (
    "\n<function=get_weather>\n"
    '<parameter=city>\nParis "</par\\ é\n</parameter>\n'
    "<parameter=days>\n18446744073709551617\n</parameter>\n"
    "<parameter=scale>\n0.10000000000000000001\n</parameter>\n"
    "<parameter=hourly>\nTrue\n</parameter>\n"
    "<parameter=when>\nnull\n</parameter>\n"
    '<parameter=opts>\n{"a": [1, 2.50, true, "</function>"]}\n</parameter>\n'
    "<parameter=note>\n\nline </parameter\n\n</parameter>\n"
    "</function>\n"
)
EXAMPLE_ARGUMENTS = (
    '{"city": "Paris \\"</par\\\\ é", "days": 18446744073709551617, '
    '"scale": 0.10000000000000000001, "hourly": true, "when": null, '
    '"opts": {"a": [1, 2.50, true, "</function>"]}, "note": "\\nline </parameter\\n"}'
)


def test_the_example_is_mlx_lms_call_with_exact_numbers() -> None:
    arguments = decimals(mlx_qwen3_coder.parse_tool_call(EXAMPLE, TOOLS)["arguments"])
    arguments["days"] = 18446744073709551617
    arguments["scale"] = Decimal("0.10000000000000000001")
    assert json.loads(EXAMPLE_ARGUMENTS, parse_float=Decimal) == arguments
    # What mlx-lm itself makes of the integer: its float, rounded.
    rounded = mlx_qwen3_coder.parse_tool_call(EXAMPLE, TOOLS)["arguments"]["days"]
    assert rounded == 18446744073709551616


def test_the_example_split_anywhere() -> None:
    assert_split_anywhere(Qwen3CoderParser, EXAMPLE, [("get_weather", EXAMPLE_ARGUMENTS)], TOOLS)


def test_the_example_cut_off_anywhere() -> None:
    named_at = EXAMPLE.index("get_weather>") + len("get_weather>")
    for cut in range(len(EXAMPLE) + 1):
        got = read_cut_off(Qwen3CoderParser, list(EXAMPLE[:cut]), TOOLS)
        assert len(got) == (1 if cut >= named_at else 0), cut


# --- the shape of the stream ---------------------------------------------------------------


def test_names_keys_and_string_characters_go_out_as_soon_as_known() -> None:
    parser = Qwen3CoderParser(TOOLS)
    assert parser.feed("\n<function=get_weat") == []
    assert parser.feed("her>") == [ToolCallDelta(0, "", name="get_weather")]
    assert parser.feed("\n<parameter=city>") == [ToolCallDelta(0, '{"city": ')]
    # The leading newline is stripped; a trailing one and a tag's start are held back.
    assert parser.feed("\nPar") == [ToolCallDelta(0, '"Par')]
    assert parser.feed("is\n</para") == [ToolCallDelta(0, "is")]
    assert parser.feed("meter>\n<parameter=days>\n3") == [ToolCallDelta(0, '", "days": ')]
    assert parser.feed("\n</parameter>\n</function>\n") == [ToolCallDelta(0, "3}")]
    assert parser.end() == []
    assert parser.calls == 1


def test_a_string_that_may_be_null_is_held() -> None:
    parser = Qwen3CoderParser(TOOLS)
    parser.feed("<function=get_weather>\n<parameter=when>\nNu")
    assert parser.feed("l") == []
    assert parser.feed("ls") == [ToolCallDelta(0, '"Nulls')]
    parser = Qwen3CoderParser(TOOLS)
    parser.feed("<function=get_weather>\n<parameter=when>\nNul")
    assert parser.feed("l\n</parameter>") == [ToolCallDelta(0, "null")]


@pytest.mark.parametrize(
    "text", ["", "\n", "just text", "<function=", "<function=>\n</function>", "<parameter=a>1"]
)
def test_a_section_without_a_call(text: str) -> None:
    deltas, count = run([text], TOOLS)
    assert (deltas, count) == ([], 0)


def test_an_empty_call() -> None:
    deltas, _ = run(["\n<function=ping>\n</function>\n"])
    assert calls(deltas) == [("ping", "{}")]


# --- where it parts from mlx-lm, on purpose ------------------------------------------------


def test_several_functions_in_a_section_are_several_calls() -> None:
    # mlx-lm would merge them into one call named after the first.
    text = (
        "\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "<function=b>\n<parameter=y>\n2\n</parameter>\n</function>\n"
    )
    deltas, count = run([text])
    assert count == 2
    assert calls(deltas) == [("a", '{"x": "1"}'), ("b", '{"y": "2"}')]


@pytest.mark.parametrize(
    ("written", "arguments"),
    [
        ("5.5", '{"days": 5.5}'),  # mlx-lm fails the whole call on a fraction
        ("abc", '{"days": "abc"}'),  # and on text
        ("1.0e3", '{"days": 1.0e3}'),  # as written, where mlx-lm makes it 1000
        ("+5", '{"days": 5}'),
        ("1_000", '{"days": 1000}'),
        ("inf", '{"days": "inf"}'),  # and on an infinity
        ("NaN", '{"days": "NaN"}'),
    ],
)
def test_an_integer_mlx_lm_reads_otherwise(written: str, arguments: str) -> None:
    text = f"<function=get_weather>\n<parameter=days>\n{written}\n</parameter>\n</function>"
    assert calls(run([text], TOOLS)[0]) == [("get_weather", arguments)]


def test_json_nan_in_an_object_is_no_number() -> None:
    text = '<function=get_weather>\n<parameter=opts>\n{"a": NaN}\n</parameter>\n</function>'
    assert calls(run([text], TOOLS)[0]) == [("get_weather", '{"opts": "{\\"a\\": NaN}"}')]


def test_the_format() -> None:
    assert (FORMAT.parser, FORMAT.start, FORMAT.end, FORMAT.streamed) == (
        "qwen3_coder",
        mlx_qwen3_coder.tool_call_start,
        mlx_qwen3_coder.tool_call_end,
        True,
    )
