"""Small KV caches whose contents a test can read back: for the prefix cache's tests and the
disk store's (`tests/runner/engine/test_prefix_cache.py`, `test_kv_store.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

new_kv_cache: Callable[[], Any] = KVCache  # mlx-lm leaves its constructor unannotated


def filled(tokens: int, layers: int = 2, value: float = 0.0) -> list[Any]:
    """A prompt cache of `layers` KV caches holding `tokens` tokens, each key and value
    `value` + its position (so that a test can tell what a cache holds)."""
    caches = [new_kv_cache() for _ in range(layers)]
    positions = mx.arange(tokens, dtype=mx.float32).reshape(1, 1, tokens, 1) + value
    data = mx.broadcast_to(positions, (1, 2, tokens, 4))
    for cache in caches:
        cache.update_and_fetch(data, data)
    return caches


def nbytes(cache: list[Any]) -> int:
    return sum(int(c.nbytes) for c in cache)


def held(cache: list[Any]) -> list[float]:
    """What the first layer's keys hold, a value per token."""
    layer = cache[0]
    return [float(x) for x in layer.keys[0, 0, : layer.offset, 0].tolist()]


def write_token(cache: list[Any], value: float) -> None:
    """Append one token whose keys and values are `value` (what a request's next step does)."""
    data = mx.full((1, 2, 1, 4), value)
    for layer in cache:
        layer.update_and_fetch(data, data)
    mx.eval([c.state for c in cache])


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))
