"""Every model family's built-in model (runner.demo_families) behind a gateway, in every
dialect, through each dialect's official client: a forced call streamed and not, the same call
in chat, Responses, Anthropic's Messages and the browser socket at temperature 0, its
arguments in at least two deltas; JSON answers in Ollama's `format`; reasoning split out and
no markup anywhere."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import anthropic
import jsonschema
import ollama
import openai
import orjson
import pytest
from websockets.asyncio.client import connect

from runner.demo_families import FAMILIES
from runner.engine.mlx_model import MlxModel
from runner.harmony import MARKERS
from tests.support import UNIT, Gateway, Process, start_runner

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Köln"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FUNCTION: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": SCHEMA,
}
TOOL: Any = {"name": "get_weather", "description": FUNCTION["description"], "input_schema": SCHEMA}
"""The function as Anthropic's Messages take it."""
QUESTION = "What is the weather like in Paris?"
NO_PREFIX_CACHE = {"harmony", "lfm2", "gemma4"}
"""Sliding-window attention (gpt-oss, Gemma) and LFM2's convolutions keep caches mlx-lm cannot
trim to a prefix: their prompts are not reused (docs/models.md)."""
MARKUP = (*MARKERS, "<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]")


def effort(family: str) -> str | None:
    """Think spans closed (the random models never close one), Harmony at low effort."""
    return "low" if family == "harmony" else ("none" if FAMILIES[family].think else None)


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gateway = Gateway()
    models = [arg for family in FAMILIES.values() for arg in ("--model", family.model_id)]
    runner: Process = start_runner(gateway, *models, "--max-concurrent", "8", name="families")
    try:
        gateway.wait_for_runners(1, timeout=120)
        yield gateway
    finally:
        runner.stop()
        gateway.stop()


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key="-") as client:
        yield client


def clean(text: str | None) -> None:
    for marker in MARKUP:
        assert marker not in (text or ""), f"{marker} in {text!r}"


def forced_chat(
    family: str, *, question: str = QUESTION, level: str | None = None
) -> dict[str, Any]:
    """A chat body forcing one get_weather call, greedy, up to 200 tokens; at the family's
    `effort`, or `level`."""
    body: dict[str, Any] = {
        "model": FAMILIES[family].model_id,
        "messages": [{"role": "user", "content": question}],
        "tools": [{"type": "function", "function": FUNCTION}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 200,
    }
    if level or effort(family):
        body["reasoning_effort"] = level or effort(family)
    return body


async def chat_call(
    client: openai.AsyncOpenAI,
    family: str,
    *,
    stream: bool,
    level: str | None = None,
    question: str = QUESTION,
) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """The forced call's arguments, in how many deltas they came, and the usage; at the
    family's `effort`, or `level`."""
    fields = forced_chat(family, question=question, level=level)
    if not stream:
        answer = await client.chat.completions.create(**fields)
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls"
        clean(choice.message.content)
        clean(getattr(choice.message, "reasoning_content", None))
        (call,) = choice.message.tool_calls or []
        assert call.type == "function"
        assert call.function.name == "get_weather"
        assert answer.usage is not None
        return json.loads(call.function.arguments), 1, answer.usage.model_dump()
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    finish = None
    names = []
    async for chunk in await client.chat.completions.create(
        **fields, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            clean(choice.delta.content)
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                if delta.id is not None:
                    assert not pieces, "the name comes first"
                    assert delta.function is not None
                    names.append(delta.function.name)
                # The first delta may carry the arguments' first piece too (two pieces that
                # reach the gateway together are sent as one).
                if delta.function is not None and delta.function.arguments:
                    pieces.append(delta.function.arguments)
    assert (names, finish) == (["get_weather"], "tool_calls")
    return json.loads("".join(pieces)), len(pieces), usage


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_forced_call_in_chat_streamed_and_not(
    client: openai.AsyncOpenAI, family: str
) -> None:
    whole, _, usage = await chat_call(client, family, stream=False)
    streamed, pieces, streamed_usage = await chat_call(client, family, stream=True)
    jsonschema.validate(whole, SCHEMA)
    assert streamed == whole
    assert pieces >= 2
    # The second request found the first one's prompt in the runner's prefix cache: all of
    # it but the last token, which is prefilled to start the answer (none where the model's
    # cache cannot be cut back to a prefix).
    cached = streamed_usage["prompt_tokens_details"].pop("cached_tokens")
    reused = 0 if family in NO_PREFIX_CACHE else usage["prompt_tokens"] - 1
    assert cached == reused, (cached, usage)
    usage["prompt_tokens_details"].pop("cached_tokens")
    assert streamed_usage == usage
    if family != "harmony":
        assert usage["completion_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_forced_calls_side_by_side_are_the_calls_made_alone(
    client: openai.AsyncOpenAI, family: str
) -> None:
    # Four at once are rows of one batch, where a row may be fed the rest of a forced run
    # with its first token (runner/engine/batch_forward.py): the same calls, the same usage.
    questions = [QUESTION, "Will it rain in London this week?"]
    alone = [await chat_call(client, family, stream=False, question=q) for q in questions]
    together = await asyncio.gather(
        *(
            chat_call(client, family, stream=stream, question=q)
            for q in questions
            for stream in (False, True)
        )
    )
    for i, (arguments, _, usage) in enumerate(together):
        expected, _, expected_usage = alone[i // 2]
        assert arguments == expected, i
        assert usage["completion_tokens"] == expected_usage["completion_tokens"], i


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_the_same_call_streamed_and_not_in_responses_messages_and_the_browser_socket(
    gateway: Gateway, client: openai.AsyncOpenAI, family: str
) -> None:
    # Harmony at medium effort, its default: Anthropic's Messages cannot ask for another.
    level = "medium" if family == "harmony" else None
    expected, _, _ = await chat_call(client, family, stream=False, level=level)
    model = FAMILIES[family].model_id
    reasoning: Any = (
        {"reasoning": {"effort": level or effort(family)}} if level or effort(family) else {}
    )
    fields: Any = {
        "model": model,
        "input": QUESTION,
        "tools": [{"type": "function", **FUNCTION, "strict": True}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 200,
        **reasoning,
    }
    response = await client.responses.create(**fields)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", expected)]
    deltas: list[str] = []
    done = None
    async with client.responses.stream(**fields) as events:
        async for event in events:
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
            elif event.type == "response.function_call_arguments.done":
                done = event.arguments
    assert len(deltas) >= 2
    assert done == "".join(deltas)
    assert json.loads(done) == expected

    async with anthropic.AsyncAnthropic(base_url=gateway.base, api_key="-") as claude:
        thinking = {"thinking": {"type": "disabled"}} if FAMILIES[family].think else {}
        request: Any = {
            "model": model,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": QUESTION}],
            "extra_body": {"temperature": 0},
            "tools": [TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            **thinking,
        }
        message = await claude.messages.create(**request)
        partial: list[str] = []
        async with claude.messages.stream(**request) as stream:
            async for part in stream:
                if part.type == "content_block_delta" and part.delta.type == "input_json_delta":
                    partial.append(part.delta.partial_json)
            streamed = await stream.get_final_message()
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", expected)]
    assert message.stop_reason == "tool_use"
    assert len(partial) >= 2
    assert json.loads("".join(partial)) == expected
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "input", None)) for b in message.content
    ]

    body = forced_chat(family, level=level)
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        create = {"type": "chat.completions.create", "request_id": "r", "body": body}
        await ws.send(orjson.dumps(create), text=True)
        pieces = []
        while (msg := orjson.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT)))[
            "type"
        ] == "chunk":
            for choice in msg["chunk"]["choices"]:
                clean(choice["delta"].get("content"))
                for delta in choice["delta"].get("tool_calls") or []:
                    pieces.append(delta["function"].get("arguments") or "")
        assert msg["type"] == "done"
        assert msg["finish_reason"] == "tool_calls"
    assert json.loads("".join(pieces)) == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ollamas_format_gives_json_of_the_schema(gateway: Gateway, family: str) -> None:
    with ollama.Client(host=gateway.base) as client:
        answer = client.chat(
            model=FAMILIES[family].model_id,
            messages=[{"role": "user", "content": QUESTION}],
            format=SCHEMA,
            options={"temperature": 0, "num_predict": 200},
            think="low" if family == "harmony" else (False if FAMILIES[family].think else None),
        )
    clean(answer.message.content)
    clean(answer.message.thinking)
    jsonschema.validate(json.loads(answer.message.content or ""), SCHEMA)
    # Harmony reasons before its JSON (the analysis channel, as `thinking`); the others were
    # asked not to.
    assert bool(answer.message.thinking) == (family == "harmony")


async def test_harmonys_analysis_is_reasoning_in_chat_and_responses(
    client: openai.AsyncOpenAI,
) -> None:
    # (Ollama's `thinking` is checked above. Anthropic's Messages have no structured output
    # here, and the random model reasons only before a JSON answer.)
    model = FAMILIES["harmony"].model_id
    schema: Any = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
    }
    messages: Any = [{"role": "user", "content": QUESTION}]
    chat = await client.chat.completions.create(
        model=model,
        messages=messages,
        response_format=schema,
        reasoning_effort="low",
        temperature=0,
        max_tokens=400,
    )
    message: Any = chat.choices[0].message
    clean(message.content)
    clean(message.reasoning_content)
    assert message.reasoning_content
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert chat.usage is not None
    assert chat.usage.completion_tokens_details is not None
    reasoning_tokens = chat.usage.completion_tokens_details.reasoning_tokens
    assert reasoning_tokens
    assert reasoning_tokens < chat.usage.completion_tokens

    response: Any = await client.responses.create(
        model=model,
        input=QUESTION,
        reasoning={"effort": "low"},
        temperature=0,
        max_output_tokens=400,
        text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}},
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    summary = "".join(part.text for part in response.output[0].content or [])
    assert summary == message.reasoning_content
    assert json.loads(response.output_text) == json.loads(message.content)
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens


NESTED: Any = {
    "type": "object",
    "properties": {
        "where": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Köln"]},
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            },
            "required": ["city", "lat"],
            "additionalProperties": False,
        },
        "days": {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3},
    },
    "required": ["where", "days"],
    "additionalProperties": False,
}
"""Nested arguments: an object and an array, in Gemma 4's own syntax when forced."""


async def test_gemma4s_nested_arguments_are_forced_in_its_own_syntax(
    client: openai.AsyncOpenAI,
) -> None:
    function: Any = {**FUNCTION, "parameters": NESTED}
    # Gemma 4 as it comes: no reasoning effort, no token limit.
    request: Any = {
        "model": FAMILIES["gemma4"].model_id,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"type": "function", "function": function}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)
    (call,) = whole.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, NESTED)
    assert whole.choices[0].finish_reason == "tool_calls"
    # Streamed: the same arguments, in more than one delta.
    deltas = []
    async for chunk in await client.chat.completions.create(**request, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            deltas.append(delta.function.arguments if delta.function else None)
    assert "".join(d for d in deltas if d) == call.function.arguments
    assert len([d for d in deltas if d]) >= 2


async def test_what_gemma4s_syntax_cannot_force_is_refused_by_name(
    client: openai.AsyncOpenAI,
) -> None:
    # An object that must have some property (Gemma's template renders it; the grammar of
    # its syntax cannot hold it).
    where = {"type": "object", "properties": {"lat": {"type": "number"}}, "minProperties": 1}
    either: Any = {
        **FUNCTION,
        "parameters": {"type": "object", "properties": {"where": where}},
    }
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model=FAMILIES["gemma4"].model_id,
            messages=[{"role": "user", "content": QUESTION}],
            tools=[{"type": "function", "function": either}],
            tool_choice="required",
        )
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["param"] == "tools"
    assert error["message"] == (
        "tools[0].function.parameters.properties.where: Gemma 4's tool-call syntax is enforced "
        "for strings, numbers, booleans, null, objects of listed properties and arrays of one "
        "item schema; its minProperties cannot be forced."
    )


async def test_harmonys_analysis_is_thinking_in_anthropics_messages(
    gateway: Gateway, client: openai.AsyncOpenAI
) -> None:
    # A JSON answer (output_config.format), before which the random model reasons.
    model = FAMILIES["harmony"].model_id
    chat = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
        },
        reasoning_effort="low",
        temperature=0,
        max_tokens=400,
    )
    message: Any = chat.choices[0].message
    assert message.reasoning_content
    assert chat.usage is not None
    async with anthropic.AsyncAnthropic(base_url=gateway.base, api_key="-") as claude:
        request: Any = {
            "model": model,
            "max_tokens": 400,
            "messages": [{"role": "user", "content": QUESTION}],
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"},
            "extra_body": {"temperature": 0},
        }
        said = await claude.messages.create(**request)
        thought: list[str] = []
        async with claude.messages.stream(**request) as stream:
            async for part in stream:
                if part.type == "content_block_delta" and part.delta.type == "thinking_delta":
                    thought.append(part.delta.thinking)
            streamed = await stream.get_final_message()
    assert [block.type for block in said.content] == ["thinking", "text"]
    thinking, text = said.content
    assert thinking.type == "thinking"
    assert text.type == "text"
    clean(thinking.thinking)
    clean(text.text)
    assert thinking.thinking == message.reasoning_content
    assert json.loads(text.text) == json.loads(message.content)
    assert said.stop_reason == "end_turn"
    assert said.usage.output_tokens == chat.usage.completion_tokens
    assert len(thought) >= 2
    assert "".join(thought) == thinking.thinking
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in said.content]


REASONING = "The user wants the weather in Paris; get_weather answers that."
RESULT = "clear, 18 degrees"
ARGUMENTS = {"city": "Paris", "days": 1}


async def test_earlier_reasoning_goes_back_to_the_template_in_every_dialect(
    gateway: Gateway, client: openai.AsyncOpenAI
) -> None:
    """A turn's reasoning given back with its call, in each dialect's way, is rendered by the
    Harmony template before the call it led to: the prompt mlx-lm's tokenizer makes of the
    conversation, the same in every dialect."""
    model = FAMILIES["harmony"].model_id
    tools: Any = [{"type": "function", "function": FUNCTION}]
    call: Any = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
    }
    history: Any = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": REASONING,
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    turn: Any = {"model": model, "tools": tools, "max_tokens": 1, "reasoning_effort": "medium"}
    chat = await client.chat.completions.create(**turn, messages=history)
    history[1]["reasoning"] = history[1].pop("reasoning_content")  # vLLM's newer name
    renamed = await client.chat.completions.create(**turn, messages=history)
    history[1].pop("reasoning")
    plain = await client.chat.completions.create(**turn, messages=history)

    responses = [
        {"role": "user", "content": QUESTION},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": REASONING}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": json.dumps(ARGUMENTS)},
        {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
    ]  # fmt: skip
    responses_tools: Any = [{"type": "function", **FUNCTION}]
    response = await client.responses.create(
        model=model,
        input=cast(Any, responses),
        tools=responses_tools,
        max_output_tokens=16,
        reasoning={"effort": "medium"},
    )

    async with anthropic.AsyncAnthropic(base_url=gateway.base, api_key="-") as claude:
        back = await claude.messages.create(
            model=model,
            max_tokens=1,
            messages=[
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": REASONING, "signature": ""},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                         "input": ARGUMENTS},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}
                    ],
                },
            ],
            tools=[TOOL],
        )  # fmt: skip

    with ollama.Client(host=gateway.base) as local:
        olla = local.chat(
            model=model,
            messages=[
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": REASONING,
                    "tool_calls": [{"function": {"name": "get_weather", "arguments": ARGUMENTS}}],
                },
                {"role": "tool", "tool_name": "get_weather", "content": RESULT},
            ],
            tools=tools,
            options={"num_predict": 1},
            think="medium",
        )

    # The conversation as mlx-lm's tokenizer renders it, in this process.
    tokenizer = MlxModel.load(model).tokenizer
    rendered: Any = copy.deepcopy(history)
    rendered[1] |= {"thinking": REASONING, "content": ""}
    rendered[1]["tool_calls"][0]["function"]["arguments"] = ARGUMENTS
    prompt = tokenizer.apply_chat_template(
        rendered, tools=tools, add_generation_prompt=True, reasoning_effort="medium"
    )
    analysis = tokenizer.encode(
        f"<|start|>assistant<|channel|>analysis<|message|>{REASONING}<|end|>",
        add_special_tokens=False,
    )
    counts = {
        "chat": chat.usage and chat.usage.prompt_tokens,
        "chat, reasoning": renamed.usage and renamed.usage.prompt_tokens,
        "responses": response.usage and response.usage.input_tokens,
        "anthropic": back.usage.input_tokens,
        "ollama": olla.prompt_eval_count,
    }
    assert counts == dict.fromkeys(counts, len(prompt))
    assert plain.usage is not None
    assert plain.usage.prompt_tokens == len(prompt) - len(analysis)
