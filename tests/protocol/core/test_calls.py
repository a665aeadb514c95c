"""Tool-call deltas assembled into whole calls (protocol.core.calls), the one assembly every
dialect's bodies and Ollama's streamed calls are made from; and the JSON-object check that
keeps numbers as written."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given
from hypothesis import strategies as st

from protocol.core.calls import Call, CallAssembler, assemble, call_input, call_text
from protocol.frames import ToolCallDelta


def opened(index: int, name: str, arguments: str = "") -> ToolCallDelta:
    return ToolCallDelta(index, arguments, id=f"call_{index}", name=name)


def piece(index: int, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index, arguments)


DELTAS = [
    opened(0, "get_weather", '{"city": '),
    piece(0, '"Paris"}'),
    opened(1, "get_time"),
    piece(1, '{"tz": "CET"}'),
]
CALLS = [
    Call(0, "call_0", "get_weather", '{"city": "Paris"}'),
    Call(1, "call_1", "get_time", '{"tz": "CET"}'),
]


def test_a_finished_answers_calls_are_whole_and_in_order() -> None:
    assert assemble(DELTAS) == CALLS
    assert assemble([]) == []


def test_a_call_is_given_out_once_the_next_one_opens() -> None:
    calls = CallAssembler()
    assert calls.feed(DELTAS[:2]) == []  # the first call may go on
    assert calls.feed(DELTAS[2:3]) == CALLS[:1]  # the second opened: the first is whole
    assert calls.feed(DELTAS[3:]) == []
    assert calls.flush() == CALLS[1:]
    assert calls.flush() == []  # nothing is given out twice


@given(st.lists(st.integers(0, len(DELTAS)), max_size=6))
def test_any_split_of_the_deltas_gives_the_same_calls(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(DELTAS)]
    calls = CallAssembler()
    got: list[Call] = []
    for start, end in itertools.pairwise(bounds):
        got += calls.feed(DELTAS[start:end])
    assert got + calls.flush() == CALLS


def test_a_call_whose_opening_never_came_has_no_id() -> None:
    assert assemble([piece(0, '{"a": 1}')]) == [Call(0, None, "", '{"a": 1}')]


def test_numbers_reach_the_client_as_written() -> None:
    arguments = '{"n": 18446744073709551616, "x": 1.10}'
    fragment = call_input(arguments)
    assert fragment is not None
    assert orjson.dumps({"input": fragment}) == b'{"input":' + arguments.encode() + b"}"


def test_arguments_that_are_no_object_go_out_as_text() -> None:
    assert call_input('{"city": "Par') is None  # cut short
    assert call_input("[1, 2]") is None
    assert call_text("f", '{"city": "Par') == '{"name": "f", "arguments": {"city": "Par}'
