"""`orchard runner --draft-model` through a real gateway, with the openai SDK: the answers are
the model's own (as a runner without a draft gives them, streamed and not, usage exact), and
the draft's drafted and accepted tokens show in `/v1/runners` and `/metrics`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.support import SHARED_MODEL, Gateway, Process, Stacks, gateway_with_runner, wait_until

PROMPTS = ["Tell me about apples.", "Write a poem about the sea.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def drafted() -> Iterator[tuple[Gateway, Process]]:
    with gateway_with_runner(
        "--model", SHARED_MODEL, "--draft-model", SHARED_MODEL, "--num-draft-tokens", "3"
    ) as stack:
        yield stack


def answers(base: str, *, stream: bool) -> list[tuple[str, int, int]]:
    """Each prompt's greedy answer, prompt tokens and completion tokens."""
    got = []
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
        for prompt in PROMPTS:
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
            if not stream:
                done = client.chat.completions.create(
                    model=SHARED_MODEL, messages=messages, max_tokens=48, temperature=0
                )
                assert done.usage is not None
                text = done.choices[0].message.content or ""
                got.append((text, done.usage.prompt_tokens, done.usage.completion_tokens))
                continue
            chunks = list(
                client.chat.completions.create(
                    model=SHARED_MODEL,
                    messages=messages,
                    max_tokens=48,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = chunks[-1].usage
            assert usage is not None
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            got.append((text, usage.prompt_tokens, usage.completion_tokens))
    return got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_are_the_models_own(
    drafted: tuple[Gateway, Process], stacks: Stacks, stream: bool
) -> None:
    plain, _ = stacks.get("mlx-batched")
    want = answers(plain.base, stream=stream)
    assert all(completion > 0 for _, _, completion in want)
    assert answers(drafted[0].base, stream=stream) == want


def test_drafted_and_accepted_tokens_are_shown(drafted: tuple[Gateway, Process]) -> None:
    gateway, _ = drafted
    answers(gateway.base, stream=False)  # the first request drafts (runner.engine.speculative)

    def shown() -> dict[str, object] | None:
        (runner,) = gateway.runners()
        (model,) = runner["models"]
        spec = model.get("speculative")
        return spec if spec and spec["drafted_tokens"] else None

    wait_until(lambda: shown() is not None, 10, "a heartbeat with the draft's counts")
    spec = shown()
    assert spec is not None
    assert set(spec) == {"draft_model", "drafted_tokens", "accepted_tokens", "acceptance_rate"}
    assert spec["draft_model"] == SHARED_MODEL
    drafted_tokens, accepted = spec["drafted_tokens"], spec["accepted_tokens"]
    assert isinstance(drafted_tokens, int)
    assert isinstance(accepted, int)
    assert 0 < accepted <= drafted_tokens  # the model as its own draft: nearly all kept
    assert spec["acceptance_rate"] == accepted / drafted_tokens
    (runner,) = gateway.runners()
    assert runner["models"][0]["draft_model"] == SHARED_MODEL
    metrics = httpx.get(f"{gateway.base}/metrics", timeout=5).text
    samples = {
        (s.name, s.labels["model"]): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name.startswith("orchard_runner_speculative_")
    }
    # The counters as the last heartbeat had them: at least what /v1/runners showed before.
    assert samples[("orchard_runner_speculative_drafted_tokens_total", SHARED_MODEL)] >= (
        drafted_tokens
    )
    assert samples[("orchard_runner_speculative_accepted_tokens_total", SHARED_MODEL)] >= accepted
