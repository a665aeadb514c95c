"""Taking a lone request's KV cache back a few tokens when some of its layers cannot be trimmed.

A hybrid model (LFM2, Qwen3-Next and the like) keeps a recurrent state in some layers
(mlx-lm's `ArraysCache`: a convolution's last inputs, an SSM state) beside attention layers'
KV caches. A KV cache drops tokens by trimming; a recurrent state cannot drop any. But a
state is replaced, not changed in place, at each model call (`cache[i] = new_state`), and an
MLX array never changes: keeping the arrays a call started from is a snapshot that costs
nothing. So `Rewinder` wraps the model for one lone request (`runner.engine.solo`): before
each call it keeps the recurrent layers' arrays and the token count, and `rewind` takes the
whole cache back to the start of one of the last calls, trimming the attention layers to
match. That is what handing the request over to the batch needs: its cache without the
tokens the batch is to feed again.
"""

from __future__ import annotations

import collections
from typing import Any

from mlx_lm.models.cache import ArraysCache

MARKS = 2
"""Calls whose starts are kept: the last call fed the tokens given out last (a step runs a
call ahead), so the one before it is as far back as a handover goes."""


def rewindable(cache: list[Any]) -> bool:
    """Whether every layer of `cache` can be trimmed or is a recurrent state (`ArraysCache`)
    this module can take back."""
    return all(isinstance(layer, ArraysCache) or layer.is_trimmable() for layer in cache)


class Rewinder:
    """`model` for calls on `cache`, which holds `offset` tokens; see the module docstring."""

    def __init__(self, model: Any, cache: list[Any], offset: int) -> None:
        self.model = model
        self.offset = offset
        """Tokens the cache holds."""
        self._cache = cache
        self._states = [i for i, layer in enumerate(cache) if isinstance(layer, ArraysCache)]
        self._marks: collections.deque[tuple[int, list[list[Any]]]] = collections.deque(
            maxlen=MARKS
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        cache = self._cache
        self._marks.append((self.offset, [list(cache[i].cache) for i in self._states]))
        self.offset += int(inputs.shape[1])
        return self.model(inputs, *args, **kwargs)

    def rewind(self, at_most: int) -> int:
        """Take the cache back to at most `at_most` tokens, to the start of a call kept; the
        tokens it then holds. Raises `ValueError` if no call kept started there."""
        if self.offset <= at_most:
            return self.offset
        for mark in reversed(self._marks):
            offset: int = mark[0]
            states = mark[1]
            if offset <= at_most:
                back = self.offset - offset
                for layer in self._cache:
                    if not isinstance(layer, ArraysCache):
                        layer.trim(back)
                for i, arrays in zip(self._states, states, strict=True):
                    self._cache[i].cache = arrays
                self.offset = offset
                self._marks.clear()
                return offset
        raise ValueError(f"no call started at or before {at_most} tokens (cache: {self.offset})")
