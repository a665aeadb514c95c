"""ToolCallSplitter: tool calls taken out of a model's content as it streams, no mlx."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.tool_parsers import qwen3_coder

from protocol.frames import ToolCallDelta
from runner.tool_calls import ToolCallSplitter
from runner.tool_formats import json_tools
from runner.tool_formats.whole import whole_format

START, END = "<tool_call>", "</tool_call>"
CALL = (
    '<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris", "n": [1, {"a": "}\\""}]}}\n</tool_call>'
)


def splitter() -> ToolCallSplitter:
    return ToolCallSplitter(json_tools.FORMAT)


def run(
    pieces: list[str], split: ToolCallSplitter | None = None
) -> tuple[str, list[ToolCallDelta]]:
    split = split or splitter()
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        text, more = split.feed(piece)
        content.append(text)
        deltas.extend(more)
    text, more = split.flush()
    return "".join(content) + text, deltas + more


def calls(deltas: list[ToolCallDelta]) -> list[tuple[str, Any]]:
    """(name, parsed arguments) per call index, checking the delta rules on the way: a call's
    first delta has the id and name and empty arguments, later ones only arguments."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.index not in names:
            assert delta.id is not None
            assert delta.id.startswith("call_")
            assert delta.name is not None
            assert delta.arguments == ""
            names[delta.index] = delta.name
            arguments[delta.index] = ""
        else:
            assert (delta.id, delta.name) == (None, None)
            arguments[delta.index] += delta.arguments
    assert sorted(names) == list(range(len(names)))
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)]


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
def test_a_call_is_streamed_however_the_text_is_split(size: int) -> None:
    content, deltas = run(pieces_of("Sure." + CALL + "\n", size))
    assert content == "Sure."
    assert calls(deltas) == [("get_weather", {"city": "Paris", "n": [1, {"a": '}"'}]})]


def test_arguments_are_streamed_as_they_come_not_at_the_end() -> None:
    split = splitter()
    head = '<tool_call>\n{"name": "f", "arguments": {"city": "Pa'
    text, deltas = split.feed(head)
    assert text == ""
    assert [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "f", ""),
        (0, None, '{"city": "Pa'),
    ]
    text, deltas = split.feed('ris"}}\n</tool_call>')
    assert (text, [(d.index, d.name, d.arguments) for d in deltas]) == (
        "",
        [(0, None, 'ris"}')],
    )
    assert split.calls == 1


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_parallel_calls_get_indexes_in_order(size: int) -> None:
    text = CALL + "\n" + '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    content, deltas = run(pieces_of(text, size))
    assert content == ""
    assert [name for name, _ in calls(deltas)] == ["get_weather", "time"]
    ids = [d.id for d in deltas if d.id is not None]
    assert len(set(ids)) == 2


def test_text_around_calls_is_content_but_whitespace_after_them_is_not() -> None:
    content, deltas = run(["Let me check. ", CALL, "\n\n"])
    assert content == "Let me check. "
    content, deltas = run([CALL, "\n Done."])
    assert content == "\n Done."
    assert len(calls(deltas)) == 1


def test_a_partial_marker_is_held_then_shown_when_it_is_not_one() -> None:
    split = splitter()
    assert split.feed("a <tool_c") == ("a ", [])
    assert split.feed("at>") == ("<tool_cat>", [])
    assert split.flush() == ("", [])
    assert split.calls == 0


def test_a_call_cut_off_by_max_tokens_is_sent_as_far_as_it_got() -> None:
    content, deltas = run(['<tool_call>\n{"name": "f", "arguments": {"x": "ab'])
    assert content == ""
    assert [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"x": "ab')]


def test_a_call_in_another_key_order_is_parsed_whole_at_its_end() -> None:
    split = splitter()
    text, deltas = split.feed('<tool_call>{"arguments": {"x": 1}, "name": "f"}')
    assert (text, deltas) == ("", [])
    text, deltas = split.feed("</tool_call>")
    assert text == ""
    assert calls(deltas) == [("f", {"x": 1})]


def test_an_unparseable_call_is_shown_as_content_without_its_markers_and_is_no_call() -> None:
    split = splitter()
    content, deltas = run(["hi <tool_call>not json</tool_call> bye"], split)
    assert (content, deltas, split.calls) == ("hi not json bye", [], 0)


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_a_stray_end_marker_is_not_shown(size: int) -> None:
    # Models write one on the turn after a tool result, with no call open.
    content, deltas = run(pieces_of("</tool_call>The weather is fine.</tool_call>", size))
    assert (content, deltas) == ("The weather is fine.", [])


@pytest.mark.parametrize(
    ("tail", "shown"), [("</", ""), ("</tool_ca", ""), ("\n</tool_call", "\n"), ("<", "<")]
)
def test_an_end_marker_cut_off_at_the_end_is_not_shown(tail: str, shown: str) -> None:
    # "<" may start either marker, or be text: it is shown.
    assert run(["Fine.", tail]) == ("Fine." + shown, [])


def test_a_cut_off_start_marker_that_may_be_text_is_shown() -> None:
    assert run(["1 <"]) == ("1 <", [])
    assert run(["a <tool_c"]) == ("a <tool_c", [])


def test_other_formats_go_through_the_models_parser() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    format = whole_format(
        "qwen3_coder",
        qwen3_coder.tool_call_start,
        qwen3_coder.tool_call_end,
        qwen3_coder.parse_tool_call,
    )
    split = ToolCallSplitter(format, tools)
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    content, deltas = run(pieces_of(text, 3), split)
    assert content == ""
    assert calls(deltas) == [("get_weather", {"city": "Paris"})]


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "name": st.from_regex(r"[a-zA-Z0-9_-]{1,10}", fullmatch=True),
                "arguments": st.dictionaries(
                    st.text(max_size=5),
                    st.recursive(
                        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                        lambda inner: (
                            st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(max_size=4), inner, max_size=3)
                        ),
                        max_leaves=6,
                    ),
                    max_size=4,
                ),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    st.integers(1, 12),
)
def test_any_json_calls_round_trip(items: list[dict[str, Any]], size: int) -> None:
    text = "".join(
        f"{START}\n{json.dumps(item, ensure_ascii=size % 2 == 0)}\n{END}\n" for item in items
    )
    content, deltas = run(pieces_of(text, size))
    assert content == ""
    assert calls(deltas) == [(item["name"], item["arguments"]) for item in items]


def test_a_name_with_a_broken_escape_is_no_call_and_no_crash() -> None:
    split = splitter()
    content, deltas = run(['<tool_call>{"name": "f\\u12", "arguments": {}}</tool_call>'], split)
    assert (deltas, split.calls) == ([], 0)
    assert content == '{"name": "f\\u12", "arguments": {}}'
