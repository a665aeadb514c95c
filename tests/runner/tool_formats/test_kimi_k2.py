"""Kimi-K2's calls streamed as raw JSON, checked against mlx-lm's own `kimi_k2` parser."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import kimi_k2

from protocol.frames import ToolCallDelta
from runner.tool_formats.kimi_k2 import FORMAT, JsonStreamer, KimiK2Parser
from tests.runner.tool_formats.support import (
    Num,
    assert_split_anywhere,
    batches,
    calls,
    dump,
    exact,
    read,
    split,
    tricky_texts,
)

BIG = 18446744073709551617  # 2**64 + 1: a float would round it
BEGIN, ARGUMENTS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def render(calls: list[tuple[str, str]]) -> str:
    """Calls (name, arguments JSON) as Kimi-K2's chat template writes them between
    `<|tool_calls_section_begin|>` and `<|tool_calls_section_end|>`."""
    return "".join(
        f"{BEGIN}functions.{name}:{index}{ARGUMENTS}{arguments}{END}"
        for index, (name, arguments) in enumerate(calls)
    )


def feed(text: str, cuts: list[int]) -> tuple[KimiK2Parser, list[list[ToolCallDelta]]]:
    """The section fed in pieces cut at `cuts`; the deltas of each feed, then of `end()`."""
    parser = KimiK2Parser([])
    return parser, batches(parser, split(text, cuts))


def whole(text: str, cuts: list[int] | None = None) -> list[tuple[str, str]]:
    return read(KimiK2Parser([]), split(text, cuts or []))


def reference(text: str) -> list[tuple[str, Any]]:
    return [(call["name"], call["arguments"]) for call in kimi_k2.parse_tool_call(text)]


ARGUMENTS_TEXT = (
    f'{{"city": "S\\u00e3o \\"Paulo\\" <|tool_call_e", "days": {BIG}, "ratio": 1.50, '
    '"deep": [{"a": null}, true, false, -0.5e-3, "\\\\"], "empty": {}, "none": []}'
)
EXAMPLE = render([("get_weather", ARGUMENTS_TEXT), ("get_time", "{}")])


def test_the_format() -> None:
    assert (FORMAT.parser, FORMAT.start, FORMAT.end, FORMAT.streamed) == (
        "kimi_k2",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        True,
    )
    assert isinstance(FORMAT.new_parser([]), KimiK2Parser)


def test_the_arguments_are_the_text_as_written() -> None:
    assert whole(EXAMPLE) == [("get_weather", ARGUMENTS_TEXT), ("get_time", "{}")]
    assert [(n, json.loads(a)) for n, a in whole(EXAMPLE)] == reference(EXAMPLE)


def test_split_at_every_character_the_deltas_are_the_same() -> None:
    assert_split_anywhere(
        KimiK2Parser, EXAMPLE, [("get_weather", ARGUMENTS_TEXT), ("get_time", "{}")]
    )


def test_the_name_comes_at_the_argument_marker_and_the_arguments_as_they_are_written() -> None:
    parser = KimiK2Parser([])
    assert parser.feed(f"{BEGIN}functions.get_weather:0<|tool_call_arg") == []
    assert parser.calls == 0
    assert parser.feed("ument_begin|>") == [ToolCallDelta(0, "", name="get_weather")]
    assert parser.calls == 1
    assert parser.feed('{"city"') == []  # a key is held until its value begins
    assert parser.feed(': "Pa') == [ToolCallDelta(0, '{"city": "Pa')]
    assert parser.feed('ris", "n": 1') == [ToolCallDelta(0, 'ris"')]
    assert parser.feed("2}<|tool_call_e") == [ToolCallDelta(0, ', "n": 12}')]
    assert parser.feed(f"nd|>{BEGIN}g:1{ARGUMENTS}") == [ToolCallDelta(1, "", name="g")]
    assert parser.end() == [ToolCallDelta(1, "{}")]


@pytest.mark.parametrize(
    ("head", "name"),
    [
        ("functions.get_weather:0", "get_weather"),
        (" functions.get_weather:12 \n", "get_weather"),
        ("get_weather:3", "get_weather"),
        ("functions.a:b:1", "a:b"),
        ("functions.no_index", "no_index"),  # mlx-lm cannot read it; the call is kept
    ],
)
def test_the_name_is_read_from_the_head(head: str, name: str) -> None:
    assert whole(f"{BEGIN}{head}{ARGUMENTS}{{}}{END}") == [(name, "{}")]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ("{'a': 1.50, 'b': True, 'c': None}", '{"a": 1.50, "b": true, "c": null}'),
        ('{"a": True}', '{"a": true}'),
        ('{"a": 1, "b": True}', '{"a": 1}'),  # cut at the last complete value
        ("[1, 2]", "{}"),  # arguments that are no object
        ('"text"', "{}"),
        ("{'a': {1, 2}}", "{}"),
        ("not json", "{}"),
        ("", "{}"),
        ('{"a": NaN}', "{}"),
        ('{"a": 01}', "{}"),
        ('{"a": 1.}', '{"a": 1.0}'),  # a Python float
        ('{"a": nul}', "{}"),
    ],
)
def test_arguments_that_are_not_json_are_read_whole(arguments: str, expected: str) -> None:
    assert whole(f"{BEGIN}functions.f:0{ARGUMENTS}{arguments}{END}") == [("f", expected)]


def test_text_around_and_between_calls_is_ignored() -> None:
    text = (
        f' \n{BEGIN}functions.f:0{ARGUMENTS} \n{{"a": 1}} \n{END}'
        f"\njunk{BEGIN}functions.g:1{ARGUMENTS}{{}}{END} x"
    )
    assert whole(text) == [("f", '{"a": 1}'), ("g", "{}")]
    assert [(n, json.loads(a)) for n, a in whole(text)] == reference(text)


def test_a_section_without_call_markers_is_one_call_as_mlx_lm_reads_it() -> None:
    text = f'functions.f:0{ARGUMENTS}{{"a": {BIG}}}'
    assert whole(text) == [("f", f'{{"a": {BIG}}}')]
    assert reference(text) == [("f", {"a": BIG})]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "  \n",
        "junk",
        f"{BEGIN}functions.f:0{END}",
        f"{BEGIN}functions.f:0",
        f"{BEGIN}{ARGUMENTS}{{}}{END}",
    ],
)
def test_a_section_with_no_call_is_no_call(text: str) -> None:
    parser, batches = feed(text, [])
    assert batches == [[] for _ in batches]
    assert parser.calls == 0


def test_a_call_without_arguments_is_skipped_and_the_next_read() -> None:
    text = f"{BEGIN}functions.f:0{END}{BEGIN}functions.g:1{ARGUMENTS}{{}}{END}"
    assert whole(text) == [("g", "{}")]


@pytest.mark.parametrize(
    ("cut", "completed"),
    [
        ("{", "{}"),
        ('{"ci', "{}"),
        ('{"city": ', "{}"),
        ('{"city": "Pa', '{"city": "Pa"}'),
        ('{"city": "Pa\\', '{"city": "Pa"}'),
        ('{"city": "Pa\\u00', '{"city": "Pa"}'),
        ('{"a": 1, "b": tru', '{"a": 1}'),
        ('{"a": 1, "b": [1, 2,', '{"a": 1, "b": [1, 2]}'),
        ('{"a": 1, "b": [1, 2', '{"a": 1, "b": [1]}'),  # a number may go on
        ('{"a": 1 ,', '{"a": 1 }'),
        ('{"a": {"b": [[], {', '{"a": {"b": [[], {}]}}'),
        ('{"a": {"b": [[], {"c"', '{"a": {"b": [[], {}]}}'),
        ('{"a": [1.5e', '{"a": []}'),
        ('{"a": "x"} trailing', '{"a": "x"}'),
        ('{"a": "x <|tool_call', '{"a": "x <|tool_call"}'),  # no marker after all: text
    ],
)
def test_arguments_cut_off_are_closed_as_far_as_they_got(cut: str, completed: str) -> None:
    streamer = JsonStreamer()
    assert streamer.feed(cut) + streamer.finish() == completed
    assert whole(f"{BEGIN}functions.f:0{ARGUMENTS}{cut}") == [("f", completed)]


def test_json_that_breaks_midway_is_closed_at_its_last_complete_value() -> None:
    assert whole(f'{BEGIN}functions.f:0{ARGUMENTS}{{"a": [1, "b"], "c": x}}{END}') == [
        ("f", '{"a": [1, "b"]}')
    ]


def test_cut_at_every_character_every_call_started_parses() -> None:
    full = [json.loads(arguments) for _, arguments in whole(EXAMPLE)]
    for size in range(len(EXAMPLE) + 1):
        calls = whole(EXAMPLE[:size])
        assert len(calls) <= 2
        for (_, arguments), complete in zip(calls, full, strict=False):
            parsed = json.loads(arguments)
            assert isinstance(parsed, dict)
            assert list(parsed) == list(complete)[: len(parsed)]
            city = parsed.get("city")
            assert city is None or complete["city"].startswith(city)


# Generated calls, rendered as the template renders them.

_TRICKY = [
    "<|tool_call_end|",
    "<|tool_call_e",
    "<|",
    "<",
    "}",
    "]",
    "{",
    ",",
    ":",
    "\\",
    '"',
    "\n",
    " ",
    "é",
    "日本",
    "😀",
    "\\n",
    "\u2028",
    "\x01",
]
_STRING = tricky_texts(_TRICKY, size=4, count=8).filter(
    lambda s: END not in s and BEGIN not in s and ARGUMENTS not in s
)
_KEY = st.one_of(st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,7}", fullmatch=True), _STRING)
_NAME = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,11}", fullmatch=True)
_INTEGER = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([BIG, -BIG, 2**64, 0]))
_DECIMAL = st.from_regex(
    r"-?(0|[1-9][0-9]{0,4})(\.[0-9]{1,22})?[eE][+-]?[0-9]{1,2}|-?(0|[1-9][0-9]{0,4})\.[0-9]{1,22}",
    fullmatch=True,
).map(Num)
_JSON = st.recursive(
    st.one_of(_INTEGER, _DECIMAL, st.booleans(), st.none(), _STRING),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEY, inner, max_size=3)),
    max_leaves=10,
)
_ARGUMENTS = st.dictionaries(_KEY, _JSON, max_size=5)


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.tuples(_NAME, _ARGUMENTS), min_size=1, max_size=3),
    compact=st.booleans(),
    escape=st.booleans(),
    long=st.booleans(),
    data=st.data(),
)
def test_generated_calls_stream_as_mlx_lm_reads_them(
    items: list[tuple[str, dict[str, Any]]],
    compact: bool,
    escape: bool,
    long: bool,
    data: st.DataObject,
) -> None:
    if long:
        name, arguments = items[0]
        rest = {key: value for key, value in arguments.items() if key != "long"}
        items[0] = (name, {"long": "word " * 8 + 'with "quotes" \\ and\nnewlines', **rest})
    separators = (",", ":") if compact else (", ", ": ")
    rendered = [
        (name, dump(arguments, separators, ensure_ascii=escape)) for name, arguments in items
    ]
    text = render(rendered)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    if long:
        start = text.index(ARGUMENTS) + len(ARGUMENTS) + len('{"long": "')
        cuts.append(data.draw(st.integers(start + 1, start + 40)))
    parser, batches = feed(text, cuts)
    got = calls([d for batch in batches for d in batch])
    assert parser.calls == len(items)
    assert [name for name, _ in got] == [name for name, _ in items]
    assert [(n, json.loads(a)) for n, a in got] == reference(text)
    assert [exact(a) for _, a in got] == [exact(a) for _, a in rendered]
    if long:
        first_call = [[d for d in batch if d.index == 0 and d.arguments] for batch in batches]
        assert sum(bool(batch) for batch in first_call) >= 2
