"""OpenAI's legacy text completions end to end: the official `openai` SDK's
`client.completions.create` against a real gateway and a real runner on the built-in model,
on both engines. At temperature 0 the text is mlx-lm's own greedy generation on the same raw
prompt, and every logprob is the model's log-softmax from an in-process forward pass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import openai
import pytest

from tests.support import Gateway, Process, Stacks

MODEL = "orchard-demo"
PROMPT = "Once upon a time, in an orchard"
OTHER = "The apple trees"


@pytest.fixture(scope="module", params=["mlx", "mlx-batched"])
def stack(stacks: Stacks, request: pytest.FixtureRequest) -> tuple[Gateway, Process]:
    return stacks.get(request.param)


@pytest.fixture(scope="module")
def client(stack: tuple[Gateway, Process]) -> Iterator[openai.OpenAI]:
    base = f"{stack[0].base}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as c:
        yield c


class Reference:
    """The model in-process, on raw prompts (no chat template)."""

    def __init__(self, path: Path) -> None:
        import mlx_lm

        loaded: Any = mlx_lm.load(str(path))
        self.model, self.tokenizer = loaded[0], loaded[1]

    def tokens(self, prompt: str) -> list[int]:
        tokens: list[int] = self.tokenizer.encode(prompt)
        return tokens

    def greedy(self, prompt: str | list[int], max_tokens: int) -> tuple[str, list[int]]:
        """The tokens stream_generate picks greedily, and their text as the tokenizer decodes
        them: a continuation keeps its first token's leading space (stream_generate's own text
        drops it)."""
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        tokens = [
            response.token
            for response in stream_generate(
                self.model,
                self.tokenizer,
                prompt,
                max_tokens=max_tokens,
                sampler=make_sampler(0.0),
            )
        ]
        text: str = self.tokenizer.decode(tokens)
        return text, tokens

    def log_softmax(self, tokens: list[int]) -> Any:
        """The model's log-softmax at each position of `tokens`, in one forward pass."""
        logits = self.model(mx.array([tokens]))[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def decode(self, token: int) -> str:
        text: str = self.tokenizer.decode([token])
        return text


@pytest.fixture(scope="module")
def reference(demo_model_path: Path) -> Reference:
    return Reference(demo_model_path)


def test_a_completion_is_mlx_lms_greedy_text(client: openai.OpenAI, reference: Reference) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    expected, tokens = reference.greedy(PROMPT, 16)  # the legacy default max_tokens
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert response.model == MODEL
    assert response.system_fingerprint is not None
    assert response.system_fingerprint.startswith("fp_")
    (choice,) = response.choices
    assert (choice.text, choice.index, choice.finish_reason) == (expected, 0, "length")
    assert choice.logprobs is None
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        len(reference.tokens(PROMPT)),
        len(tokens),
    )


def test_streamed_with_usage(client: openai.OpenAI, reference: Reference) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    *texts, finish, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(reference.tokens(PROMPT)),
        10,
    )
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert "".join(c.choices[0].text for c in texts) == reference.greedy(PROMPT, 10)[0]
    assert (finish.choices[0].text, finish.choices[0].finish_reason) == ("", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(client: openai.OpenAI, reference: Reference, stream: bool) -> None:
    kwargs: Any = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "n": 3}
    texts: dict[int, str] = {}
    if stream:
        for chunk in client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
    else:
        response = client.completions.create(**kwargs)
        texts = {choice.index: choice.text for choice in response.choices}
        assert response.usage is not None
        assert response.usage.completion_tokens == 15
    assert texts == dict.fromkeys(range(3), reference.greedy(PROMPT, 5)[0])


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_models_own(
    client: openai.OpenAI, reference: Reference, stream: bool
) -> None:
    kwargs: Any = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
    }
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if stream:
        for chunk in client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens or []
                    values += choice.logprobs.token_logprobs or []
                    tops += choice.logprobs.top_logprobs or []
                    offsets += choice.logprobs.text_offset or []
    else:
        logprobs = client.completions.create(**kwargs).choices[0].logprobs
        assert logprobs is not None
        tokens = logprobs.tokens or []
        values = list(logprobs.token_logprobs or [])
        tops = list(logprobs.top_logprobs or [])
        offsets = logprobs.text_offset or []
    prompt = reference.tokens(PROMPT)
    text, generated = reference.greedy(PROMPT, 6)
    assert tokens == [reference.decode(t) for t in generated]
    expected = reference.log_softmax(prompt + generated[:-1])[len(prompt) - 1 :]
    for token, value, top, row in zip(generated, values, tops, expected, strict=True):
        assert value == pytest.approx(row[token].item(), abs=1e-3)
        assert top is not None
        best: list[int] = mx.argsort(-row)[:2].tolist()  # type: ignore[assignment]  # 1-D
        # The two most likely, and the chosen one (here the most likely itself).
        assert top == pytest.approx({reference.decode(i): row[i].item() for i in best}, abs=1e-3)
    # Characters from the start of the prompt (not echoed).
    assert offsets[0] == len(PROMPT)
    assert offsets == [len(PROMPT) + len("".join(tokens[:i])) for i in range(len(tokens))]
    # The text is its tokens', a leading space of the first one included (as at OpenAI).
    assert "".join(tokens) == text


def test_echo(client: openai.OpenAI, reference: Reference) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert response.choices[0].text == PROMPT + reference.greedy(PROMPT, 4)[0]
    streamed = "".join(
        choice.text
        for chunk in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
        )
        for choice in chunk.choices
    )
    assert streamed == response.choices[0].text


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_scores_the_prompt(
    client: openai.OpenAI, reference: Reference, max_tokens: int
) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
    )
    (choice,) = response.choices
    logprobs = choice.logprobs
    assert logprobs is not None
    prompt = reference.tokens(PROMPT)
    text, generated = reference.greedy(PROMPT, max_tokens) if max_tokens else ("", [])
    assert choice.text == PROMPT + text
    assert choice.finish_reason == "length"
    everything = prompt + generated
    assert logprobs.tokens == [reference.decode(t) for t in everything]
    # The SDK types these as numbers and dicts: a null is OpenAI's too, for the first token.
    values: list[Any] = list(logprobs.token_logprobs or [])
    tops: list[Any] = list(logprobs.top_logprobs or [])
    assert (values[0], tops[0]) == (None, None)  # nothing precedes the first token
    rows = reference.log_softmax(everything[:-1])
    for position, token in enumerate(everything[1:]):
        row = rows[position]
        assert values[position + 1] == pytest.approx(row[token].item(), abs=1e-3)
        # The most likely token there, and the one the prompt has (often not the same).
        best: int = mx.argmax(row).item()  # type: ignore[assignment]  # an index
        assert tops[position + 1] == pytest.approx(
            {reference.decode(i): row[i].item() for i in (best, token)}, abs=1e-3
        )
    assert logprobs.text_offset == [
        len("".join(logprobs.tokens[:i])) for i in range(len(everything))
    ]
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        len(prompt),
        max_tokens,
    )


def test_stop(client: openai.OpenAI, reference: Reference) -> None:
    full, _ = reference.greedy(PROMPT, 16)
    stop = full[6:9]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (full[: full.index(stop)], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts(client: openai.OpenAI, reference: Reference, stream: bool) -> None:
    kwargs: Any = {
        "model": MODEL,
        "prompt": [PROMPT, OTHER],
        "max_tokens": 5,
        "temperature": 0,
        "n": 2,
    }
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    if stream:
        chunks = list(
            client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        usage = chunks[-1].usage
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason is not None:
                    assert choice.index not in finishes
                    finishes[choice.index] = choice.finish_reason
    else:
        response = client.completions.create(**kwargs)
        usage = response.usage
        texts = {choice.index: choice.text for choice in response.choices}
        finishes = {choice.index: choice.finish_reason for choice in response.choices}
    # prompt_index * n + choice, as OpenAI numbers them.
    first, second = reference.greedy(PROMPT, 5)[0], reference.greedy(OTHER, 5)[0]
    assert texts == {0: first, 1: first, 2: second, 3: second}
    assert finishes == dict.fromkeys(range(4), "length")
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(reference.tokens(PROMPT)) + len(reference.tokens(OTHER)),
        20,
    )


def test_token_id_prompts(client: openai.OpenAI, reference: Reference) -> None:
    ids = reference.tokens(PROMPT)
    other = reference.tokens(OTHER)
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert one.choices[0].text == reference.greedy(ids, 5)[0]
    both = client.completions.create(
        model=MODEL, prompt=[ids, other], max_tokens=5, temperature=0, echo=True
    )
    assert [c.text for c in both.choices] == [
        reference.tokenizer.decode(ids) + reference.greedy(ids, 5)[0],
        reference.tokenizer.decode(other) + reference.greedy(other, 5)[0],
    ]


def test_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, suffix="The end.")
    body: Any = info.value.body
    assert (body["param"], body["code"]) == ("suffix", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, best_of=2)
    body = info.value.body
    assert (body["param"], body["code"]) == ("best_of", "unsupported_value")
    # A token outside the vocabulary is the runner's to find; the prompt at fault is named.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[[1, 2], [10**9]], max_tokens=2)
    body = info.value.body
    assert body["param"] == "prompt[1]"
    assert "outside this model's vocabulary" in body["message"]
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt=PROMPT, suffix="x")
    body = not_found.value.body
    assert body["code"] == "model_not_found"
