"""The pythonic section parser (LFM2): `[f(city="Paris", n=3)]` turned into JSON as it streams."""

from __future__ import annotations

import ast
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import pythonic

from protocol.frames import ToolCallDelta
from runner.tool_formats.pythonic import FORMAT, PythonicParser
from tests.runner.tool_formats.support import (
    LONG,
    Num,
    assert_split_anywhere,
    calls,
    dump,
    exact,
    numbers,
    read,
    read_cut_off,
    split,
    stream,
    tricky_texts,
    written,
)


def feed(pieces: list[str]) -> tuple[PythonicParser, list[ToolCallDelta]]:
    parser = PythonicParser([])
    return parser, stream(parser, pieces)


class Str:
    """A string argument and how it is written: as the LFM2 template writes it (between
    double quotes, unescaped), or as valid Python with escapes (`repr` or JSON's)."""

    def __init__(self, value: str, style: str) -> None:
        self.value = value
        self.style = style

    def render(self) -> str:
        if self.style == "template":
            return f'"{self.value}"'
        if self.style == "json":
            return json.dumps(self.value)
        return repr(self.value)


def python(value: Any) -> str:
    """Python's `str()` of a value, as Jinja's `| string` renders it (numbers as written)."""
    if isinstance(value, Num):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {python(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(python(item) for item in value) + "]"
    return repr(value)


def render(value: Any) -> str:
    """The LFM2.5 template's `format_arg_value`: strings between quotes, mappings `tojson`,
    anything else `| string`."""
    if isinstance(value, Str):
        return value.render()
    if isinstance(value, dict):
        return dump(value)
    return python(value)


def written_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """What `exact` reads back from a call's arguments (a `Str` is an argument's value)."""
    return {
        key: value.value if isinstance(value, Str) else written(value)
        for key, value in arguments.items()
    }


TRICKY = ['"', "'", '"""', "\\", "\\n", "\n", "\t", "é", "😀", "<|tool_call_start|>",
          "<|tool_call_end|", ")", "]", "(", "[", ",", "=", "x=1", "True", "{", "}"]  # fmt: skip
texts = tricky_texts(TRICKY, size=6, count=5).filter(
    lambda s: FORMAT.end not in s and "\x00" not in s  # Python source has no NUL
)


@st.composite
def strings(draw: st.DrawFn) -> Str:
    value = draw(texts)
    # The template's form only where it is valid Python (no quote, backslash or line break).
    unescaped = not any(char in value for char in '"\\\n\r')
    styles = ["template", "json", "repr"] if unescaped else ["json", "repr"]
    return Str(value, draw(st.sampled_from(styles)))


nested = st.recursive(
    st.one_of(texts, numbers, st.booleans(), st.none()),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
values = st.one_of(strings(), numbers, st.booleans(), st.none(), nested)
keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}(\.[A-Za-z_][A-Za-z0-9_]{0,8})?", fullmatch=True)


@st.composite
def sections(draw: st.DrawFn) -> tuple[str, list[tuple[str, Any]], str]:
    """A section as the LFM2 template writes an assistant's calls, the calls, and a long
    string value of the first call's arguments."""
    calls_ = draw(
        st.lists(
            st.tuples(names, st.dictionaries(keys, values, max_size=4)), min_size=1, max_size=3
        )
    )
    long = draw(LONG)
    calls_[0][1]["long"] = Str(long, draw(st.sampled_from(["template", "json", "repr"])))
    rendered = (
        name + "(" + ", ".join(f"{k}={render(v)}" for k, v in args.items()) + ")"
        for name, args in calls_
    )
    return "[" + ", ".join(rendered) + "]", calls_, long


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
    assert [exact(args) for _, args in got] == [written_arguments(args) for _, args in expected]
    # mlx-lm's own path for valid Python (not its regex fallback, which reads one call).
    ast.parse(text, mode="eval")
    parsed = pythonic.parse_tool_call(text)
    parsed = parsed if isinstance(parsed, list) else [parsed]
    assert [json.loads(args) for _, args in got] == [
        json.loads(json.dumps(p["arguments"])) for p in parsed
    ]
    assert [name for name, _ in got] == [p["name"] for p in parsed]
    assert sum(d.index == 0 and d.name is None for d in deltas) >= 2
    assert got == calls(feed([text])[1])


FIXED = (
    '[get_weather(city=\'Pa\\\'ris\\n\\u00e9\\x41\\101\\N{BULLET}\', q="""tri"ple""" r\'\\d\','
    " n=123456789012345678901234567890, f=-1.50e+3, h=0x1F, u=1_000, ok=True, no=null,"
    ' nested={"a": [1, {"b": ")]"}], "c": (), 2: (1,)}, raw="say "hi" now"), other()]'
)
FIXED_CALLS = [
    (
        "get_weather",
        '{"city": "Pa\'ris\\néAA•", "q": "tri\\"ple\\\\d", "n": 123456789012345678901234567890,'
        ' "f": -1.50e+3, "h": 31, "u": 1000, "ok": true, "no": null,'
        ' "nested": {"a": [1, {"b": ")]"}], "c": [], "2": [1]}, "raw": "say \\"hi\\" now"}',
    ),
    ("other", "{}"),
]


def test_a_section_split_anywhere_gives_the_same_calls() -> None:
    assert_split_anywhere(PythonicParser, FIXED, FIXED_CALLS)


def test_a_section_cut_anywhere_closes_its_calls() -> None:
    for at in range(len(FIXED) + 1):
        got = read_cut_off(PythonicParser, list(FIXED[:at]))
        assert [name for name, _ in got] == [name for name, _ in FIXED_CALLS][: len(got)], at


def test_a_container_cut_off_keeps_its_complete_items() -> None:
    ((_, args),) = calls(feed(['[f(a="x", b={"k": [1, "tw'])[1])
    assert json.loads(args) == {"a": "x", "b": {"k": [1, "tw"]}}
    ((_, args),) = calls(feed(["[f(a=(1, 2"])[1])
    assert json.loads(args) == {"a": [1]}


def test_the_name_is_sent_at_the_paren_and_strings_as_they_come() -> None:
    parser = PythonicParser([])
    assert parser.feed("[get_wea") == []
    assert parser.feed("ther(") == [ToolCallDelta(0, "", name="get_weather")]
    assert parser.feed('city="Par') == [ToolCallDelta(0, '{"city": "Par')]
    # The closing quote waits for what follows it; an escape for its end.
    assert parser.feed('is"') == [ToolCallDelta(0, "is")]
    assert parser.feed(", n=4") == [ToolCallDelta(0, '"')]
    assert parser.feed('2, s="a\\') == [ToolCallDelta(0, ', "n": 42, "s": "a')]
    assert parser.feed('n"') == [ToolCallDelta(0, "\\n")]
    assert parser.feed(")]") == [ToolCallDelta(0, '"}')]
    assert parser.end() == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no call here", []),
        ("", []),
        ("[]", []),
        ('get_weather(city="Paris")', []),  # no list: mlx-lm reads none either
        # A positional argument is skipped (mlx-lm's regex fallback reads the others too).
        ('[f("x", 1, y=2)]', [("f", '{"y": 2}')]),
        ("[f(x=foo, y=1+2j, z={1, 2})]", [("f", '{"x": "foo", "y": "1+2j", "z": "{1, 2}"}')]),
        ("[get-weather(x=.5)]", [("get-weather", '{"x": 0.5}')]),
        ('[f(x="a\nb")]', [("f", '{"x": "a\\nb"}')]),
        ("[f(x=b'ab')]", [("f", '{"x": "b\'ab\'"}')]),
        ("[f(x='\\ud83d')]", [("f", '{"x": "\\ud83d"}')]),
    ],
)
def test_sections_mlx_lm_refuses_or_reads_differently(
    text: str, expected: list[tuple[str, str]]
) -> None:
    assert read(PythonicParser([]), list(text)) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[f(a=12", '{"a": 12}'),  # complete as far as it got
        ("[f(a=Tru", "{}"),  # a partial literal is dropped
        ('[f(a="x\\x4', '{"a": "x"}'),  # and a partial escape
        ("[f(a=1, b", '{"a": 1}'),
        ('[f(a={"b": [1, "c', '{"a": {"b": [1, "c"]}}'),
        ('[f(a="""x""', '{"a": "x"}'),
    ],
)
def test_a_cut_off_call_ends_as_far_as_it_got(text: str, expected: str) -> None:
    assert calls(feed([text])[1]) == [("f", expected)]


def test_a_number_json_cannot_hold_is_its_text() -> None:
    # 1_0e400 is infinite as a float: JSON has no such number, and "Infinity" is not JSON.
    parser = FORMAT.new_parser([])
    deltas = parser.feed("[f(x=1_0e400, y=2)]") + parser.end()
    arguments = "".join(delta.arguments for delta in deltas)
    assert json.loads(arguments) == {"x": "1_0e400", "y": 2}
