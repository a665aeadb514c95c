"""Tool calls and structured outputs end to end: the official `openai` SDK (its helpers too)
against a real gateway and a real runner on the built-in model, on both engines.

The built-in model is shaped to call its demo tool for a fixed conversation
(`runner.demo_model.TOOL_DEMO_*`), so tool_choice "auto" runs the model's own markup through
mlx-lm's parser; "required", a named function and response formats run the grammar."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from runner import demo_model
from tests.support import Gateway, Process, Stacks

MODEL = "orchard-demo"
TOOLS: Any = list(demo_model.TOOL_DEMO_TOOLS)
CALL_MESSAGES: Any = list(demo_model.TOOL_DEMO_MESSAGES)
PARALLEL_MESSAGES: Any = list(demo_model.TOOL_DEMO_PARALLEL_MESSAGES)
EXPECTED = [(c["name"], c["arguments"]) for c in demo_model.TOOL_DEMO_CALLS]
"""(name, arguments) of the call(s) greedy decoding makes for CALL_MESSAGES."""
EXPECTED_PARALLEL = [(c["name"], c["arguments"]) for c in demo_model.TOOL_DEMO_PARALLEL_CALLS]
PLAIN: Any = [{"role": "user", "content": "Tell me about pear trees."}]


@pytest.fixture(scope="module", params=["mlx", "mlx-batched"])
def stack(stacks: Stacks, request: pytest.FixtureRequest) -> tuple[Gateway, Process]:
    return stacks.get(request.param)


@pytest.fixture(scope="module")
def client(stack: tuple[Gateway, Process]) -> Iterator[openai.OpenAI]:
    gateway = stack[0]
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0) as c:
        yield c


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# --- tool_choice auto: the model's own markup -----------------------------------------------


def test_auto_tool_call_not_streamed(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=CALL_MESSAGES, tools=TOOLS, temperature=0, max_tokens=80
    )
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == EXPECTED
    for call in choice.message.tool_calls or []:
        assert call.type == "function"
        assert call.id.startswith("call_")


def streamed_call(client: openai.OpenAI) -> tuple[list[Any], list[Any]]:
    """The chunks of the auto tool call, streamed, and the pieces of its call (index 0)."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CALL_MESSAGES,
            tools=TOOLS,
            temperature=0,
            max_tokens=80,
            stream=True,
        )
    )
    pieces = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    return chunks, [p for p in pieces if p.index == 0]


def test_auto_tool_call_streams_as_it_is_generated(client: openai.OpenAI) -> None:
    chunks, (first, *rest) = streamed_call(client)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    # The first piece names the call, with empty arguments; the arguments follow in pieces
    # (how many: test_tool_call_arguments_come_in_pieces).
    assert (first.index, first.type) == (0, "function")
    assert first.id is not None
    assert first.id.startswith("call_")
    assert first.function is not None
    assert (first.function.name, first.function.arguments) == (EXPECTED[0][0], "")
    assert rest
    assert all(p.id is None and p.function is not None and p.function.name is None for p in rest)
    arguments = "".join(p.function.arguments or "" for p in rest if p.function is not None)
    assert json.loads(arguments) == EXPECTED[0][1]
    assert all(d.content in (None, "") for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def best_of_three(count: Callable[[], int], over: int) -> list[int]:
    """`count()` up to three times, until one is over `over`: the counts. (A pace: tokens
    that pile up while a busy machine's runner or gateway waits go out as one chunk.)"""
    counts: list[int] = []
    while len(counts) < 3 and not any(c > over for c in counts):
        counts.append(count())
    return counts


@pytest.mark.timing  # a pace: see best_of_three
def test_tool_call_arguments_come_in_pieces(client: openai.OpenAI) -> None:
    """Streamed as generated, not the whole call at the end."""

    def pieces() -> int:
        _, (_, *rest) = streamed_call(client)
        return len(rest)

    counts = best_of_three(pieces, 3)
    assert max(counts) > 3, counts


def test_parallel_calls_get_indexes(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=PARALLEL_MESSAGES, tools=TOOLS, temperature=0, max_tokens=160
    )
    assert calls_of(response.choices[0].message) == EXPECTED_PARALLEL
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=PARALLEL_MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=160,
        stream=True,
    )
    indexes = [
        call.index for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []
    ]
    assert sorted(set(indexes)) == list(range(len(EXPECTED_PARALLEL)))


def helper_events(client: openai.OpenAI) -> tuple[list[str], Any]:
    """The SDK stream helper's event types for the auto tool call, and its final completion."""
    kinds: list[str] = []
    with client.chat.completions.stream(
        model=MODEL, messages=CALL_MESSAGES, tools=TOOLS, temperature=0, max_tokens=80
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_completion()
    return kinds, final


def test_the_sdk_stream_helper_emits_argument_deltas(client: openai.OpenAI) -> None:
    kinds, final = helper_events(client)
    assert "tool_calls.function.arguments.delta" in kinds
    assert "tool_calls.function.arguments.done" in kinds
    assert kinds.index("tool_calls.function.arguments.delta") < kinds.index(
        "tool_calls.function.arguments.done"
    )
    assert calls_of(final.choices[0].message) == EXPECTED


@pytest.mark.timing  # a pace: see best_of_three
def test_the_sdk_stream_helper_emits_several_argument_deltas(client: openai.OpenAI) -> None:
    def deltas() -> int:
        kinds, _ = helper_events(client)
        return kinds.count("tool_calls.function.arguments.delta")

    counts = best_of_three(deltas, 3)
    assert max(counts) > 3, counts


def test_the_conversation_goes_on_with_the_tool_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=CALL_MESSAGES, tools=TOOLS, temperature=0, max_tokens=80
    )
    message = first.choices[0].message
    calls = message.tool_calls or []
    history: Any = [
        *CALL_MESSAGES,
        message.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
            for call in calls
        ),
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=4
    )
    usage, before = second.usage, first.usage
    assert usage is not None
    assert before is not None
    assert usage.prompt_tokens > before.prompt_tokens + before.completion_tokens
    # The template writes the call back as the model wrote it, so the whole previous turn is
    # the new prompt's prefix and the runner's prefix cache serves it.
    assert usage.prompt_tokens_details is not None
    # (<|im_end|> included: the model ended its turn with it, the template writes it too).
    # More may be cached: the runner keeps every prompt, and this stack is the whole run's
    # (another test may have sent this conversation already); never the last prompt token.
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert before.prompt_tokens + before.completion_tokens <= cached <= usage.prompt_tokens - 1


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=CALL_MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=8,
    )
    (choice,) = response.choices
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "length"
    assert "<tool_call>" not in (choice.message.content or "")


# --- forced calls and structured outputs: the grammar ---------------------------------------


class Weather(pydantic.BaseModel):
    city: str
    unit: str


def test_required_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    response = client.chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_tokens=100,
    )
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    calls: Any = choice.message.tool_calls or []
    (call,) = calls
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_function_is_called(client: openai.OpenAI, parallel: bool) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": TOOLS[-1]["function"]["name"]}},
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=3,
        max_tokens=100,
    )
    calls: Any = response.choices[0].message.tool_calls or []
    assert len(calls) == 1
    assert calls[0].function.name == TOOLS[-1]["function"]["name"]
    jsonschema.validate(
        json.loads(calls[0].function.arguments), TOOLS[-1]["function"]["parameters"]
    )


class Fruit(pydantic.BaseModel):
    name: str
    ripe: bool
    weight: int


def test_parse_helper_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=PLAIN, response_format=Fruit, temperature=0, max_tokens=100
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Fruit)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client: openai.OpenAI, stream: bool) -> None:
    schema = {
        "type": "object",
        "properties": {
            "fruit": {"type": "string", "enum": ["apple", "pear", "plum"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "notes": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["fruit", "count", "notes"],
        "additionalProperties": False,
    }
    kwargs: Any = {
        "model": MODEL,
        "messages": PLAIN,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "fruit", "schema": schema, "strict": True},
        },
        "temperature": 1.0,
        "max_tokens": 150,
    }
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**kwargs, stream=True)
            if c.choices
        )
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    jsonschema.validate(json.loads(text), schema)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=150,
    )
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


def test_logprobs_under_a_constraint(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=PLAIN,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=150,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    entries = logprobs.content or []
    assert response.usage is not None
    assert len(entries) == response.usage.completion_tokens
    # Masked tokens have no probability: every listed alternative is one the grammar allows.
    assert all(top.logprob > -9999 for e in entries for top in e.top_logprobs[:1])


def test_an_unenforceable_schema_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=PLAIN,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"tags": {"type": "array", "uniqueItems": True}},
                    },
                },
            },
        )
    body: Any = info.value.body
    assert body["param"] == "response_format"
    assert body["code"] == "invalid_value"
    assert "uniqueItems" in body["message"]
