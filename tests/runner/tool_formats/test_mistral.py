"""Mistral's section parser: `name[ARGS]{...}` calls and the older JSON list, as they stream."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import mistral

from protocol.frames import ToolCallDelta
from runner.tool_formats.mistral import FORMAT, MistralParser
from tests.runner.tool_formats.support import (
    LONG,
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


def feed(pieces: list[str]) -> tuple[MistralParser, list[ToolCallDelta]]:
    parser = MistralParser([])
    return parser, stream(parser, pieces)


def plain(value: Any) -> Any:
    """mlx-lm's parse as the splitter sends it (through json)."""
    return json.loads(json.dumps(value))


TRICKY = ['"', "\\", "\n", "\t", "[TOOL_CALLS]", "[ARGS]", "x[ARGS]", "[CALL_ID]", "{", "}",
          "[", "]", ",", ":", "é", "😀", "\u2028", "true", "1e5", "\\u00e9", "/"]  # fmt: skip
strings = tricky_texts(TRICKY, size=6, count=5)
values = st.recursive(
    st.one_of(strings, numbers, st.booleans(), st.none()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(strings, inner, max_size=3)
    ),
    max_leaves=8,
)
# ASCII: mlx-lm's `regex` and Python's `re` disagree on what `\w` is past it (`²`).
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,12}", fullmatch=True)
arguments = st.dictionaries(strings, values, max_size=4)
SEPARATORS = [(", ", ": "), (",", ":"), (",\n  ", ": ")]


@st.composite
def sections(draw: st.DrawFn) -> tuple[str, list[tuple[str, Any]], str, bool]:
    """A section as the chat template writes an assistant's calls (after the first
    `[TOOL_CALLS]`), the calls, a long string value of the first call's arguments, and
    whether that one streams (not when its arguments come before its name)."""
    calls_ = draw(st.lists(st.tuples(names, arguments), min_size=1, max_size=3))
    long = draw(LONG)
    calls_[0][1]["long"] = long
    separators = draw(st.sampled_from(SEPARATORS))
    streams = True
    if draw(st.booleans()):
        text = "".join(f"[TOOL_CALLS]{name}[ARGS]{dump(args, separators)}" for name, args in calls_)
    else:
        # The older list form, members in either order, some with an id.
        items: list[str] = []
        for name, args in calls_:
            members = [f'"name": {json.dumps(name)}', f'"arguments": {dump(args, separators)}']
            if draw(st.booleans()):
                members.reverse()
                streams = streams and len(items) > 0
            if draw(st.booleans()):
                members.append('"id": "abc123def"')
            items.append("{" + ", ".join(members) + "}")
        text = "[TOOL_CALLS][" + ", ".join(items) + "]"
    return text[len(FORMAT.start) :], calls_, long, streams


@settings(max_examples=150, deadline=None)
@given(sections(), st.lists(st.integers(0, 10_000), max_size=8), st.integers(1, 39))
def test_calls_stream_as_mlx_lm_parses_them(
    section: tuple[str, list[tuple[str, Any]], str, bool], points: list[int], offset: int
) -> None:
    text, expected, long, streams = section
    inside = text.index(long) + offset  # a split inside the long value
    pieces = split(text, [p % (len(text) + 1) for p in points] + [inside])
    parser, deltas = feed(pieces)
    got = calls(deltas)
    assert parser.calls == len(expected)
    assert [name for name, _ in got] == [name for name, _ in expected]
    assert [exact(args) for _, args in got] == [written(args) for _, args in expected]
    parsed = mistral.parse_tool_call(text)
    parsed = parsed if isinstance(parsed, list) else [parsed]
    assert [json.loads(args) for _, args in got] == [plain(p["arguments"]) for p in parsed]
    assert [name for name, _ in got] == [p["name"] for p in parsed]
    if streams:
        assert sum(d.index == 0 and d.name is None for d in deltas) >= 2
    assert got == calls(feed([text])[1])


FIXED = (
    'get_weather[ARGS]{"city": "Pa\\"ris\\u00e9", "n": 123456789012345678901234567890, '
    '"f": -1.50e+3, "ok": true, "none": null, "nested": {"a": [1, {"b": "}]"}], "c": []}}'
    '[TOOL_CALLS]other[CALL_ID]abc123def[ARGS]{"q": "[TOOL_CALLS]x[ARGS]{}"} and text after'
)
FIXED_CALLS = [
    (
        "get_weather",
        '{"city": "Pa\\"ris\\u00e9", "n": 123456789012345678901234567890, "f": -1.50e+3, '
        '"ok": true, "none": null, "nested": {"a": [1, {"b": "}]"}], "c": []}}',
    ),
    ("other", '{"q": "[TOOL_CALLS]x[ARGS]{}"}'),
]
FIXED_LIST = (
    ' [{"arguments": {"city": "Paris", "n": 1.10}, "name": "get_weather", "id": "a1"}, '
    '{"name": "other", "arguments": "{\\"q\\": 2.50}"}, {"name": "none"}]'
)
FIXED_LIST_CALLS = [
    ("get_weather", '{"city": "Paris", "n": 1.10}'),
    ("other", '{"q": 2.50}'),
    ("none", "{}"),
]


@pytest.mark.parametrize(
    ("text", "expected"), [(FIXED, FIXED_CALLS), (FIXED_LIST, FIXED_LIST_CALLS)]
)
def test_a_section_split_anywhere_gives_the_same_calls(
    text: str, expected: list[tuple[str, str]]
) -> None:
    assert_split_anywhere(MistralParser, text, expected)


@pytest.mark.parametrize("text", [FIXED, FIXED_LIST])
def test_a_section_cut_anywhere_closes_its_calls(text: str) -> None:
    names = [name for name, _ in calls(feed([text])[1])]
    for at in range(len(text) + 1):
        got = read_cut_off(MistralParser, list(text[:at]))
        assert [name for name, _ in got] == names[: len(got)], at


def test_the_name_is_sent_at_args_and_the_arguments_as_they_come() -> None:
    parser = MistralParser([])
    assert parser.feed("get_wea") == []
    assert parser.feed("ther[ARGS]") == [ToolCallDelta(0, "", name="get_weather")]
    assert parser.feed('{"city": "Pa') == [ToolCallDelta(0, '{"city": "Pa')]
    # A key waits for its value, a number for its end.
    assert parser.feed('ris", "n": 1') == [ToolCallDelta(0, 'ris"')]
    assert parser.feed("2}") == [ToolCallDelta(0, ', "n": 12}')]
    assert parser.end() == []


def test_the_list_form_holds_arguments_until_the_name_comes() -> None:
    parser = MistralParser([])
    assert parser.feed('[{"arguments": {"a": "b"}, ') == []
    assert parser.feed('"name": "f"}]') == [
        ToolCallDelta(0, "", name="f"),
        ToolCallDelta(0, '{"a": "b"}'),
    ]


def test_the_name_before_call_id_is_the_name() -> None:
    # mlx-lm's header regex takes the id for the name here.
    assert calls(feed(['f[CALL_ID]abc123def[ARGS]{"a": 1}'])[1]) == [("f", '{"a": 1}')]
    assert mistral.parse_tool_call('f[CALL_ID]abc123def[ARGS]{"a": 1}')["name"] == "abc123def"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("just some text", []),
        ("", []),
        ("[]", []),
        ('[{"arguments": {"a": 1}}]', []),
        ('f[ARGS]"not an object"', [("f", "{}")]),
        ('f[ARGS]{"a": 1}\n\nThat is the call.', [("f", '{"a": 1}')]),
        ('f[ARGS]{"a": 1} [TOOL_CALLS] g [ARGS] {"b": 2}', [("f", '{"a": 1}'), ("g", '{"b": 2}')]),
        (
            '[{"name": "f", "arguments": {}}][TOOL_CALLS][{"name": "g", "arguments": {}}]',
            [("f", "{}"), ("g", "{}")],
        ),
        (
            'f[ARGS]{"a": "x\ny", "b": True, "c": NaN, "d": "\\q"}',
            [("f", '{"a": "x\\ny", "b": true, "c": "NaN", "d": "\\\\q"}')],
        ),
        ('f[ARGS]{"a": 1,}', [("f", '{"a": 1}')]),
        ('f[ARGS]{"a" 1}', [("f", "{}")]),
    ],
)
def test_sections_mlx_lm_refuses_or_reads_differently(
    text: str, expected: list[tuple[str, str]]
) -> None:
    assert read(MistralParser([]), list(text)) == expected


def test_numbers_stay_as_written() -> None:
    ((_, args),) = calls(feed(['f[ARGS]{"a": 18446744073709551617123, "b": 0.10, "c": 1E+2}'])[1])
    assert args == '{"a": 18446744073709551617123, "b": 0.10, "c": 1E+2}'
    assert json.loads(args)["a"] == 18446744073709551617123
    assert Decimal(exact(args)["b"][1]) == Decimal("0.10")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('f[ARGS]{"a": 12', '{"a": 12}'),  # complete as far as it got
        ('f[ARGS]{"a": [tru', '{"a": []}'),  # a partial literal is dropped
        ('f[ARGS]{"a": 1.', "{}"),
        ('f[ARGS]{"a": "x\\u00', '{"a": "x"}'),  # and a partial escape
        ('f[ARGS]{"a": 1, "b', '{"a": 1}'),
        ('f[ARGS]{"a": {"b": [1, "c', '{"a": {"b": [1, "c"]}}'),
    ],
)
def test_a_cut_off_call_ends_as_far_as_it_got(text: str, expected: str) -> None:
    assert calls(feed([text])[1]) == [("f", expected)]
