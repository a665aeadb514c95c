"""The Ollama API end to end: the official `ollama` client against a real gateway and a real
runner on the built-in model. At temperature 0 every answer is the Chat Completions (or legacy
completions) answer to the same request, word for word, with the same token counts: those the
runner computed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import orjson
import pytest

from runner import demo_model
from tests.support import UNIT, Gateway, Process

MODEL = "orchard-demo"
HI: Any = [{"role": "user", "content": "Tell me about pear trees."}]
GREEDY = {"temperature": 0, "num_predict": 12}
CALLS = {"temperature": 0, "num_predict": 80}
TOOLS: Any = list(demo_model.TOOL_DEMO_TOOLS)
EXPECTED = [(c["name"], c["arguments"]) for c in demo_model.TOOL_DEMO_CALLS]
EXPECTED_PARALLEL = [(c["name"], c["arguments"]) for c in demo_model.TOOL_DEMO_PARALLEL_CALLS]


@pytest.fixture(scope="module")
def client(stack: tuple[Gateway, Process]) -> Iterator[ollama.Client]:
    with ollama.Client(host=stack[0].base) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(stack: tuple[Gateway, Process]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack[0].base}/v1", api_key="unused", max_retries=0) as c:
        yield c


def reference(openai_client: openai.OpenAI, messages: Any) -> tuple[str, int, int, str]:
    """The Chat Completions answer at temperature 0: content, prompt and completion tokens,
    finish reason."""
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=GREEDY["num_predict"]
    )
    assert answer.usage is not None
    (choice,) = answer.choices
    return (
        choice.message.content or "",
        answer.usage.prompt_tokens,
        answer.usage.completion_tokens,
        choice.finish_reason,
    )


def test_a_chat_is_the_chat_completion(client: ollama.Client, openai_client: openai.OpenAI) -> None:
    content, prompt_tokens, completion_tokens, finish = reference(openai_client, HI)
    answer = client.chat(MODEL, HI, options=GREEDY)
    assert answer.model == MODEL
    assert answer.message.role == "assistant"
    assert answer.message.content == content
    assert (answer.prompt_eval_count, answer.eval_count) == (prompt_tokens, completion_tokens)
    assert (answer.done, answer.done_reason) == (True, finish)
    assert answer.created_at is not None
    assert answer.created_at.endswith("Z")
    durations = [
        answer.load_duration,
        answer.prompt_eval_duration,
        answer.eval_duration,
    ]
    assert all(d is not None and d >= 0 for d in durations)
    assert answer.total_duration == sum(d or 0 for d in durations)


def test_a_streamed_chat_is_the_same_answer(
    client: ollama.Client, openai_client: openai.OpenAI
) -> None:
    content, prompt_tokens, completion_tokens, finish = reference(openai_client, HI)
    parts = list(client.chat(MODEL, HI, options=GREEDY, stream=True))
    *pieces, last = parts
    assert all(not p.done and p.done_reason is None and p.eval_count is None for p in pieces)
    assert "".join(p.message.content or "" for p in pieces) == content
    assert (last.done, last.done_reason, last.message.content) == (True, finish, "")
    assert (last.prompt_eval_count, last.eval_count) == (prompt_tokens, completion_tokens)


def test_the_raw_ndjson(stack: tuple[Gateway, Process], openai_client: openai.OpenAI) -> None:
    content, prompt_tokens, completion_tokens, _ = reference(openai_client, HI)
    response = httpx.post(
        f"{stack[0].base}/api/chat",
        json={"model": MODEL, "messages": HI, "options": GREEDY},
        timeout=30 * UNIT,
    )
    assert response.headers["content-type"] == "application/x-ndjson"
    assert response.content.endswith(b"\n")
    *pieces, last = [orjson.loads(line) for line in response.content.splitlines()]
    for piece in pieces:
        assert list(piece) == ["model", "created_at", "message", "done"]
        assert piece["done"] is False
    assert "".join(p["message"]["content"] for p in pieces) == content
    assert last["done"] is True
    assert (last["prompt_eval_count"], last["eval_count"]) == (prompt_tokens, completion_tokens)


def test_generate_is_a_chat_of_one_user_message(
    client: ollama.Client, openai_client: openai.OpenAI
) -> None:
    system = "You are a gardener."
    messages: Any = [{"role": "system", "content": system}, *HI]
    content, prompt_tokens, completion_tokens, finish = reference(openai_client, messages)
    answer = client.generate(MODEL, HI[0]["content"], system=system, options=GREEDY)
    assert (answer.response, answer.done_reason) == (content, finish)
    assert (answer.prompt_eval_count, answer.eval_count) == (prompt_tokens, completion_tokens)
    streamed = list(
        client.generate(MODEL, HI[0]["content"], system=system, options=GREEDY, stream=True)
    )
    assert "".join(p.response or "" for p in streamed) == content
    assert streamed[-1].eval_count == completion_tokens


def test_a_raw_generate_is_the_legacy_completion(
    client: ollama.Client, openai_client: openai.OpenAI
) -> None:
    prompt = "Once upon a time, in an orchard"
    legacy = openai_client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=GREEDY["num_predict"]
    )
    assert legacy.usage is not None
    answer = client.generate(MODEL, prompt, raw=True, options=GREEDY)
    assert answer.response == legacy.choices[0].text
    assert (answer.prompt_eval_count, answer.eval_count) == (
        legacy.usage.prompt_tokens,
        legacy.usage.completion_tokens,
    )


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, dict(c.function.arguments)) for c in message.tool_calls or []]


def test_a_tool_call_comes_whole(client: ollama.Client) -> None:
    messages: Any = list(demo_model.TOOL_DEMO_MESSAGES)
    answer = client.chat(
        MODEL, messages, tools=TOOLS, options={"temperature": 0, "num_predict": 80}
    )
    assert calls_of(answer.message) == EXPECTED
    assert answer.done_reason == "stop"


def test_parallel_calls_stream_one_object_each(stack: tuple[Gateway, Process]) -> None:
    # Raw, with the tools in OpenAI's key order: the library writes "required" before
    # "properties", a prompt the built-in model answers with one call only.
    messages: Any = list(demo_model.TOOL_DEMO_PARALLEL_MESSAGES)
    request = {"model": MODEL, "messages": messages, "tools": TOOLS, "options": CALLS}
    response = httpx.post(f"{stack[0].base}/api/chat", json=request, timeout=60 * UNIT)
    parts = [ollama.ChatResponse(**orjson.loads(line)) for line in response.content.splitlines()]
    with_calls = [p for p in parts if p.message.tool_calls]
    assert [calls_of(p.message) for p in with_calls] == [[call] for call in EXPECTED_PARALLEL]
    assert parts[-1].done_reason == "stop"
    whole = httpx.post(
        f"{stack[0].base}/api/chat", json={**request, "stream": False}, timeout=60
    ).json()
    assert calls_of(ollama.ChatResponse(**whole).message) == EXPECTED_PARALLEL
    assert whole["eval_count"] == parts[-1].eval_count
    # The calls' results go back as tool messages, in Ollama's shape.
    history: Any = [
        *messages,
        whole["message"],
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        {"role": "tool", "content": "rainy", "tool_name": "get_weather"},
    ]
    follow_up = httpx.post(
        f"{stack[0].base}/api/chat",
        json={**request, "messages": history, "stream": False},
        timeout=60 * UNIT,
    )
    assert follow_up.status_code == 200
    assert follow_up.json()["prompt_eval_count"] > whole["prompt_eval_count"]


def test_structured_outputs(client: ollama.Client, openai_client: openai.OpenAI) -> None:
    def chat_answer(response_format: Any) -> str | None:
        answer = openai_client.chat.completions.create(
            model=MODEL, messages=HI, temperature=0, max_tokens=60, response_format=response_format
        )
        return answer.choices[0].message.content

    free = client.chat(MODEL, HI, format="json", options={"temperature": 0, "num_predict": 60})
    assert isinstance(json.loads(free.message.content or ""), dict)
    assert free.message.content == chat_answer({"type": "json_object"})
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["city", "count"],
        "additionalProperties": False,
    }
    shaped = client.chat(MODEL, HI, format=schema, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(shaped.message.content or ""), schema)
    assert shaped.message.content == chat_answer(
        {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}
    )


def test_think_goes_through_the_chat_template(
    client: ollama.Client, openai_client: openai.OpenAI
) -> None:
    def prompt_tokens(**fields: Any) -> int:
        answer = openai_client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=1, **fields
        )
        assert answer.usage is not None
        tokens: int = answer.usage.prompt_tokens
        return tokens

    off = client.chat(MODEL, HI, think=False, options={"num_predict": 1})
    on = client.chat(MODEL, HI, think=True, options={"num_predict": 1})
    assert off.prompt_eval_count == prompt_tokens(reasoning_effort="none")
    assert on.prompt_eval_count == prompt_tokens(reasoning_effort="high") == prompt_tokens()
    assert off.prompt_eval_count != on.prompt_eval_count


def test_model_endpoints(client: ollama.Client, stack: tuple[Gateway, Process]) -> None:
    assert [m.model for m in client.list().models] == [MODEL]
    (loaded,) = client.ps().models
    assert loaded.model == MODEL
    assert loaded.context_length == demo_model.CONTEXT_LENGTH
    shown = client.show(MODEL)
    assert shown.modelinfo is not None
    assert shown.modelinfo["orchard.context_length"] == loaded.context_length
    assert httpx.get(f"{stack[0].base}/api/version").json() == {"version": "0.12.0"}


def test_refusals_name_the_field(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(MODEL, HI, options={"num_ctx": 8192})
    assert info.value.status_code == 400
    assert "options.num_ctx" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(MODEL, HI, logprobs=True)
    assert "logprobs" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.delete(MODEL)
    assert info.value.status_code == 501
