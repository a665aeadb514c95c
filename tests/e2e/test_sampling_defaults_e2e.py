"""A runner's sampling defaults end to end: `orchard runner --top-k 1 --max-tokens 5` behind a
real gateway, the official `openai` SDK (and Ollama's API over httpx) as clients, on both mlx
engines. A default replaces only what a request leaves out; `/v1/runners` shows them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support import Gateway, Process, start_runner

MODEL = "orchard-demo"
PROMPT = "Tell me about apples."


@pytest.fixture(scope="module", params=["mlx", "mlx-batched"])
def gateway(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    gw = Gateway()
    runner: Process | None = None
    try:
        runner = start_runner(
            gw, "--model", MODEL, "--engine", request.param, "--top-k", "1", "--max-tokens", "5"
        )
        gw.wait_for_runners(1)
        yield gw
    finally:
        if runner is not None:
            runner.stop()
        gw.stop()


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _ask(client: openai.OpenAI, **fields: Any) -> tuple[str, int, str]:
    """(content, completion tokens, finish reason) of a chat completion."""
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        **fields,
    )
    (choice,) = completion.choices
    assert completion.usage is not None
    return choice.message.content or "", completion.usage.completion_tokens, choice.finish_reason


def test_runners_show_the_models_defaults(gateway: Gateway) -> None:
    (runner,) = gateway.runners()
    (model,) = runner["models"]
    assert model["id"] == MODEL
    assert {k: model[k] for k in ("defaults", "draft_model", "kv_bits", "adapter")} == {
        "defaults": {"top_k": 1, "max_tokens": 5},
        "draft_model": None,
        "kv_bits": None,
        "adapter": None,
    }


def test_a_default_top_k_of_one_makes_an_unseeded_request_greedy(client: openai.OpenAI) -> None:
    greedy = _ask(client, temperature=0, max_tokens=12)
    assert greedy[1:] == (12, "length")
    # Temperature 1 (OpenAI's default) and no seed: only top_k's default makes this exact.
    assert _ask(client, max_tokens=12) == greedy
    assert _ask(client, max_tokens=12, top_p=1.0) == greedy


def test_a_top_k_the_request_sets_is_not_overridden(client: openai.OpenAI) -> None:
    greedy = _ask(client, temperature=0, max_tokens=12)
    sampled = _ask(client, max_tokens=12, seed=1, extra_body={"top_k": 0})
    assert sampled[1:] == (12, "length")
    assert sampled[0] != greedy[0]
    # Seeded, it repeats: the runner's default did not creep in on either run.
    assert _ask(client, max_tokens=12, seed=1, extra_body={"top_k": 0}) == sampled


def test_a_default_max_tokens_bounds_only_a_request_without_one(client: openai.OpenAI) -> None:
    assert _ask(client, temperature=0)[1:] == (5, "length")
    assert _ask(client, temperature=0, max_tokens=8)[1:] == (8, "length")
    # The five are the first five of the longer answer.
    short = _ask(client, temperature=0)[0]
    assert _ask(client, temperature=0, max_tokens=8)[0].startswith(short)


def test_ollamas_own_defaults_give_way_to_the_runners(
    gateway: Gateway, client: openai.OpenAI
) -> None:
    greedy = _ask(client, temperature=0, max_tokens=12)[0]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": False,
        # Ollama's temperature 0.8 and top_k 40, were they not replaced, would sample.
        "options": {"num_predict": 12},
    }
    answer = httpx.post(f"{gateway.base}/api/chat", json=body, timeout=60).json()
    assert (answer["message"]["content"], answer["eval_count"]) == (greedy, 12)
