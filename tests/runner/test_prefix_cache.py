"""PrefixCache on real mlx-lm KV caches (tiny arrays, no model): matching, trimming, capacity,
bytes and eviction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from runner.engine.prefix_cache import PrefixCache, common_prefix

new_kv_cache: Callable[[], Any] = KVCache  # mlx-lm leaves its constructor unannotated


def filled(tokens: int, layers: int = 2) -> list[Any]:
    """A prompt cache of `layers` KV caches holding `tokens` tokens each."""
    caches = [new_kv_cache() for _ in range(layers)]
    for cache in caches:
        cache.update_and_fetch(mx.zeros((1, 2, tokens, 4)), mx.zeros((1, 2, tokens, 4)))
    return caches


def nbytes(cache: list[Any]) -> int:
    return sum(int(c.nbytes) for c in cache)


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([9], [1]) == 0


def test_take_from_nothing_or_no_shared_prefix() -> None:
    prefix = PrefixCache(4)
    assert prefix.take([1, 2, 3]) == (None, 0)
    prefix.put([7, 8, 9], filled(3))
    assert prefix.take([1, 2, 3]) == (None, 0)
    assert len(prefix) == 1  # not taken


def test_take_removes_the_longest_match_trimmed_to_the_shared_prefix() -> None:
    prefix = PrefixCache(4)
    prefix.put([1, 2, 7, 8, 9], other := filled(5))
    prefix.put([1, 2, 3, 4, 5], best := filled(5))
    cache, reused = prefix.take([1, 2, 3, 4, 6, 6])
    assert cache is best
    assert reused == 4
    assert [c.offset for c in best] == [4, 4]  # trimmed to what the prompt shares
    assert len(prefix) == 1  # taken: a cache is never shared by two requests
    assert prefix.take([1, 2, 3, 4, 6, 6]) == (other, 2)
    assert [c.offset for c in other] == [2, 2]


def test_one_prompt_token_is_always_left_to_process() -> None:
    prefix = PrefixCache(4)
    prefix.put([1, 2, 3, 4], cache := filled(4))
    assert prefix.take([1, 2, 3, 4]) == (cache, 3)
    assert [c.offset for c in cache] == [3, 3]
    prefix.put([5], filled(1))
    assert prefix.take([5]) == (None, 0)  # nothing can be reused from a one-token prompt


def test_put_keys_a_cache_by_the_tokens_it_holds() -> None:
    prefix = PrefixCache(4)
    # The cache holds 3 of the 5 tokens (a request that ended before its last ones ran).
    prefix.put([1, 2, 3, 4, 5], cache := filled(3))
    assert prefix.take([1, 2, 3, 4, 5, 6]) == (cache, 3)


def test_put_refuses_what_it_cannot_reuse() -> None:
    prefix = PrefixCache(4)
    prefix.put([1, 2, 3], [])
    prefix.put([1, 2, 3], filled(0))  # holds nothing
    prefix.put([1, 2], filled(3))  # holds more than the tokens it is said to hold
    prefix.put([1, 2, 3], [ArraysCache(1)])  # cannot be trimmed back to a shared prefix
    assert len(prefix) == 0
    assert prefix.nbytes == 0
    nothing = PrefixCache(0)
    nothing.put([1, 2, 3], filled(3))
    assert len(nothing) == 0


def test_a_longer_entry_replaces_its_prefixes_and_capacity_drops_the_oldest() -> None:
    prefix = PrefixCache(2)
    prefix.put([1, 2], filled(2))
    prefix.put([1, 2, 3], three := filled(3))  # [1, 2] is now redundant
    assert len(prefix) == 1
    prefix.put([4, 5], four := filled(2))
    prefix.put([6, 7], filled(2))  # over capacity: [1, 2, 3] goes
    assert len(prefix) == 2
    assert prefix.take([1, 2, 3, 9]) == (None, 0)
    assert prefix.take([4, 5, 9]) == (four, 2)
    assert three[0].offset == 3  # never taken, never trimmed


def test_nbytes_follows_puts_takes_and_evictions() -> None:
    prefix = PrefixCache(4)
    first, second = filled(3), filled(300)
    prefix.put([1, 2, 3], first)
    prefix.put([4] * 300, second)
    assert prefix.nbytes == nbytes(first) + nbytes(second) > 0
    assert nbytes(second) > nbytes(first)  # grown by a second step
    prefix.evict_oldest()
    assert len(prefix) == 1
    assert prefix.nbytes == nbytes(second)
    assert prefix.take([4] * 10)[0] is second
    assert prefix.nbytes == 0
    prefix.evict_oldest()  # empty: nothing to do
    assert len(prefix) == 0
