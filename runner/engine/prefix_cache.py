"""KV caches of finished requests, kept so that a later prompt sharing their prefix skips it.

A multi-turn chat sends the whole conversation again with each turn: the previous turn's
prompt and answer are the next prompt's prefix. Keeping the KV cache of a finished request
lets the next one prefill only the new tokens.

A cache is mutated in place while generating, so one is never shared by two requests: `take`
removes the entry it returns. Entries are kept least recent first; `put` beyond `capacity`
drops the oldest. The caches are mlx-lm prompt caches (a list of per-layer caches), owned by
the generation thread like every MLX object.
"""

from __future__ import annotations

from typing import Any

import attrs
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache


@attrs.define(eq=False)
class _Entry:
    tokens: list[int]
    """The tokens the cache holds, in order."""
    cache: list[Any]
    nbytes: int
    """Measured once when kept: a kept cache is not written to until taken."""


class PrefixCache:
    """Up to `capacity` KV caches, each keyed by the tokens it holds."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: list[_Entry] = []
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held by the kept caches."""
        return self._nbytes

    def take(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """Remove and return the cache holding the longest prefix of `prompt`, trimmed to that
        prefix, and the prefix's length; `(None, 0)` when no entry shares a prefix.

        At least one prompt token is always left to process: generation needs the logits of
        the last one.
        """
        best, best_length = -1, 0
        for index, entry in enumerate(self._entries):
            length = common_prefix(entry.tokens, prompt)
            if length > best_length:
                best, best_length = index, length
        reuse = min(best_length, len(prompt) - 1)
        if reuse <= 0:
            return None, 0
        entry = self._entries.pop(best)
        self._nbytes -= entry.nbytes
        excess = len(entry.tokens) - reuse
        # mlx-lm annotates the result as a list; it is the number of tokens trimmed.
        trimmed: Any = trim_prompt_cache(entry.cache, excess) if excess > 0 else 0
        if trimmed != excess:
            return None, 0
        return entry.cache, reuse

    def put(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep `cache`, which holds `tokens` or a prefix of them (its offset says how many).

        Caches that cannot be trimmed (a later prompt may diverge inside them) or that hold
        nothing are not kept.
        """
        if self.capacity <= 0 or not cache or not can_trim_prompt_cache(cache):
            return
        held = getattr(cache[0], "offset", None)
        if not isinstance(held, int) or not 0 < held <= len(tokens):
            return
        tokens = tokens[:held]
        # An entry holding a prefix of these tokens is now redundant.
        kept = [e for e in self._entries if common_prefix(e.tokens, tokens) < len(e.tokens)]
        kept.append(_Entry(tokens, cache, sum(int(c.nbytes) for c in cache)))
        self._entries = kept[-self.capacity :]
        self._nbytes = sum(e.nbytes for e in self._entries)

    def evict_oldest(self) -> None:
        """Drop the least recently kept entry (to make room in a memory budget)."""
        if self._entries:
            self._nbytes -= self._entries.pop(0).nbytes


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length
