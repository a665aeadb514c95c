"""Per-request sampling on mlx-lm: the sampler and the logits processors of a request.

Both follow OpenAI's semantics rather than mlx-lm's defaults where they differ:

- temperature is applied before top-p / min-p / top-k (mlx-lm's `make_sampler` applies it
  after), as OpenAI and vLLM do;
- every sampled request draws from its own PRNG key, split at each token, so a seeded request
  is reproducible whatever runs alongside it;
- presence and frequency penalties count this request's generated tokens only (mlx-lm's look
  at the last 20 tokens, prompt included).

A runner's defaults for a model (`orchard runner --temp/--top-p/--top-k/--min-p`) replace
what the client left out (`with_defaults`); what it set always wins.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from protocol.frames import SamplingDefaults, SamplingParams

Sampler = Callable[[Any], Any]
"""Log-probabilities (1, vocab) to a token array (1,)."""
LogitsProcessor = Callable[[Any, Any], Any]
"""(tokens so far, logits) to logits, as mlx-lm calls it."""

_unseeded = random.Random()
"""Draws the keys of requests without a seed; only engine threads use it."""


def seed_unseeded(seed: int) -> None:
    """Make the keys of requests without a seed repeat: a runner group's ranks seed it alike,
    so that every rank samples the same tokens."""
    _unseeded.seed(seed)


def with_defaults(params: SamplingParams, defaults: SamplingDefaults) -> SamplingParams:
    """`params` with each parameter the client left out (`params.unset`) set to the model's
    default where it has one; those are no longer unset. `params` itself when none applies."""
    given = {name: getattr(defaults, name) for name in params.unset}
    applied = {name: value for name, value in given.items() if value is not None}
    if not applied:
        return params
    unset = tuple(name for name in params.unset if name not in applied)
    return attrs.evolve(params, unset=unset, **applied)


def make_sampler_for(params: SamplingParams, vocab_size: int) -> Sampler:
    """The sampler of a request: plain argmax at temperature 0 (exactly mlx-lm's greedy)."""
    if params.temperature <= 0:
        sampler: Sampler = make_sampler(0.0)
        return sampler
    return RandomSampler(params, vocab_size)


class RandomSampler:
    """Temperature, then top-p / min-p / top-k, then a draw with this request's own PRNG key.

    A shared generator would interleave the draws of concurrent requests; a key split at every
    token gives a seeded request the same draws whatever runs alongside it.
    """

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        seed = params.seed if params.seed is not None else _unseeded.getrandbits(64)
        self._key = mx.random.key(seed % 2**64)
        self._inverse_temperature = 1.0 / params.temperature
        self._filters: list[Callable[[Any], Any]] = []
        top_p, min_p, top_k = params.top_p, params.min_p, params.top_k
        if 0.0 < top_p < 1.0:
            self._filters.append(lambda logprobs: apply_top_p(logprobs, top_p))
        if 0.0 < min_p <= 1.0:
            self._filters.append(lambda logprobs: apply_min_p(logprobs, min_p))
        if 0 < top_k < vocab_size:
            self._filters.append(lambda logprobs: apply_top_k(logprobs, top_k))

    def __call__(self, logprobs: Any) -> Any:
        scaled = logprobs * self._inverse_temperature
        # Renormalised so the filters see log-probabilities (top-p sums their exponentials).
        scaled = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        for keep in self._filters:
            scaled = keep(scaled)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(scaled, key=key)


def make_logits_processors(
    params: SamplingParams, prompt_length: int, constraint: LogitsProcessor | None = None
) -> list[LogitsProcessor]:
    """Logit bias and penalties, then the request's constraint (`constraint.Constraint`'s
    processor), last: its mask must have the final word. `prompt_length` is the number of
    prompt tokens given to mlx-lm (after the prefix cache), which its `tokens` argument
    starts with."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        bias = {entry.token: entry.bias for entry in params.logit_bias}
        processors.append(LogitBias(bias))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(
            Penalties(params.presence_penalty, params.frequency_penalty, prompt_length)
        )
    if constraint is not None:
        processors.append(constraint)
    return processors


class LogitBias:
    """Adds a fixed bias to some tokens' logits."""

    def __init__(self, bias: dict[int, float]) -> None:
        self._ids = mx.array(list(bias))
        self._values = mx.array(list(bias.values()))

    def __call__(self, tokens: Any, logits: Any) -> Any:
        return logits.at[:, self._ids].add(self._values.astype(logits.dtype))


class Penalties:
    """OpenAI's presence and frequency penalties, over this request's generated tokens only.

    `tokens` (from mlx-lm) is the prompt this generator was given, then the generated tokens.
    """

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self._presence = presence
        self._frequency = frequency
        self._skip = prompt_length

    def __call__(self, tokens: Any, logits: Any) -> Any:
        generated = tokens[self._skip :]
        if generated.size == 0:
            return logits
        counts = mx.zeros((logits.shape[-1],), dtype=logits.dtype).at[generated].add(1.0)
        return logits - (counts * self._frequency + (counts > 0) * self._presence)
