"""Gemma 4's section parser: `call:NAME{key:<|"|>text<|"|>,n:3}` turned into JSON as it streams."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import gemma4

from protocol.frames import ToolCallDelta
from runner.tool_formats.gemma4 import FORMAT, Gemma4Parser
from tests.runner.tool_formats.support import (
    LONG,
    Num,
    assert_split_anywhere,
    calls,
    exact,
    numbers,
    read,
    read_cut_off,
    split,
    stream,
    tricky_texts,
    written,
)

Q = '<|"|>'


def feed(pieces: list[str]) -> tuple[Gemma4Parser, list[ToolCallDelta]]:
    parser = Gemma4Parser([])
    return parser, stream(parser, pieces)


def render(value: Any) -> str:
    """The chat template's `format_argument(value, escape_keys=False)` (a number as written,
    None as `null`, as the current template writes it)."""
    if isinstance(value, Num):
        return value.text
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        members = sorted(value.items(), key=lambda item: item[0].lower())  # `dictsort`
        return "{" + ",".join(f"{k}:{render(v)}" for k, v in members) + "}"
    return "[" + ",".join(render(item) for item in value) + "]"


TRICKY = ['<|"|', '|>', '"|>', "<|", "<", "<tool_call|", "<|tool_call>", "call:f{", "{", "}",
          "[", "]", ",", ":", '"', "\\", "\\n", "\n", "é", "😀", "true", "3"]  # fmt: skip
strings = (
    tricky_texts(TRICKY, size=6, count=5)
    # The format cannot hold its own delimiter, nor the section its end marker; mlx-lm's
    # parser uses NUL around its placeholders.
    .filter(lambda s: Q not in s and FORMAT.end not in s and "\x00" not in s)
)
# Keys as mlx-lm's parser quotes them (`\w+`, ASCII: its `regex` and `re` differ past it).
keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
values = st.recursive(
    st.one_of(strings, numbers, st.booleans(), st.none()),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
    max_leaves=8,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,12}", fullmatch=True)


@st.composite
def sections(draw: st.DrawFn) -> tuple[str, list[tuple[str, Any]], str]:
    """A section of calls as the chat template writes each (`call:NAME{...}`; a model may
    write several in one section, as mlx-lm's parser reads them), the calls, and a long
    string value of the first call's arguments."""
    calls_ = draw(
        st.lists(
            st.tuples(names, st.dictionaries(keys, values, max_size=4)), min_size=1, max_size=3
        )
    )
    long = draw(LONG)
    calls_[0][1]["long"] = long
    text = "".join(f"call:{name}{render(args)}" for name, args in calls_)
    return text, calls_, long


@settings(max_examples=150, deadline=None)
@given(sections(), st.lists(st.integers(0, 10_000), max_size=8), st.integers(1, 39))
def test_calls_stream_as_mlx_lm_parses_them(
    section: tuple[str, list[tuple[str, Any]], str], points: list[int], offset: int
) -> None:
    text, expected, long = section
    inside = text.index(long) + offset  # a split inside the long value
    pieces = split(text, [p % (len(text) + 1) for p in points] + [inside])
    parser, deltas = feed(pieces)
    got = calls(deltas)
    assert parser.calls == len(expected)
    assert [name for name, _ in got] == [name for name, _ in expected]
    assert [exact(args) for _, args in got] == [written(args) for _, args in expected]
    parsed = gemma4.parse_tool_call(text)
    parsed = parsed if isinstance(parsed, list) else [parsed]
    assert [json.loads(args) for _, args in got] == [p["arguments"] for p in parsed]
    assert [name for name, _ in got] == [p["name"] for p in parsed]
    assert sum(d.index == 0 and d.name is None for d in deltas) >= 2
    assert got == calls(feed([text])[1])


FIXED = (
    f'call:get_weather{{city:{Q}Pa<|ri"s\\n{Q},n:123456789012345678901234567890,f:-1.50e+3,'
    f"ok:true,none:null,nested:{{a:[1,{{b:{Q}}}]{Q}}}],c:[]}}}} call:other{{}}"
)
FIXED_CALLS = [
    (
        "get_weather",
        '{"city": "Pa<|ri\\"s\\\\n", "n": 123456789012345678901234567890, "f": -1.50e+3, '
        '"ok": true, "none": null, "nested": {"a": [1, {"b": "}]"}], "c": []}}',
    ),
    ("other", "{}"),
]


def test_a_section_split_anywhere_gives_the_same_calls() -> None:
    assert_split_anywhere(Gemma4Parser, FIXED, FIXED_CALLS)


def test_a_section_cut_anywhere_closes_its_calls() -> None:
    for at in range(len(FIXED) + 1):
        got = read_cut_off(Gemma4Parser, list(FIXED[:at]))
        assert [name for name, _ in got] == [name for name, _ in FIXED_CALLS][: len(got)], at


def test_the_name_is_sent_at_the_brace_and_strings_as_they_come() -> None:
    parser = Gemma4Parser([])
    assert parser.feed("call:get_wea") == []
    assert parser.feed("ther{") == [
        ToolCallDelta(0, "", name="get_weather"),
        ToolCallDelta(0, "{"),
    ]
    # A key waits for its value; a string is held only where `<|"|>` may be starting.
    assert parser.feed("city:") == []
    assert parser.feed(f"{Q}Par<|") == [ToolCallDelta(0, '"city": "Par')]
    assert parser.feed(f"is{Q},n:4") == [ToolCallDelta(0, '<|is"')]
    assert parser.feed("2}") == [ToolCallDelta(0, ', "n": 42}')]
    assert parser.end() == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no call here", []),
        ("", []),
        ("call:f", []),
        # Older templates render None as Jinja prints it.
        ("call:f{a:None,b:True}", [("f", '{"a": null, "b": true}')]),
        # A quoted key (the template's escape_keys=True form), spaces, a trailing comma.
        (f"call:f{{ {Q}my key{Q} : 1 , }}", [("f", '{"my key": 1}')]),
        ("call:f{word:hello,n:inf}", [("f", '{"word": "hello", "n": "inf"}')]),
        ("call:f{a:1}junk call:g{b:[]}", [("f", '{"a": 1}'), ("g", '{"b": []}')]),
        ("call:f{a:1 2:3}", [("f", '{"a": "1 2:3"}')]),
        ("call:f{a{}", [("f", "{}")]),
    ],
)
def test_sections_mlx_lm_refuses_or_reads_differently(
    text: str, expected: list[tuple[str, str]]
) -> None:
    assert read(Gemma4Parser([]), list(text)) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("call:f{a:12", '{"a": 12}'),  # complete as far as it got
        ("call:f{a:[tru", '{"a": []}'),  # a partial literal is dropped
        (f"call:f{{a:{Q}x<|", '{"a": "x<|"}'),  # a delimiter that never came is text
        ("call:f{a:1,b", '{"a": 1}'),
        (f"call:f{{a:{{b:[1,{Q}c", '{"a": {"b": [1, "c"]}}'),
    ],
)
def test_a_cut_off_call_ends_as_far_as_it_got(text: str, expected: str) -> None:
    assert calls(feed([text])[1]) == [("f", expected)]
