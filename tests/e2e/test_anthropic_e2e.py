"""Anthropic's Messages API end to end: the official `anthropic` SDK (`messages.create`,
`messages.stream` with its text_stream and get_final_message, `messages.count_tokens`) against
a real gateway and a real runner on the built-in model. At temperature 0 every answer is the
Chat Completions answer (the `openai` SDK) to the same conversation: the same text, the same
tool calls, and usage that is the runner's (input_tokens + cache_read_input_tokens is the chat's
prompt_tokens, output_tokens its completion_tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from runner import demo_model
from tests.support import Gateway, Process

MODEL = "orchard-demo"
GREEDY: Any = {"temperature": 0}
USER: Any = [{"role": "user", "content": "Tell me about pear trees."}]
CHAT_TOOLS: Any = list(demo_model.TOOL_DEMO_TOOLS)
TOOLS: Any = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in demo_model.TOOL_DEMO_TOOLS
]
CALL_MESSAGES: Any = list(demo_model.TOOL_DEMO_MESSAGES)
EXPECTED_CALLS = [(c["name"], c["arguments"]) for c in demo_model.TOOL_DEMO_CALLS]


@pytest.fixture(scope="module")
def client(stack: tuple[Gateway, Process]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack[0].base, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def chat(stack: tuple[Gateway, Process]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack[0].base}/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat_answer(chat: openai.OpenAI, messages: Any, max_tokens: int, **extra: Any) -> Any:
    return chat.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )


def assert_usage_is_the_runners(usage: anthropic.types.Usage, chat_usage: Any) -> None:
    """The message's usage is the chat completion's, which ran just before it on the same
    prompt: the prefix cache held all of that prompt but its last token, and Anthropic counts
    the cached part apart from input_tokens."""
    assert usage.output_tokens == chat_usage.completion_tokens
    assert usage.cache_read_input_tokens == chat_usage.prompt_tokens - 1
    assert usage.input_tokens == 1
    assert usage.cache_creation_input_tokens == 0


def test_a_message_is_the_chat_answer(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    expected = chat_answer(chat, USER, 12)
    message = client.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY)
    assert message.id.startswith("msg_")
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].type == "text"
    assert message.content[0].text == expected.choices[0].message.content
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert_usage_is_the_runners(message.usage, expected.usage)
    # The same prompt again: the runner's prefix cache serves it all but its last token.
    again = client.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY)
    assert_usage_is_the_runners(again.usage, expected.usage)


def test_a_streamed_message_is_the_chat_answer(
    client: anthropic.Anthropic, chat: openai.OpenAI
) -> None:
    expected = chat_answer(chat, USER, 12)
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.choices[0].message.content
    assert [block.type for block in final.content] == ["text"]
    assert final.content[0].type == "text"
    assert final.content[0].text == text
    assert final.stop_reason == "max_tokens"
    assert_usage_is_the_runners(final.usage, expected.usage)


def test_raw_events_in_anthropics_order(client: anthropic.Anthropic) -> None:
    with client.messages.create(
        model=MODEL, max_tokens=4, messages=USER, stream=True, extra_body=GREEDY
    ) as events:
        kinds = [event.type for event in events]
    deltas = len(kinds) - 5
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_call(client: anthropic.Anthropic, chat: openai.OpenAI, streamed: bool) -> None:
    expected = chat_answer(chat, CALL_MESSAGES, 80, tools=CHAT_TOOLS)
    request: Any = {
        "model": MODEL,
        "max_tokens": 80,
        "messages": CALL_MESSAGES,
        "tools": TOOLS,
        "extra_body": GREEDY,
    }
    if streamed:
        with client.messages.stream(**request) as stream:
            partial = [e.partial_json for e in stream if e.type == "input_json"]
            message = stream.get_final_message()
        assert partial  # the input streamed (in how many pieces: the test below)
    else:
        message = client.messages.create(**request)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == EXPECTED_CALLS
    assert all(u.id.startswith("toolu_") for u in uses)
    assert message.stop_reason == "tool_use"
    assert_usage_is_the_runners(message.usage, expected.usage)


@pytest.mark.timing  # a pace: tokens that pile up in a busy runner go out as one chunk
def test_a_tool_calls_input_streams_as_it_is_generated(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL, max_tokens=80, messages=CALL_MESSAGES, tools=TOOLS, extra_body=GREEDY
    ) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]
    assert len(partial) > 1


def test_a_tool_result_is_the_chats_tool_message(
    client: anthropic.Anthropic, chat: openai.OpenAI
) -> None:
    """The same conversation in both dialects is the same prompt, so the same answer."""
    call = demo_model.TOOL_DEMO_CALLS[0]
    chat_history: Any = [
        *CALL_MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
    ]
    history: Any = [
        *CALL_MESSAGES,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": call["name"],
                    "input": call["arguments"],
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}
            ],
        },
    ]
    expected = chat_answer(chat, chat_history, 10, tools=CHAT_TOOLS)
    message = client.messages.create(
        model=MODEL, max_tokens=10, messages=history, tools=TOOLS, extra_body=GREEDY
    )
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == (expected.choices[0].message.content or "")
    assert_usage_is_the_runners(message.usage, expected.usage)
    count = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert count.input_tokens == expected.usage.prompt_tokens


def test_thinking_off_and_count_tokens(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    plain = chat_answer(chat, USER, 1)
    off = chat_answer(chat, USER, 1, reasoning_effort="none")
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens  # the empty think span
    assert client.messages.count_tokens(model=MODEL, messages=USER).input_tokens == (
        plain.usage.prompt_tokens
    )
    disabled = client.messages.count_tokens(
        model=MODEL, messages=USER, thinking={"type": "disabled"}
    )
    assert disabled.input_tokens == off.usage.prompt_tokens
    enabled = client.messages.count_tokens(
        model=MODEL, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert enabled.input_tokens == plain.usage.prompt_tokens
    message = client.messages.create(
        model=MODEL, max_tokens=1, messages=USER, thinking={"type": "disabled"}
    )
    assert_usage_is_the_runners(message.usage, off.usage)


def test_system_prompt_is_the_chats(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    expected = chat_answer(chat, [{"role": "system", "content": "You are a gardener."}, *USER], 6)
    message = client.messages.create(
        model=MODEL,
        max_tokens=6,
        system=[{"type": "text", "text": "You are a gardener."}],
        messages=USER,
        extra_body=GREEDY,
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == expected.choices[0].message.content
    assert_usage_is_the_runners(message.usage, expected.usage)


def test_a_stop_sequence_is_named(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    text = chat_answer(chat, USER, 12).choices[0].message.content
    assert len(text) >= 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    before = text[: text.index(stop)]
    message = client.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=USER,
        stop_sequences=["\x00never", stop],
        extra_body=GREEDY,
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in message.content if b.type == "text") == before
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=USER, stop_sequences=[stop], extra_body=GREEDY
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == before
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    # Ended by the model or the length: no stop sequence.
    plain = client.messages.create(
        model=MODEL, max_tokens=3, messages=USER, stop_sequences=["\x00never"], extra_body=GREEDY
    )
    assert (plain.stop_reason, plain.stop_sequence) == ("max_tokens", None)


def test_refusals_with_the_sdk(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="bogus") as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=USER, extra_body={"bogus": 1})
    assert isinstance(err.value.body, dict)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=USER)
