"""OpenAI's Responses API end to end: the official `openai` SDK's `client.responses.create`
(streamed and not) and `client.responses.stream` against a real gateway and a real runner on
the built-in model. At temperature 0 the text and the usage are the Chat Completions answer's
for the same conversation; function calls, their outputs given back (by hand and through
previous_response_id), structured outputs, stored responses and the raw SSE are checked too.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
)

from runner import demo_model
from tests.support import UNIT, Gateway, Process

MODEL = "orchard-demo"
QUESTION = "Tell me about pear trees."
INSTRUCTIONS = "You are a gardener."
TOOLS: Any = [
    {"type": "function", **tool["function"], "strict": False} for tool in demo_model.TOOL_DEMO_TOOLS
]
CHAT_TOOLS: Any = list(demo_model.TOOL_DEMO_TOOLS)
CALL_MESSAGES: Any = list(demo_model.TOOL_DEMO_MESSAGES)
EXPECTED_CALL = demo_model.TOOL_DEMO_CALLS[0]


def chat(client: openai.OpenAI, messages: Any, max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **extra
    )


def assert_usage_is_chats(response: Response, completion: Any) -> None:
    """The response's usage is the chat completion's, which ran just before it on the same
    prompt: so the prefix cache held all of that prompt but its last token."""
    usage, expected = response.usage, completion.usage
    assert usage is not None
    assert usage.input_tokens == expected.prompt_tokens
    assert usage.output_tokens == expected.completion_tokens
    assert usage.total_tokens == expected.total_tokens
    assert usage.output_tokens_details.reasoning_tokens == (
        expected.completion_tokens_details.reasoning_tokens
    )
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1


@pytest.mark.parametrize("max_tokens", [16, 200])
def test_not_streamed_is_the_chat_answer(client: openai.OpenAI, max_tokens: int) -> None:
    completion = chat(
        client,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        max_tokens,
    )
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        instructions=INSTRUCTIONS,
        temperature=0,
        max_output_tokens=max_tokens,
    )
    (choice,) = completion.choices
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert response.output_text == choice.message.content
    (message,) = response.output
    assert isinstance(message, ResponseOutputMessage)
    assert message.id.startswith("msg_")
    part = message.content[0]
    assert isinstance(part, ResponseOutputText)
    assert (part.annotations, part.logprobs) == ([], [])
    assert_usage_is_chats(response, completion)
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"
    else:
        assert choice.finish_reason == "stop"
        assert (response.status, message.status) == ("completed", "completed")
        assert response.completed_at is not None
    assert (response.instructions, response.max_output_tokens) == (INSTRUCTIONS, max_tokens)
    assert response.temperature == 0.0
    assert response.to_dict()["store"] is True  # not a field of the SDK's type: an extra


def test_streamed_is_the_same_answer(client: openai.OpenAI) -> None:
    plain = client.responses.create(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16
    )
    events = list(
        client.responses.create(
            model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16, stream=True
        )
    )
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if plain.status == "completed" else "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert "".join(deltas) == plain.output_text
    final: Any = events[-1]
    assert final.response.output_text == plain.output_text
    assert final.response.status == plain.status
    streamed, expected = final.response.usage, plain.usage
    assert expected is not None
    assert (streamed.input_tokens, streamed.output_tokens, streamed.total_tokens) == (
        expected.input_tokens,
        expected.output_tokens,
        expected.total_tokens,
    )
    # The stream repeated the plain response's prompt: all of it but its last token cached.
    assert streamed.input_tokens_details.cached_tokens == expected.input_tokens - 1


def test_the_stream_helper_with_a_function_call(client: openai.OpenAI) -> None:
    completion = chat(client, CALL_MESSAGES, 80, tools=CHAT_TOOLS)
    with client.responses.stream(
        model=MODEL, input=CALL_MESSAGES, tools=TOOLS, temperature=0, max_output_tokens=80
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed"
    (call,) = final.output
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.id is not None
    assert call.id.startswith("fc_")
    assert (call.name, json.loads(call.arguments)) == (
        EXPECTED_CALL["name"],
        EXPECTED_CALL["arguments"],
    )
    types = [event.type for event in events]
    assert types[2] == "response.output_item.added"
    assert "response.function_call_arguments.delta" in types
    done = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDoneEvent)]
    assert [(e.to_dict()["name"], e.arguments) for e in done] == [(call.name, call.arguments)]
    assert isinstance(events[-1], ResponseCompletedEvent)
    assert_usage_is_chats(final, completion)
    (chat_call,) = completion.choices[0].message.tool_calls
    assert call.arguments == chat_call.function.arguments


def test_function_output_by_hand_and_by_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input=CALL_MESSAGES, tools=TOOLS, temperature=0, max_output_tokens=80
    )
    (call,) = first.output
    assert isinstance(call, ResponseFunctionToolCall)
    given_back: Any = [item.model_dump(exclude_none=True) for item in first.output]
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    completion = chat(
        client,
        [
            *CALL_MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        20,
        tools=CHAT_TOOLS,
    )
    by_hand = client.responses.create(
        model=MODEL,
        input=[*CALL_MESSAGES, *given_back, result],
        tools=TOOLS,
        temperature=0,
        max_output_tokens=20,
        store=False,
    )
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=TOOLS,
        temperature=0,
        max_output_tokens=20,
    )
    for response in (by_hand, chained):
        assert_usage_is_chats(response, completion)
        assert response.output_text == (completion.choices[0].message.content or "")
    assert chained.previous_response_id == first.id
    assert by_hand.to_dict()["store"] is False


def test_stored_and_retrieved(client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16, metadata={"k": "v"}
    )
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    assert retrieved.metadata == {"k": "v"}
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "enum": ["apple", "pear", "plum"]}},
        "required": ["fruit"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "fruit", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=60,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None
    assert response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_unknown_and_unsupported_fields_are_400s_naming_them(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", extra_body={"logit_bias": {"1": 2}})
    assert caught.value.param == "logit_bias"
    assert caught.value.code == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert (caught.value.param, caught.value.code) == (
        "background",
        "invalid_parameter_combination",
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert caught.value.param == "tools[0].type"


def test_raw_sse_has_event_lines_and_no_done(stack: tuple[Gateway, Process]) -> None:
    resp = httpx.post(
        f"{stack[0].base}/v1/responses",
        json={"model": MODEL, "input": QUESTION, "max_output_tokens": 16, "stream": True},
        timeout=30 * UNIT,
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    blocks = resp.content.split(b"\n\n")
    assert blocks[-1] == b""
    events = []
    for block in blocks[:-1]:
        head, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        events.append(event)
    assert events[0]["type"] == "response.created"
    final = events[-1]
    assert final["type"] == f"response.{final['response']['status']}"  # completed or incomplete
    assert b"[DONE]" not in resp.content


def test_reasoning_effort_none_is_the_chats(client: openai.OpenAI) -> None:
    # The built-in model has think markers: "none" turns thinking off through its template,
    # which adds an empty think span to the prompt, as the chat's reasoning_effort does.
    default = chat(client, [{"role": "user", "content": QUESTION}], 16)
    completion = chat(client, [{"role": "user", "content": QUESTION}], 16, reasoning_effort="none")
    response = client.responses.create(
        model=MODEL, input=QUESTION, reasoning={"effort": "none"}, temperature=0,
        max_output_tokens=16,
    )  # fmt: skip
    assert_usage_is_chats(response, completion)
    assert response.usage is not None
    assert response.usage.input_tokens != default.usage.prompt_tokens
    assert response.output_text == completion.choices[0].message.content
    assert response.reasoning is not None
    assert response.reasoning.effort == "none"


def test_input_tokens_are_the_prompt_a_create_would_run(client: openai.OpenAI) -> None:
    """`responses.input_tokens.count` (the SDK's own call) counts exactly the prompt a create
    with the same fields runs: its usage's input_tokens, through the model's chat template,
    with tools and with a previous_response_id chain."""
    plain = client.responses.input_tokens.count(
        model=MODEL, input=QUESTION, instructions=INSTRUCTIONS
    )
    created = client.responses.create(
        model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=16
    )
    assert plain.object == "response.input_tokens"
    assert created.usage is not None
    assert plain.input_tokens == created.usage.input_tokens
    with_tools = client.responses.input_tokens.count(model=MODEL, input=CALL_MESSAGES, tools=TOOLS)
    called = client.responses.create(
        model=MODEL, input=CALL_MESSAGES, tools=TOOLS, temperature=0, max_output_tokens=80
    )
    assert called.usage is not None
    assert with_tools.input_tokens == called.usage.input_tokens
    (call,) = called.output
    assert isinstance(call, ResponseFunctionToolCall)
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    chained = client.responses.input_tokens.count(
        model=MODEL, previous_response_id=called.id, input=[result], tools=TOOLS
    )
    continued = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[result],
        tools=TOOLS,
        temperature=0,
        max_output_tokens=16,
    )
    assert continued.usage is not None
    assert chained.input_tokens == continued.usage.input_tokens > with_tools.input_tokens


def test_input_tokens_refuses_what_it_does_not_take(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_tokens.count(
            model=MODEL, input=QUESTION, extra_body={"max_output_tokens": 5}
        )
    assert caught.value.body == {
        "message": "Unrecognized request argument supplied: max_output_tokens",
        "type": "invalid_request_error",
        "param": "max_output_tokens",
        "code": "unknown_parameter",
    }
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="no-such-model", input=QUESTION)


def test_the_penalties_are_shown_as_sampled(client: openai.OpenAI) -> None:
    """presence_penalty and frequency_penalty (the open Responses specification's fields):
    the request's values, or 0, in the response object and its stored copy."""
    created = client.responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=16,
        extra_body={"presence_penalty": 0.5, "frequency_penalty": -0.25},
    )
    given = created.to_dict()
    assert (given["presence_penalty"], given["frequency_penalty"]) == (0.5, -0.25)
    stored = client.responses.retrieve(created.id).to_dict()
    assert (stored["presence_penalty"], stored["frequency_penalty"]) == (0.5, -0.25)
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16).to_dict()
    assert (plain["presence_penalty"], plain["frequency_penalty"]) == (0.0, 0.0)


def test_input_items_are_the_conversation_a_response_ran_on(
    client: openai.OpenAI, stack: tuple[Gateway, Process]
) -> None:
    """`responses.input_items.list`: a chained response's items are the earlier turn's input,
    its function call and this turn's output, newest first unless asc, paged by `after`."""
    first = client.responses.create(
        model=MODEL, input=CALL_MESSAGES, tools=TOOLS, temperature=0, max_output_tokens=80
    )
    (call,) = first.output
    assert isinstance(call, ResponseFunctionToolCall)
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[result], max_output_tokens=16
    )
    listed = client.responses.input_items.list(second.id, order="asc")
    items = [item.to_dict() for item in listed.data]
    assert [item["type"] for item in items] == ["message", "function_call", "function_call_output"]
    asked, called, answered = items
    assert asked["role"] == "user"
    assert asked["content"] == [{"type": "input_text", "text": CALL_MESSAGES[0]["content"]}]
    assert (called["call_id"], called["name"], called["arguments"]) == (
        call.call_id,
        call.name,
        call.arguments,
    )
    assert (answered["call_id"], answered["output"]) == (call.call_id, "Sunny")
    assert len({item["id"] for item in items}) == 3
    raw = httpx.get(f"{stack[0].base}/v1/responses/{second.id}/input_items?order=asc")
    assert raw.json() == {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"],
        "last_id": items[2]["id"],
        "has_more": False,
    }
    newest_first = client.responses.input_items.list(second.id)
    assert [item.id for item in newest_first.data] == [item["id"] for item in reversed(items)]
    one_by_one = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert one_by_one.has_more is True
    assert [item.id for item in one_by_one] == [item["id"] for item in items]  # every page
    assert [item.to_dict()["type"] for item in client.responses.input_items.list(first.id)] == [
        "message"
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(second.id, after="msg_nowhere")
    assert caught.value.param == "after"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nowhere")


def test_a_compacted_conversation_continues(client: openai.OpenAI) -> None:
    """`responses.compact` (the SDK's call): the user's messages and a compaction item with
    the model's summary; a later create takes them as its input, and so does a count; an
    edited compaction item is a 400 naming it; a chain compacts by previous_response_id."""
    conversation: Any = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "They grow in orchards."},
        {"role": "user", "content": "How tall?"},
    ]
    # The raw body: the SDK's CompactedResponse reads a user message in `output` as an output
    # message (OpenAI's own example has user messages there) and warns when dumping it.
    raw = client.responses.with_raw_response.compact(model=MODEL, input=conversation)
    shown: Any = orjson.loads(raw.content)
    assert raw.parse().object == "response.compaction"
    assert shown["object"] == "response.compaction"
    assert [item["type"] for item in shown["output"]] == ["message", "message", "compaction"]
    assert [item["content"][0]["text"] for item in shown["output"][:2]] == [
        QUESTION,
        "How tall?",
    ]
    assert shown["usage"]["input_tokens"] > 0
    assert shown["usage"]["output_tokens"] > 0
    given_back: Any = [*shown["output"], {"role": "user", "content": "And their fruit?"}]
    counted = client.responses.input_tokens.count(model=MODEL, input=given_back)
    continued = client.responses.create(model=MODEL, input=given_back, max_output_tokens=16)
    assert continued.status in ("completed", "incomplete")
    assert continued.usage is not None
    assert continued.usage.input_tokens == counted.input_tokens
    edited = [*given_back]
    edited[2] = {**edited[2], "encrypted_content": edited[2]["encrypted_content"][::-1]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=edited, max_output_tokens=16)
    assert caught.value.param == "input[2].encrypted_content"
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16)
    chained: Any = orjson.loads(
        client.responses.with_raw_response.compact(
            model=MODEL, previous_response_id=first.id
        ).content
    )
    assert [item["type"] for item in chained["output"]] == ["message", "compaction"]
    assert chained["output"][0]["content"][0]["text"] == QUESTION
