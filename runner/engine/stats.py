"""What an mlx engine counts, for tests and metrics: one typed record, written by its thread.

`generation.Generation` counts requests and tokens, the batched strategy (`batched.Batched`)
what it batches and the KV bytes it holds. Each engine has its own `EngineStats`
(`MlxEngine.stats`); its warm-up counts on a scratch one, so that the engine's figures start
from zero. Plain attributes, written by the generation thread only (readers on other threads
see a recent value).
"""

from __future__ import annotations

import collections

import attrs


@attrs.define(eq=False)
class EngineStats:
    """An mlx engine's counters, from zero (see the module docstring)."""

    tokens_generated: int = 0
    requests_finished: int = 0
    """Terminal events of any kind."""
    active_requests: int = 0
    waiting_requests: int = 0
    peak_active_requests: int = 0
    prefix_cache_hits: int = 0
    recent_tokens: collections.deque[tuple[str, tuple[int, ...]]] = attrs.field(
        factory=lambda: collections.deque(maxlen=32)
    )
    """The generated token ids of the last few requests that finished (for exact-output
    tests)."""

    # Batched decoding's (`batched.BatchedStepping`); zero with interleaved decoding.
    kv_bytes: int = 0
    """Bytes held by KV caches now (batch, lone and interleaved requests, prefix cache)."""
    kv_bytes_per_token: int = 0
    batched_requests: int = 0
    fallback_requests: int = 0
    """Requests that ran on their own stream (seeded sampled ones)."""
    solo_requests: int = 0
    """Of the batched ones, those that started alone on a plain cache."""
    peak_batch_size: int = 0
