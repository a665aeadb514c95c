"""End to end over real sockets: a gateway process, a real mlx-lm runner process on the
built-in model, and the official `openai` SDK (sync and async) as the client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import psutil
import pytest
from openai.types.chat import ChatCompletionMessageParam

from runner.demo_model import resolve_model
from runner.engine.mlx_engine import engine_version
from tests.support import (
    KV_LIMIT,
    UNIT,
    Gateway,
    Process,
    Stacks,
    sse_events,
    wait_until,
    weights_bytes,
)

MODEL = "orchard-demo"


@pytest.fixture(scope="module", params=["mlx", "mlx-batched"])
def stack(stacks: Stacks, request: pytest.FixtureRequest) -> tuple[Gateway, Process]:
    """Every test runs against both engines: interleaved and batched."""
    return stacks.get(request.param)


@pytest.fixture(scope="module")
def gateway(stack: tuple[Gateway, Process]) -> Gateway:
    return stack[0]


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(gateway: Gateway) -> Any:
    c = openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


class Reference:
    """In-process mlx-lm on the same model: what the runner must reproduce exactly."""

    def __init__(self, path: Path) -> None:
        from mlx_lm import load

        loaded: Any = load(str(path))
        self.model, self.tokenizer = loaded[0], loaded[1]

    def prompt(self, messages: Messages) -> list[int]:
        tokens: list[int] = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return tokens

    def greedy(self, messages: Messages, max_tokens: int) -> tuple[str, int, str]:
        """(text, completion tokens, finish reason) of greedy stream_generate."""
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        text, last = "", None
        for last in stream_generate(
            self.model,
            self.tokenizer,
            self.prompt(messages),
            max_tokens=max_tokens,
            sampler=make_sampler(0.0),
        ):
            text += last.text
        assert last is not None
        return text, last.generation_tokens, str(last.finish_reason)


@pytest.fixture(scope="module")
def reference(demo_model_path: Path) -> Reference:
    return Reference(demo_model_path)


Messages = list[ChatCompletionMessageParam]


def user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def test_stream_fields_chunk_by_chunk(client: openai.OpenAI, reference: Reference) -> None:
    messages = user("Tell me about orchards in autumn.")
    expected, n_tokens, finish = reference.greedy(messages, 16)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert len(chunks) >= 3
    first = chunks[0]
    assert first.id.startswith("chatcmpl-")
    for chunk in chunks:
        assert chunk.id == first.id
        assert chunk.object == "chat.completion.chunk"
        assert chunk.created == first.created
        assert chunk.model == MODEL
        assert chunk.usage is None
        assert len(chunk.choices) == 1
        assert chunk.choices[0].index == 0
        assert chunk.choices[0].logprobs is None
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == finish
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected
    assert n_tokens == 16 or finish == "stop"


def test_include_usage_counts_exactly(client: openai.OpenAI, reference: Reference) -> None:
    messages = user("Count the apples in the usage basket, please.")
    _, n_tokens, finish = reference.greedy(messages, 10)
    # The same prompt once before: the prefix cache then holds all of it (this test's own
    # entry, whatever other modules left there).
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *body, last = chunks
    assert all(c.usage is None for c in body)
    assert last.choices == []
    usage = last.usage
    assert usage is not None
    prompt_tokens = len(reference.prompt(messages))
    assert usage.prompt_tokens == prompt_tokens
    assert body[-1].choices[0].finish_reason == finish
    assert usage.completion_tokens == n_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 0
    # All of the prompt but its last token, which generation needs the logits of.
    assert usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1


def test_length_gives_max_tokens(client: openai.OpenAI, reference: Reference) -> None:
    # A prompt the reference runs to the limit, so finish "length" is certain.
    messages = user("Write a long story about a pear tree.")
    _, _, finish = reference.greedy(messages, 24)
    assert finish == "length", "pick a prompt whose greedy output runs past 24 tokens"
    done = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
    )
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.completion_tokens == 24
    # max_completion_tokens is the same bound under its current name.
    done = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=5,
        temperature=0,
    )
    assert done.usage is not None
    assert done.usage.completion_tokens == 5


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user("Go on."),
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options=cast(Any, {"include_usage": True, "continuous_usage_stats": True}),
    )
    chunks = list(stream)
    completions = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(completions) == len(chunks)  # usage on every chunk
    assert completions == sorted(completions)
    last_usage = chunks[-1].usage
    assert last_usage is not None
    assert completions[-1] == last_usage.completion_tokens
    assert chunks[-1].choices == []


def test_non_streaming_matches_reference(client: openai.OpenAI, reference: Reference) -> None:
    messages = user("What grows in an orchard?")
    expected, n_tokens, finish = reference.greedy(messages, 20)
    done = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
    )
    assert done.object == "chat.completion"
    assert done.model == MODEL
    assert done.id.startswith("chatcmpl-")
    assert len(done.choices) == 1
    choice = done.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason == finish
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(reference.prompt(messages))
    assert done.usage.completion_tokens == n_tokens


@pytest.mark.parametrize(
    "prompt",
    ["Hello there!", "Name three fruits.", "Why is the sky blue? Explain slowly and carefully."],
)
def test_temperature_zero_is_exactly_in_process_mlx_lm(
    client: openai.OpenAI, reference: Reference, prompt: str
) -> None:
    messages: Messages = [{"role": "system", "content": f"Case {prompt}"}, *user(prompt)]
    expected, _, _ = reference.greedy(messages, 40)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_prefix_cache_reports_cached_tokens(client: openai.OpenAI, reference: Reference) -> None:
    system: ChatCompletionMessageParam = {
        "role": "system",
        "content": "You are a careful orchard keeper. " * 12,
    }
    first: Messages = [system, *user("How many trees are there?")]
    second: Messages = [system, *user("Which tree is the oldest?")]
    client.chat.completions.create(model=MODEL, messages=first, max_tokens=4)
    done = client.chat.completions.create(model=MODEL, messages=second, max_tokens=4)
    p1, p2 = reference.prompt(first), reference.prompt(second)
    common = next((i for i, (a, b) in enumerate(zip(p1, p2, strict=False)) if a != b), len(p1))
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(p2)
    details = done.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens == common
    assert common > 40  # the shared system prompt


async def test_eight_concurrent_streams_do_not_mix(
    aclient: openai.AsyncOpenAI, reference: Reference
) -> None:
    prompts = [user(f"Story number {i}: the {w} tree.") for i, w in enumerate("abcdefgh")]
    expected = [reference.greedy(m, 24) for m in prompts]

    async def one(messages: Messages) -> tuple[str, Any]:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage

    results = await asyncio.gather(*(one(m) for m in prompts))
    for (text, usage), (want, n_tokens, _), messages in zip(
        results, expected, prompts, strict=True
    ):
        assert text == want
        assert usage.completion_tokens == n_tokens
        assert usage.prompt_tokens == len(reference.prompt(messages))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_async_non_streaming(aclient: openai.AsyncOpenAI, reference: Reference) -> None:
    messages = user("Async hello.")
    expected, _, _ = reference.greedy(messages, 12)
    done = await aclient.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
    )
    assert done.choices[0].message.content == expected


def test_stop_string_ends_with_stop(client: openai.OpenAI, reference: Reference) -> None:
    messages = user("Say something with a stop in it.")
    full, _, _ = reference.greedy(messages, 40)
    words = [w for w in full.split(" ") if len(w) >= 3]
    assert words, full
    stop = words[len(words) // 2]
    done = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0,
        stop=[stop],
    )
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].message.content == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, reference: Reference) -> None:
    messages = user("Surprise me.")

    def sample(seed: int) -> str | None:
        done = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
        )
        return done.choices[0].message.content

    first, other = sample(1234), sample(4321)
    assert sample(1234) == first
    # The seed chose the draws: another seed draws others, and neither is the greedy text.
    assert other != first
    greedy, _, _ = reference.greedy(messages, 16)
    assert greedy not in (first, other)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=user("hi"))
    assert err.value.status_code == 404
    assert err.value.code == "model_not_found"
    assert err.value.param is None  # as OpenAI sends it
    assert err.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[]", 400, None),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
        (b'{"model": "orchard-demo"}', 400, "messages"),
        (b'{"model": "orchard-demo", "messages": []}', 400, "messages"),
        (b'{"model": 3, "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
        (
            b'{"model": "orchard-demo", "messages": [{"role": "user", "content": "hi"}],'
            b' "temperature": 3}',
            400,
            "temperature",
        ),
        (
            b'{"model": "orchard-demo", "messages": [{"role": "user", "content": "hi"}],'
            b' "max_tokens": "ten"}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "orchard-demo", "messages": [{"role": "user", "content": "hi"}], "n": 9}',
            400,  # over --max-choices
            "n",
        ),
        (
            b'{"model": "orchard-demo", "messages": [{"role": "user", "content": "hi"}],'
            b' "top_logprobs": 2}',  # only with logprobs: true
            400,
            "top_logprobs",
        ),
        (
            b'{"model": "orchard-demo", "messages": [{"role": "user", "content": "hi"}],'
            b' "tools": [{"type": "function", "function": {"name": "a b"}}]}',
            400,
            "tools[0].function.name",
        ),
        (
            b'{"model": "orchard-demo", "messages": [{"role": "user", "content": "hi"}],'
            b' "response_format": {"type": "xml"}}',
            400,
            "response_format.type",
        ),
        (
            b'{"model": "orchard-demo", "messages": [{"role": "wizard", "content": "hi"}]}',
            400,
            "messages[0].role",
        ),
    ],
)
def test_bad_input_is_openai_error(
    gateway: Gateway, payload: bytes, status: int, param: str | None
) -> None:
    resp = httpx.post(
        f"{gateway.base}/v1/chat/completions",
        content=payload,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_oversized_body_is_413(gateway: Gateway) -> None:
    big = (
        b'{"model": "orchard-demo", "messages": [{"role": "user", "content": "'
        + (b"a" * (5 * 1024 * 1024))
        + b'"}]}'
    )
    resp = httpx.post(
        f"{gateway.base}/v1/chat/completions",
        content=big,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def test_unknown_route_is_openai_404(gateway: Gateway) -> None:
    resp = httpx.get(f"{gateway.base}/v1/nothing-here")
    assert resp.status_code == 404
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_sse_wire_format_raw(gateway: Gateway, reference: Reference) -> None:
    _, n_tokens, _ = reference.greedy(user("raw"), 3)
    resp = httpx.post(
        f"{gateway.base}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": user("raw"),
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=30 * UNIT,
    )
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(resp.content)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == n_tokens
    assert all(e["usage"] is None for e in events[:-2])
    assert b": keep-alive" not in resp.content


def test_client_disconnect_stops_generation(gateway: Gateway, reference: Reference) -> None:
    def runner() -> dict[str, Any]:
        return gateway.runners()[0]

    wait_until(lambda: runner()["active"] == 0, 10, "an idle runner")
    before = runner()["tokens_generated"]
    with (
        httpx.Client(timeout=30 * UNIT) as http,
        http.stream(
            "POST",
            f"{gateway.base}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": user("go on forever"),
                "max_tokens": 1500,
                "stream": True,
                # No end-of-sequence: only the disconnect can stop it early.
                "logit_bias": {str(t): -100 for t in reference.tokenizer.eos_token_ids},
            },
        ) as resp,
    ):
        seen = 0
        lines = resp.iter_lines()  # held: dropping the iterator closes the connection
        for line in lines:
            if line.startswith("data: "):
                seen += 1
            if seen >= 4:
                break
        assert runner()["active"] == 1
        generating = runner()["tokens_generated"]
        wait_until(lambda: runner()["tokens_generated"] > generating, 10, "more tokens")
    wait_until(lambda: runner()["active"] == 0, 30, "the runner to stop after the disconnect")
    # Stopped by the disconnect, far short of the 1500 tokens asked (a request leaves the
    # runner's count of active ones with its last chunk: nothing of it can come after).
    assert runner()["tokens_generated"] - before < 1500


def test_models_runners_health(gateway: Gateway, stack: tuple[Gateway, Process]) -> None:
    models = httpx.get(f"{gateway.base}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    entry = models["data"][0]
    assert entry["object"] == "model"
    assert entry["owned_by"] == "orchard"
    assert entry["state"] == "loaded"

    runners = gateway.runners()
    assert len(runners) == 1
    info = runners[0]
    assert entry["created"] == int(info["connected_since"])  # when a runner first served it
    assert set(info) == {
        "id",
        "name",
        "models",
        "max_concurrent",
        "active",
        "hardware",
        "connected_since",
        "tokens_generated",
        "requests_served",
        "draining",
        "tokens_after_cancel",
        "kv_cache",
        "memory_budget_bytes",
        "members",
    }
    assert info["members"] == []  # a single runner, not a group
    assert info["name"] == "test-runner"
    assert info["models"] == [
        {
            "id": MODEL,
            "context_length": 2048,
            "engine": engine_version(),
            "state": "loaded",
            "size_bytes": weights_bytes(Path(resolve_model(MODEL))),
            "download": None,
            "error": None,
            "defaults": None,
            "draft_model": None,
            "kv_bits": None,
            "adapter": None,
        }
    ]
    assert info["memory_budget_bytes"] is None  # one model, loaded for good: no budget
    assert info["max_concurrent"] == 8
    assert info["draining"] is False
    machine = {"chip", "cpu_count", "memory_bytes", "backend", "platform"}
    accelerator = {
        "accelerator",
        "gpu_cores",
        "accelerator_memory_bytes",
        "accelerator_limit_bytes",
    }
    assert set(info["hardware"]) == machine | accelerator
    # MLX's CPU backend here: no accelerator to report.
    assert info["hardware"]["backend"] == "cpu"
    assert {key: info["hardware"][key] for key in accelerator} == dict.fromkeys(accelerator)
    assert info["hardware"]["memory_bytes"] == psutil.virtual_memory().total
    # A finished request leaves its KV in the prefix cache, which both engines account for.
    httpx.post(
        f"{gateway.base}/v1/chat/completions",
        json={"model": MODEL, "messages": user("fill the cache"), "max_tokens": 4},
        timeout=30 * UNIT,
    ).raise_for_status()
    wait_until(
        lambda: (gateway.runners()[0]["kv_cache"]["prefix_bytes"] or 0) > 0, 3, "a KV report"
    )
    kv = gateway.runners()[0]["kv_cache"]
    if "mlx-batched" in stack[1].args:  # --max-kv-bytes bounds every KV cache
        assert kv["limit_bytes"] == KV_LIMIT
    else:  # kept prompts only, in 10 % of the memory by default
        assert kv["limit_bytes"] == int(0.1 * psutil.virtual_memory().total)
    assert 0 < kv["prefix_bytes"] <= kv["bytes"] <= kv["limit_bytes"]
    assert kv["prefixes"] >= 1  # the conversations' hashes the runner told the gateway of
    # The disk tier, on by default: a budget, and what is written so far.
    assert kv["disk_limit_bytes"] > 0
    assert 0 <= kv["disk_bytes"] <= kv["disk_limit_bytes"]

    health = httpx.get(f"{gateway.base}/health").json()
    assert health == {"status": "ok", "runners": 1, "models": [MODEL]}
    assert httpx.get(f"{gateway.base}/schema/openapi.json").status_code == 200
