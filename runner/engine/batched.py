"""An Engine on mlx-lm's continuous batching: one forward pass per step for all running requests.

`MlxEngine(strategy=Batched(...))` is the same engine (thread, intake, accounting and prefix
cache) with `BatchedStepping`: every request the batch can take becomes a row of one
`batch_decoder.BatchDecoder`. Requests the batch cannot serve exactly run on an
`interleaved.InterleavedDecoder` (their own `stream_generate`), in the same thread, a token per
step alongside the batch:

- a sampled request with a fixed `seed`: its draws must not depend on what runs alongside it,
  and a batch row's logits are only bit-identical to a lone run when the rows line up.

Everything else (greedy, sampled without a seed, logit_bias, penalties) is batched. A request
that arrives with nothing else running or waiting starts alone on a plain KV cache
(`solo.SoloDecoder`: `stream_generate`'s speed, no batch mask) and joins the batch as a row,
its cache and state carried over, when a second request is placed (a request whose sliding
window cache has passed its size cannot go back a token: it goes on alone, beside the
batch).

KV memory: `EngineStats.kv_bytes` is the bytes held by KV caches now (batch, lone and interleaved
requests and the prefix cache); with `max_kv_bytes` set, a request only starts when the worst
case of every running request (prompt + max_tokens each, rows padded to the longest as
`BatchKVCache` lays them out, a lone request counted as a row) fits, evicting prefix-cache
entries first. Transient copies while a new row joins the batch are not counted.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from protocol.frames import SamplingParams
from runner.engine.batch_decoder import BatchDecoder
from runner.engine.generation import Decoder, Generation, Stepping
from runner.engine.interleaved import InterleavedDecoder
from runner.engine.mlx_engine import MlxEngine
from runner.engine.request import Request
from runner.engine.solo import SoloDecoder
from runner.engine.stats import EngineStats
from runner.errors import RequestError

log = logging.getLogger("runner.engine.batched")

KV_STEP = 256
"""mlx-lm's KV caches grow in steps of this many tokens."""


@attrs.frozen
class Batched:
    """The batched strategy (`mlx_engine.Strategy`): `BatchedStepping` within a KV budget.

    `max_kv_bytes` bounds every KV cache in memory together (None: no bound but the prefix
    cache's); kept prompts take from the same budget, which is the prefix cache's bound unless
    the engine is given its own. The rest are the batch's prefill settings."""

    max_kv_bytes: int | None = None
    prefill_batch_size: int = 32
    prefill_step_size: int = 512
    """Smaller than mlx-lm's 2048: a long prompt joining the batch holds up the running
    requests for one chunk per step."""
    prefill_share: float | None = 3.0
    """While requests decode, a step prefills about this many decode steps' worth of prompt
    tokens (None: no bound but the two above)."""

    def stepping(self, generation: Generation, stats: EngineStats) -> Stepping:
        return BatchedStepping(
            generation,
            stats=stats,
            max_kv_bytes=self.max_kv_bytes,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
            prefill_share=self.prefill_share,
        )

    def prefix_bytes(self) -> int | None:
        return self.max_kv_bytes

    def kv_bytes(self, stats: EngineStats, prefix: int | None) -> int | None:
        return stats.kv_bytes

    def kv_limit(self, prefix_cache_bytes: int | None) -> int | None:
        return self.max_kv_bytes


def batched_engine(
    model: str,
    max_concurrent: int = 32,
    *,
    max_kv_bytes: int | None = None,
    prefill_batch_size: int = 32,
    prefill_step_size: int = 512,
    prefill_share: float | None = 3.0,
    **options: Any,
) -> MlxEngine:
    """`MlxEngine(model, max_concurrent, strategy=Batched(...), **options)`, with 32 slots by
    default: the preset the benchmarks and tests make batched engines with."""
    strategy = Batched(max_kv_bytes, prefill_batch_size, prefill_step_size, prefill_share)
    return MlxEngine(model, max_concurrent, strategy=strategy, **options)


class BatchedStepping:
    """A batch for most requests, interleaved decoding for the rest, within a KV budget."""

    def __init__(
        self,
        generation: Generation,
        *,
        stats: EngineStats,
        max_kv_bytes: int | None,
        prefill_batch_size: int,
        prefill_step_size: int,
        prefill_share: float | None = None,
    ) -> None:
        self._generation = generation
        self._stats = stats
        self._max_kv_bytes = max_kv_bytes
        self._batch = BatchDecoder(
            generation,
            max_concurrent=generation.max_concurrent,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
            prefill_share=prefill_share,
        )
        self._own_streams = InterleavedDecoder(generation)
        self._solo = SoloDecoder(generation)
        self._bytes_per_token = stats.kv_bytes_per_token = _bytes_per_token(generation.model.model)
        full = self.reserve(generation.model.context_length)
        if max_kv_bytes is not None and full > max_kv_bytes:
            log.warning(
                "max_kv_bytes %d is below one full context (%d bytes): long requests are refused",
                max_kv_bytes,
                full,
            )

    def reserve(self, tokens: int) -> int:
        """Most bytes a KV cache holding `tokens` tokens can take.

        mlx-lm's caches grow from their current length by whole steps, so the capacity is
        below `tokens + KV_STEP`, not necessarily a multiple of the step.
        """
        return (tokens + KV_STEP - 1) * self._bytes_per_token

    def check(self, request: Request) -> None:
        """Refuse a request that could not run even alone within `max_kv_bytes`."""
        limit = self._max_kv_bytes
        need = self.reserve(len(request.prompt) + request.max_tokens)
        if limit is not None and need > limit:
            raise RequestError(
                "context_length_exceeded",
                f"This runner's KV-cache budget is {limit} bytes; the request may need "
                f"{need} ({len(request.prompt)} prompt + {request.max_tokens} completion "
                "tokens). Ask for fewer max_tokens.",
            )

    def place(self, request: Request) -> Decoder | None:
        """Its own stream (a seeded sampled request), the plain-cache decoder (a request
        alone: nothing else running or waiting) or the batch; None while the KV budget
        cannot take it. A lone request joins the batch when a second one is placed, unless
        its cache cannot go back a token (a sliding window past its size): then it goes on
        alone beside the batch."""
        own_stream = needs_own_stream(request.generate.sampling)
        if not self._fits(request, own_stream=own_stream):
            return None
        stats = self._stats
        if own_stream:
            stats.fallback_requests += 1
            return self._own_streams
        stats.batched_requests += 1
        solo, batch = self._solo, self._batch
        if len(solo):
            if solo.can_hand_over():
                handover = solo.hand_over()
                assert handover is not None
                batch.join(handover)
        elif solo.usable and not len(batch) and len(self._generation.waiting) == 1:
            # `request` is still the head of the queue: nothing waits behind it.
            stats.solo_requests += 1
            return solo
        return batch

    def step(self) -> None:
        """One batch step (decode + pending prefill), the lone request's token, then a
        token for each request on its own stream."""
        stats = self._stats
        batch = self._batch
        stats.peak_batch_size = max(stats.peak_batch_size, len(batch))
        solo = self._solo
        if len(batch):
            batch.decoding_elsewhere = bool(len(solo) or len(self._own_streams))
            batch.step()
        if len(solo):
            solo.step()
        if len(self._own_streams):
            self._own_streams.step()
        stats.kv_bytes = (
            batch.nbytes
            + solo.nbytes
            + self._generation.prefix_cache.nbytes
            + self._own_streams.nbytes
        )

    def drop_all(self) -> None:
        self._solo.drop_all()
        self._own_streams.drop_all()
        self._batch.drop_all()

    def _fits(self, request: Request, *, own_stream: bool) -> bool:
        """Whether `request` can start within max_kv_bytes (evicting prefix entries if need be).

        Batch rows are right-aligned and some row always has no left padding, so the batch's
        KV length never exceeds the longest row's prompt + max_tokens.
        """
        limit = self._max_kv_bytes
        if limit is None:
            return True
        rows = self._batch.requests() + self._solo.requests()  # a lone request joins the batch
        others = self._own_streams.requests()
        (others if own_stream else rows).append(request)
        longest = max((len(r.prompt) + r.max_tokens for r in rows), default=0)
        need = len(rows) * self.reserve(longest) + sum(
            self.reserve(len(r.prompt) + r.max_tokens) for r in others
        )
        if need > limit:
            return False
        self._generation.prefix_cache.make_room(limit - need)
        return True


def needs_own_stream(params: SamplingParams) -> bool:
    """A seeded sampled request must draw the same whatever runs alongside it."""
    return params.seed is not None and params.temperature > 0


def _bytes_per_token(model: Any) -> int:
    """KV bytes one token adds, measured on a one-token forward pass."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    total = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is not None:
            total += (c.keys.nbytes + c.values.nbytes) // keys.shape[2]
    return max(total, 1)
