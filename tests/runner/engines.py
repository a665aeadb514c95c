"""The engines under test, each with what to expect of it, for the contract suite and the
engine-specific modules: a plain mlx-lm reference to compare the mlx engines with, and the
`EngineCase` of each engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from protocol.frames import Generate, LogitBias, Message, SamplingParams
from runner.accounting import Piece, RequestAccounting
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import Engine
from runner.engine.batched import batched_engine
from runner.engine.mlx_engine import MlxEngine
from runner.engine.scripted import ScriptedEngine, scripted_prompt_tokens

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "Tell me about apples.",
    "What is 2+2?",
    "Hello",
    "Write a poem about the sea.",
    "Orchards in winter?",
    "Why is the sky blue?",
    "List three fruits.",
    "Say something.",
]


def ask(request_id: str, content: str = "Hello there", **fields: Any) -> Generate:
    return Generate(request_id, DEMO_MODEL_ID, (Message("user", content),), **fields)


class Reference:
    """Plain in-process mlx-lm on this (the main) thread: what the mlx engines must reproduce."""

    def __init__(self, path: Path) -> None:
        import mlx_lm

        loaded: Any = mlx_lm.load(str(path))  # annotated as a 2- or 3-tuple
        self.model, self.tokenizer = loaded[0], loaded[1]
        self._greedy: dict[tuple[tuple[int, ...], int], tuple[list[int], list[str]]] = {}

    def prompt(self, generate: Generate) -> list[int]:
        messages = [{"role": m.role, "content": m.content} for m in generate.messages]
        tokens: list[int] = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokens

    def greedy(self, generate: Generate) -> tuple[list[int], list[str]]:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        assert generate.max_tokens is not None
        # Greedy is a function of the prompt and the length: each is run once per session.
        key = (tuple(self.prompt(generate)), generate.max_tokens)
        if key not in self._greedy:
            responses = list(
                stream_generate(
                    self.model,
                    self.tokenizer,
                    list(key[0]),
                    max_tokens=generate.max_tokens,
                    sampler=make_sampler(0.0),
                )
            )
            self._greedy[key] = [r.token for r in responses], [r.text for r in responses]
        tokens, texts = self._greedy[key]
        return list(tokens), list(texts)


@attrs.frozen
class EngineCase:
    """One engine under the contract suite, and what to expect of it."""

    name: str
    make: Callable[..., Engine]
    """A new engine serving DEMO_MODEL_ID with a 2,048-token context; options: max_concurrent
    and the engine's own."""
    prompt_tokens: Callable[[Generate], int]
    """The prompt usage the engine reports."""
    texts: Callable[[Generate], list[str]]
    """The text of each token of a (greedy) request, stop strings aside."""
    long: int
    """A max_tokens that keeps a request running until the test ends it."""
    has_model: bool
    """Prompt speed and peak memory are measured (the scripted engine reports zeros)."""
    end_of_sequence: Callable[[Generate], tuple[dict[str, Any], Generate, str]]
    """How to have a request end on its own at its first token: engine options, the request,
    and that token's text."""
    fail_third_token: Callable[[pytest.MonkeyPatch, Generate], dict[str, Any]]
    """Make handling the third token of a request fail (RuntimeError "injected failure"); the
    engine options that takes."""


MakeMlxEngine = Callable[..., MlxEngine]
"""An mlx engine from a model and options: `MlxEngine` or `batched.batched_engine`."""
MLX_ENGINES: dict[str, MakeMlxEngine] = {"mlx": MlxEngine, "mlx-batched": batched_engine}
"""The mlx engines by test id: interleaved and batched."""
ENGINE_NAMES = [*MLX_ENGINES, "scripted"]


def engine_case(name: str, reference: Callable[[], Reference]) -> EngineCase:
    """The case of engine `name`; `reference` is only called for the mlx engines."""
    if name == "scripted":
        return _scripted_case()
    make = MLX_ENGINES[name]
    return _mlx_case(name, lambda **options: make(DEMO_MODEL_ID, **options), reference())


def _mlx_case(name: str, make: Callable[..., Engine], reference: Reference) -> EngineCase:
    def end_of_sequence(request: Generate) -> tuple[dict[str, Any], Generate, str]:
        eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
        sampling = SamplingParams(temperature=0, logit_bias=(LogitBias(eos, 100.0),))
        return {}, attrs.evolve(request, sampling=sampling), ""

    def fail_third_token(monkeypatch: pytest.MonkeyPatch, request: Generate) -> dict[str, Any]:
        # Both mlx decoders feed every token to the request's RequestAccounting; the request
        # is told apart by its prompt length (the test keeps it unique).
        prompt_tokens = len(reference.prompt(request))
        real = RequestAccounting.feed

        def feed(self: RequestAccounting, token_id: int, text: str) -> Piece:
            piece = real(self, token_id, text)
            if self.prompt_tokens == prompt_tokens and self.completion_tokens == 3:
                raise RuntimeError("injected failure")
            return piece

        monkeypatch.setattr(RequestAccounting, "feed", feed)
        return {}

    return EngineCase(
        name=name,
        make=make,
        prompt_tokens=lambda request: len(reference.prompt(request)),
        texts=lambda request: reference.greedy(request)[1],
        long=1500,
        has_model=True,
        end_of_sequence=end_of_sequence,
        fail_third_token=fail_third_token,
    )


def scripted_text(request: Generate, index: int) -> str:
    """Text naming its request, so that mixed-up streams show."""
    return f"{request.request_id}:{index} "


def _scripted_case() -> EngineCase:
    def make(**options: Any) -> Engine:
        options.setdefault("text", scripted_text)
        return ScriptedEngine(models=(DEMO_MODEL_ID,), context_length=2048, **options)

    def texts(request: Generate) -> list[str]:
        assert request.max_tokens is not None
        return [scripted_text(request, i) for i in range(request.max_tokens)]

    def end_of_sequence(request: Generate) -> tuple[dict[str, Any], Generate, str]:
        return {"eos_after": 1}, request, scripted_text(request, 0)

    def fail_third_token(monkeypatch: pytest.MonkeyPatch, request: Generate) -> dict[str, Any]:
        def text(generate: Generate, index: int) -> str:
            if generate.request_id == request.request_id and index == 2:
                raise RuntimeError("injected failure")
            return scripted_text(generate, index)

        return {"text": text}

    return EngineCase(
        name="scripted",
        make=make,
        prompt_tokens=lambda request: scripted_prompt_tokens(request.messages),
        texts=texts,
        long=10**9,
        has_model=False,
        end_of_sequence=end_of_sequence,
        fail_third_token=fail_third_token,
    )


def greedy_tokens(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    max_tokens: int,
    processors: list[Any] | None = None,
    **options: Any,
) -> list[int]:
    """mlx-lm's own greedy decode (`stream_generate`, a token at a time) with these logits
    processors and `generate_step` options (a quantized cache's): every token, an ending end
    of sequence included."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    responses = stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampler=make_sampler(0.0),
        logits_processors=processors,
        **options,
    )
    return [response.token for response in responses]
