"""A stored response's input items (protocol.openai.responses.items): each message as its
OpenAI item, ids given once, and the list's query."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from protocol.core.errors import ApiError
from protocol.frames import Message, ToolCall
from protocol.openai.pages import PageQuery
from protocol.openai.responses.items import input_items, parse_input_items_query


def ids() -> Callable[[str], str]:
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{next(counter)}"


def test_every_message_is_its_item() -> None:
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    messages = (
        Message("developer", "Be brief."),
        Message("user", "Weather?"),
        Message("assistant", "", tool_calls=(call,), reasoning="They want weather."),
        Message("tool", "Sunny", tool_call_id="call_1"),
        Message("assistant", "It is sunny."),
    )
    assert input_items(messages, ids()) == [
        {
            "id": "msg_0",
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be brief."}],
            "status": "completed",
        },
        {
            "id": "msg_1",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather?"}],
            "status": "completed",
        },
        {
            "id": "rs_2",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "They want weather."}],
            "status": "completed",
        },
        {
            "id": "fc_3",
            "type": "function_call",
            "status": "completed",
            "arguments": '{"city": "Paris"}',
            "call_id": "call_1",
            "name": "get_weather",
        },
        {
            "id": "fco_4",
            "type": "function_call_output",
            "call_id": "call_1",
            "output": "Sunny",
            "status": "completed",
        },
        {
            "id": "msg_5",
            "type": "message",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}
            ],
            "role": "assistant",
        },
    ]


def test_the_query_is_newest_first_unless_asked() -> None:
    assert parse_input_items_query([]) == PageQuery(order="desc")
    assert parse_input_items_query([("order", "asc"), ("limit", "5"), ("after", "msg_1")]) == (
        PageQuery(after="msg_1", limit=5, order="asc")
    )
    assert parse_input_items_query([("include", "")]) == PageQuery(order="desc")


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ([("limit", "101")], "limit", "integer_above_max_value"),
        ([("order", "up")], "order", "invalid_value"),
        ([("include", "message.output_text.logprobs")], "include", "unsupported_value"),
        ([("stream", "true")], "stream", "unknown_parameter"),
        ([("limit", "1"), ("limit", "2")], "limit", "invalid_value"),
    ],
)
def test_a_bad_query_is_a_400_naming_it(
    params: list[tuple[str, str]], param: str, code: str
) -> None:
    with pytest.raises(ApiError) as caught:
        parse_input_items_query(params)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)
