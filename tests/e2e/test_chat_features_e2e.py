"""Chat Completions' features past plain text, end to end with the official `openai` SDK on
the real built-in model, on both engines: n, logprobs, system_fingerprint, template controls
and the errors around them. (Tool calls and structured outputs: test_tools_e2e.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest

from tests.support import Gateway, Process, Stacks

MODEL = "orchard-demo"
USER: Any = [{"role": "user", "content": "Tell me about apple trees."}]


@pytest.fixture(scope="module", params=["mlx", "mlx-batched"])
def stack(stacks: Stacks, request: pytest.FixtureRequest) -> tuple[Gateway, Process]:
    return stacks.get(request.param)


@pytest.fixture(scope="module")
def gateway(stack: tuple[Gateway, Process]) -> Gateway:
    return stack[0]


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0) as c:
        yield c


class Reference:
    """The model in-process: its prompt tokens and its log-softmax at each position."""

    def __init__(self, path: Path) -> None:
        import mlx_lm

        loaded: Any = mlx_lm.load(str(path))
        self.model, self.tokenizer = loaded[0], loaded[1]

    def prompt(self, messages: Any, **kwargs: Any) -> list[int]:
        tokens: list[int] = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **kwargs
        )
        return tokens

    def greedy(self, messages: Any, max_tokens: int) -> list[int]:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        return [
            r.token
            for r in stream_generate(
                self.model,
                self.tokenizer,
                self.prompt(messages),
                max_tokens=max_tokens,
                sampler=make_sampler(0.0),
            )
        ]

    def logprobs(self, prompt: list[int], tokens: list[int]) -> Any:
        logits = self.model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1 :, :]
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def reference(demo_model_path: Path) -> Reference:
    return Reference(demo_model_path)


# --- n -------------------------------------------------------------------------------------


def test_n_choices_not_streamed(client: openai.OpenAI, reference: Reference) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=USER, n=3, max_tokens=6, temperature=1.0, seed=7
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    texts = [c.message.content for c in response.choices]
    assert len(set(texts)) == 3
    usage = response.usage
    assert usage is not None
    assert usage.prompt_tokens == len(reference.prompt(USER))
    assert usage.completion_tokens == 18
    again = client.chat.completions.create(
        model=MODEL, messages=USER, n=3, max_tokens=6, temperature=1.0, seed=7
    )
    assert [c.message.content for c in again.choices] == texts


def test_n_choices_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        n=2,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    finishes: dict[int, str | None] = {}
    for chunk in chunks[:2]:
        assert chunk.choices[0].delta.role == "assistant"
    assert sorted(c.choices[0].index for c in chunks[:2]) == [0, 1]
    for chunk in chunks[2:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    # Greedy choices are the same text.
    assert texts[0] == texts[1] != ""


def test_n_above_the_gateways_limit_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, n=9, max_tokens=2)
    body: Any = info.value.body
    assert (body["param"], body["code"]) == ("n", "integer_above_max_value")


# --- logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_models_own(
    client: openai.OpenAI, reference: Reference, stream: bool
) -> None:
    kwargs: Any = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    if stream:
        entries = [
            entry
            for chunk in client.chat.completions.create(**kwargs, stream=True)
            for choice in chunk.choices
            if choice.logprobs is not None
            for entry in choice.logprobs.content or []
        ]
    else:
        response = client.chat.completions.create(**kwargs)
        logprobs = response.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.refusal is None
        entries = logprobs.content or []
    assert len(entries) == 6
    tokens = reference.greedy(USER, 6)
    assert [e.token for e in entries] == [reference.tokenizer.decode([t]) for t in tokens]
    expected = reference.logprobs(reference.prompt(USER), tokens)
    for entry, token, vector in zip(entries, tokens, expected, strict=True):
        assert entry.logprob == pytest.approx(vector[token].item(), abs=1e-3)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        best: list[int] = mx.argsort(-vector)[:3].tolist()  # type: ignore[assignment]  # 1-D
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [vector[i].item() for i in best], abs=1e-3
        )


def test_top_logprobs_need_logprobs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, top_logprobs=2)
    body: Any = info.value.body
    assert (body["param"], body["code"]) == ("top_logprobs", "invalid_parameter_combination")


# --- fields and checks OpenAI clients rely on ----------------------------------------------


def test_system_fingerprint_is_stable(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    second = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    assert first.system_fingerprint is not None
    assert first.system_fingerprint.startswith("fp_")
    assert len(first.system_fingerprint) == 13
    assert second.system_fingerprint == first.system_fingerprint
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, stream=True)
    )
    assert {c.system_fingerprint for c in chunks} == {first.system_fingerprint}
    usage = first.usage
    assert usage is not None
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.audio_tokens == 0


def test_logit_bias_outside_the_vocabulary_names_logit_bias(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, logit_bias={"999999": 5}
        )
    body: Any = info.value.body
    assert (body["param"], body["code"]) == ("logit_bias", "invalid_value")
    assert "999999" in body["message"]


def test_the_model_is_examined_first(gateway: Gateway) -> None:
    response = httpx.post(
        f"{gateway.base}/v1/chat/completions",
        json={"model": "no-such-model", "messages": "not a list", "bogus": 1},
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "extra",
    [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}],
)
def test_thinking_off_through_the_chat_template(
    client: openai.OpenAI, reference: Reference, extra: dict[str, Any]
) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body=extra
    )
    usage = response.usage
    assert usage is not None
    assert usage.prompt_tokens == len(reference.prompt(USER, enable_thinking=False))
    assert usage.prompt_tokens > len(reference.prompt(USER))


def test_reasoning_effort_high_leaves_the_prompt_alone(
    client: openai.OpenAI, reference: Reference
) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, reasoning_effort="high"
    )
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(reference.prompt(USER))
