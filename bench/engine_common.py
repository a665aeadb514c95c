"""What the parts of scenario "engine" (bench.engine) share: the prompts every path sends,
a round's figures, the model loaded in this process, the runner's and a chat request's
arguments, and the environment note in each title."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from bench.concurrency import Result
from bench.harness import env_note
from runner.demo_model import resolve_model

Round = tuple[float, list[Result]]
"""(aggregate tok/s, one `Result` per stream), as `bench.concurrency.run_round`."""
RoundFn = Callable[[str, int, int], Round]
"""Runs one round: (tag for fresh prompts, streams, max_tokens per stream)."""


def prompt_text(tag: str, i: int) -> str:
    # The prompt bench.concurrency.run_round sends, so every path sees prompts of one length.
    return f"{tag} stream {i}: tell me a long story about an old orchard."


def say(message: str) -> None:
    print(f"[bench engine {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class InProcessModel:
    """The model loaded with mlx-lm in this process: `stream_generate` and the hand loops."""

    def __init__(self, name: str) -> None:
        from mlx_lm import load

        loaded: Any = load(resolve_model(name))
        self.model: Any = loaded[0]
        self.tokenizer: Any = loaded[1]

    def prompt(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def stream_generate(self, tag: str, streams: int, tokens: int) -> Round:
        """One stream of mlx-lm's `stream_generate`, timed as bench.inprocess times it."""
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        assert streams == 1, "stream_generate serves one stream"
        start = time.perf_counter()
        prompt = self.prompt(prompt_text(tag, 0))
        first = last = 0.0
        n = 0
        for response in stream_generate(
            self.model, self.tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(0.0)
        ):
            last = time.perf_counter()
            first = first or last
            n = response.generation_tokens
        rate = (n - 1) / (last - first) if last > first else 0.0
        return n / (last - start), [(first - start, rate, n)]


def batched_runner_args(model: str, slots: int) -> list[str]:
    return ["--model", model, "--max-concurrent", str(slots), "--engine", "mlx-batched"]


def chat_body(model: str, text: str, tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
    }


def engine_env() -> str:
    import mlx.core as mx

    return f"MLX {version('mlx')} on {mx.default_device()}, {env_note()}"
