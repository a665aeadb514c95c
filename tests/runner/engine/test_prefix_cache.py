"""PrefixCache on real mlx-lm KV caches (tiny arrays, no model): lookup, sharing, trimming,
bytes, eviction order and the prefix hashes it reports."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache

from runner.engine import prefix_cache
from runner.engine.prefix_cache import BLOCK, PrefixCache, common_prefix, view
from tests.runner.caches import filled, held, nbytes, tokens, write_token


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([9], [1]) == 0
    assert common_prefix([1, 2, 3], (1, 2, 4)) == 2  # a list and a tuple of the same items


@given(st.lists(st.integers(0, 3), max_size=300), st.lists(st.integers(0, 3), max_size=300))
def test_common_prefix_is_the_first_difference(a: list[int], b: list[int]) -> None:
    b = a[: len(b)] + b  # long shared runs, as prompts have
    expected = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    assert common_prefix(a, b) == expected
    assert common_prefix(b, a) == expected


def test_take_from_nothing_or_no_shared_prefix() -> None:
    prefix = PrefixCache()
    assert prefix.take([1, 2, 3]) == (None, 0)
    prefix.put([7, 8, 9], filled(3))
    assert prefix.take([1, 2, 3]) == (None, 0)
    assert len(prefix) == 1


def test_every_request_sharing_a_prefix_reuses_it_and_none_sees_the_others_writes() -> None:
    prefix = PrefixCache()
    system = tokens(3 * BLOCK + 5)
    prefix.put(system, filled(len(system)))
    prompts = [[*system, 1000 + i, 2000 + i] for i in range(8)]
    views = [prefix.take(prompt) for prompt in prompts]
    assert [reused for _, reused in views] == [len(system)] * 8
    assert len(prefix) == 1  # kept: a cached prefix serves any number of requests at once
    for i, (cache, _) in enumerate(views):
        assert cache is not None
        write_token(cache, 100.0 + i)
    for i, (cache, _) in enumerate(views):
        assert cache is not None
        assert held(cache) == [*map(float, range(len(system))), 100.0 + i]
    (entry,) = prefix.entries()
    assert entry.cache is not None
    assert held(entry.cache) == [*map(float, range(len(system)))]
    assert entry.hits == 8


def test_take_finds_the_longest_match_within_a_block_and_across_blocks() -> None:
    prefix = PrefixCache()
    a = tokens(2 * BLOCK + 10)
    b = [*a[: BLOCK + 3], *tokens(BLOCK, start=5000)]
    prefix.put(a, filled(len(a), value=0))
    prefix.put(b, filled(len(b), value=0.5))
    cache, reused = prefix.take([*a[: 2 * BLOCK + 7], 9999])
    assert reused == 2 * BLOCK + 7
    assert cache is not None
    assert held(cache)[-1] == 2 * BLOCK + 6  # a's
    cache, reused = prefix.take([*b, 9999])
    assert reused == len(b)
    assert cache is not None
    assert held(cache)[0] == 0.5  # b's
    cache, reused = prefix.take([*a[:5], 7777, 7778])
    assert reused == 5
    assert cache is not None
    assert held(cache)[0] == 0.5  # as long a match in both: the more recent (b, just used)


def test_one_prompt_token_is_always_left_to_process() -> None:
    prefix = PrefixCache()
    prefix.put([1, 2, 3, 4], filled(4))
    cache, reused = prefix.take([1, 2, 3, 4])
    assert reused == 3
    assert cache is not None
    assert [c.offset for c in cache] == [3, 3]
    prefix.put([5], filled(1))
    assert prefix.take([5]) == (None, 0)  # nothing can be reused from a one-token prompt


def test_put_keys_a_cache_by_the_tokens_it_holds() -> None:
    prefix = PrefixCache()
    # The cache holds 3 of the 5 tokens (a request that ended before its last ones ran).
    prefix.put([1, 2, 3, 4, 5], filled(3))
    _, reused = prefix.take([1, 2, 3, 4, 5, 6])
    assert reused == 3


def test_put_refuses_what_it_cannot_reuse() -> None:
    prefix = PrefixCache()
    prefix.put([1, 2, 3], [])
    prefix.put([1, 2, 3], filled(0))  # holds nothing
    prefix.put([1, 2], filled(3))  # holds more than the tokens it is said to hold
    prefix.put([1, 2, 3], [ArraysCache(1)])  # cannot be trimmed back to a shared prefix
    assert len(prefix) == 0
    assert prefix.nbytes == 0


def test_an_entry_extending_another_replaces_it_and_keeps_what_was_reused() -> None:
    prefix = PrefixCache()
    turn1 = tokens(2 * BLOCK)
    prefix.put(turn1, filled(len(turn1)))
    _, reused = prefix.take([*turn1[: BLOCK + 1], 555])  # another chat reuses the head
    assert reused == BLOCK + 1
    turn2 = [*turn1, *tokens(BLOCK, start=900)]
    prefix.put(turn2, filled(len(turn2)))
    (entry,) = prefix.entries()
    assert entry.tokens == turn2
    assert (entry.reused, entry.hits) == (BLOCK + 1, 1)
    assert prefix.nbytes == nbytes(filled(len(turn2)))
    # A prefix of what is kept adds nothing.
    prefix.put(turn2[:BLOCK], filled(BLOCK))
    assert [e.tokens for e in prefix.entries()] == [turn2]


def test_views_share_the_buffers_unless_a_small_part_is_reused() -> None:
    cache = filled(256)  # mlx-lm's KV caches grow by 256 tokens: a buffer that is full
    whole = view(cache, 250)
    part = view(cache, 10)
    assert whole[0].keys.shape[2] == 256  # the whole buffer, shared
    assert part[0].keys.shape[2] == 10  # only what is reused: the first write copies 10
    assert [c.offset for c in whole + part] == [250, 250, 10, 10]


def test_bytes_are_bounded_and_the_least_recently_used_goes_first() -> None:
    size = nbytes(filled(BLOCK))
    prefix = PrefixCache(max_bytes=2 * size)
    a, b, c = tokens(BLOCK), tokens(BLOCK, start=1000), tokens(BLOCK, start=2000)
    prefix.put(a, filled(BLOCK))
    prefix.put(b, filled(BLOCK))
    prefix.take([*a, 1])  # a is now the more recent
    prefix.put(c, filled(BLOCK))
    assert sorted(e.tokens[0] for e in prefix.entries()) == [0, 2000]  # b went
    assert prefix.nbytes == 2 * size


def test_eviction_cuts_tails_first_and_keeps_the_heads_others_reused() -> None:
    size = nbytes(prefix_cache.compact(filled(BLOCK), BLOCK) or [])  # cut to size, no spare
    assert size == nbytes(filled(BLOCK)) * BLOCK // 256
    prefix = PrefixCache()
    system = tokens(BLOCK)
    conversation = [*system, *tokens(3 * BLOCK, start=1000)]
    prefix.put(conversation, filled(len(conversation)))
    prefix.take([*system, 7, 7])  # a second conversation on the same system prompt
    one_off = tokens(2 * BLOCK, start=5000)
    prefix.put(one_off, filled(len(one_off)))  # the most recent, never reused

    prefix.make_room(prefix.nbytes - 1)
    # The oldest goes first, but only its tail: it is cut back to the system prompt.
    old, new = prefix.entries()
    assert (old.tokens, old.head, old.nbytes) == (system, True, size)
    assert new.tokens == one_off
    assert prefix.nbytes == size + nbytes(filled(len(one_off)))
    assert prefix.take([*system, 8, 8])[1] == BLOCK
    # Next goes the tail that was never reused, though more recent than the head.
    prefix.make_room(prefix.nbytes - 1)
    assert [e.tokens for e in prefix.entries()] == [system]
    prefix.make_room(0)
    assert (len(prefix), prefix.nbytes) == (0, 0)


def test_the_entry_bound_holds() -> None:
    prefix = PrefixCache(max_entries=3)
    for i in range(5):
        prefix.put(tokens(4, start=100 * i), filled(4))
    assert sorted(e.tokens[0] for e in prefix.entries()) == [200, 300, 400]


def test_prefix_hashes_are_reported_held_and_released() -> None:
    changes: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    prefix = PrefixCache(on_change=lambda added, removed: changes.append((added, removed)))
    system = tokens(BLOCK)
    turn1 = [*system, *tokens(BLOCK, start=1000)]
    prefix.put(turn1, filled(len(turn1)), ("s", "u1"))
    assert changes == [(("s", "u1"), ())]
    prefix.take([*system, 9, 9], ("s", "u9"))  # shares the system prompt's hash
    turn2 = [*turn1, *tokens(BLOCK, start=2000)]
    prefix.put(turn2, filled(len(turn2)), ("s", "u1", "a1", "u2"))
    assert changes[1:] == [(("a1", "u2"), ())]  # replaced, "s" and "u1" held throughout
    assert sorted(prefix.chains()) == ["a1", "s", "u1", "u2"]
    prefix.make_room(prefix.nbytes - 1)  # cut back to the system prompt: only "s" is left
    assert changes[2:] == [((), ("u1", "a1", "u2"))]
    prefix.make_room(0)
    assert changes[3:] == [((), ("s",))]
    assert prefix.chains() == []


def test_a_hash_collision_never_serves_another_prompts_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefix_cache, "_block_hash", lambda previous, block: 42)
    prefix = PrefixCache()
    kept = tokens(BLOCK + 4)
    prefix.put(kept, filled(len(kept)))
    other = tokens(BLOCK + 4, start=7)  # every block "hashes" alike, no token is shared
    assert prefix.take(other) == (None, 0)
    assert prefix.take([*kept[:-1], 1])[1] == len(kept) - 1  # the real one is still found
