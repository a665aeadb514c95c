"""A runner with a quantized KV cache (`--kv-bits 8 --quantized-kv-start 0`), end to end: a
gateway and a real batched runner on a model whose cache mlx-lm can quantize, spoken to with
the official `openai` SDK. Usage is exact, streamed or not, and the next turn of the
conversation reuses the previous one's quantized cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from runner.engine.prefix_cache import common_prefix
from tests.runner.engines import Reference
from tests.runner.engines import greedy_tokens as mlx_greedy
from tests.runner.kv_model import build_kv_model
from tests.support import UNIT, Gateway, Process, gateway_with_runner

pytestmark = pytest.mark.timeout(int(180 * UNIT))

SYSTEM = "You keep an orchard and answer briefly. " * 8


@pytest.fixture(scope="module")
def kv_model(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kv_model(demo_model_path, tmp_path_factory.mktemp("kv-e2e") / "kv-tiny")


@pytest.fixture(scope="module")
def stack(kv_model: Path) -> Iterator[tuple[Gateway, Process]]:
    with gateway_with_runner(
        *("--model", str(kv_model), "--engine", "mlx-batched"),
        *("--kv-bits", "8", "--quantized-kv-start", "0"),
    ) as stack:
        yield stack


def greedy_tokens(reference: Reference, messages: list[ChatCompletionMessageParam], n: int) -> Any:
    """What mlx-lm's own `stream_generate` answers with the same quantized cache."""
    quantized: dict[str, Any] = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}
    prompt = prompt_of(reference, messages)
    return mlx_greedy(reference.model, reference.tokenizer, prompt, n, **quantized)


def prompt_of(reference: Reference, messages: list[ChatCompletionMessageParam]) -> list[int]:
    tokens: list[int] = reference.tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True
    )
    return tokens


def test_quantized_cache_usage_and_reuse(stack: tuple[Gateway, Process], kv_model: Path) -> None:
    gateway, _ = stack
    reference = Reference(kv_model)
    client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list()]
    first: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How many trees are there?"},
    ]
    done = client.chat.completions.create(model=model, messages=first, max_tokens=8, temperature=0)
    p1 = prompt_of(reference, first)
    answer = done.choices[0].message.content
    assert answer is not None
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(p1), 8)
    assert done.usage.total_tokens == len(p1) + 8
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 0

    # The next turn, streamed: it starts from the first turn's kept (quantized) cache.
    second: list[ChatCompletionMessageParam] = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Which one is the oldest?"},
    ]
    stream = client.chat.completions.create(
        model=model,
        messages=second,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    *body, last = list(stream)
    assert last.choices == []
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in body if c.choices)
    assert text
    usage = last.usage
    assert usage is not None
    p2 = prompt_of(reference, second)
    kept = p1 + greedy_tokens(reference, first, 8)  # the first turn's prompt and answer
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(p2), 6)
    assert usage.total_tokens == len(p2) + 6
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == common_prefix(kept, p2) > len(p1)
