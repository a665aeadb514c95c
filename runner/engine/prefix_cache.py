"""KV caches of prompts, shared by every later request that starts with one of them.

An agent or a chat app sends its whole conversation again each turn, and concurrent requests
often share one long system prompt and tool list: the KV cache of a prefix, computed once,
serves every prompt that starts with it, at once and for as long as it is kept.

- **Lookup.** Each entry is indexed by the chained hashes of its whole blocks of `BLOCK`
  tokens: the longest kept prefix of a prompt is found by hashing the prompt's blocks, a
  dictionary lookup each, then comparing tokens within one block. mlx-lm's `PromptTrie`, a
  dictionary per token, took 19 s for the same search among 8 agent contexts of 32k tokens
  (docs/benchmarks.md, `just bench prefix-cache`).
- **Sharing.** An entry is never handed out: a request gets a view of it, new cache objects
  over the same MLX arrays with the offset at the shared prefix. MLX arrays are values, so
  the request's first write into its cache copies the buffer and the entry stays as it was
  (copy on write); a batch row copies it into the batch anyway. Cheaper per request than
  mlx-lm's `copy.deepcopy` of the entry (README, design notes).
- **Bytes.** At most `max_bytes` in memory (`--max-kv-bytes`, which the batched engine's
  running requests share: `make_room`), and at most `max_entries` entries. A quantized
  cache (`--kv-bits`) is kept, viewed, cut and stored as a plain one, and counts the bytes
  it takes quantized.
- **Eviction keeps what is reused.** The least recently used entry goes first, except that
  an entry a later request reused part of (a system prompt and tool list, a conversation's
  first turns) is cut back to that part, its *head*, instead of dropped; heads go only once no
  entry has a tail left to cut. An entry whose tokens start a new entry is dropped: the new
  one holds them (and inherits what was reused of them).
- **Disk.** With a `store` (`runner.engine.kv_store`), every entry kept is also written to
  disk, off this thread; an entry evicted from memory stays known as on disk only, and the
  engine loads it back when a prompt would reuse it (`load`). Entries found on disk when the
  runner starts (`store.entries`) are known from the start.
- **Routing.** Each entry carries the gateway's prefix hashes of the request that made it
  (`protocol.prefix`); `on_change` is told whenever a hash becomes held or stops being held,
  so that the runner can tell the gateway which conversations it holds.

"Recently" is a count of operations, not wall time: the ranks of a runner group, each with its
own cache, then take the same decisions.

Everything here runs on the generation thread, like every MLX object it holds.
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import can_trim_prompt_cache

from runner.engine.cache_entry import Entry, StoredEntry
from runner.engine.kv_store import Loaded, Saved

if TYPE_CHECKING:
    from runner.engine.kv_store import Completion, ModelStore

# Entry lives in runner.engine.cache_entry (the disk store reads it too); still importable here.
__all__ = [
    "BLOCK",
    "MAX_ENTRIES",
    "WHOLE_VIEW",
    "ChainChange",
    "Entry",
    "KVCache",
    "Match",
    "PrefixCache",
    "QuantizedKVCache",
    "common_prefix",
    "compact",
    "view",
]

log = logging.getLogger("runner.engine.prefix")

KVCache: Any = mlx_cache.KVCache  # mlx-lm leaves these constructors unannotated
QuantizedKVCache: Any = mlx_cache.QuantizedKVCache

BLOCK = 64
"""Tokens per indexed block."""
WHOLE_VIEW = 0.9
"""A view shares an entry's whole buffers when the reused part is at least this share of
them (the first write copies them whole: `bench.prefix_cache`), else only that part."""
MAX_ENTRIES = 256
"""Entries kept at most, whatever their bytes (each costs its index and bookkeeping)."""

ChainChange = Callable[[tuple[str, ...], tuple[str, ...]], None]
"""`on_change(added, removed)`: prefix hashes that became held, and that stopped being held."""


@attrs.frozen
class Match:
    """The entry sharing the longest prefix with a prompt, and how many tokens it serves."""

    entry: Entry
    length: int


class _Index:
    """Entries by the chained hashes of their whole blocks, and by their first token."""

    def __init__(self) -> None:
        self.by_block: dict[int, set[Entry]] = collections.defaultdict(set)
        self.by_first: dict[int, set[Entry]] = collections.defaultdict(set)

    def add(self, entry: Entry) -> None:
        for h in entry.blocks:
            self.by_block[h].add(entry)
        if entry.tokens:
            self.by_first[entry.tokens[0]].add(entry)

    def remove(self, entry: Entry) -> None:
        for h in entry.blocks:
            _discard(self.by_block, h, entry)
        if entry.tokens:
            _discard(self.by_first, entry.tokens[0], entry)

    def best(self, prompt: Sequence[int], limit: int) -> Match | None:
        """The entry sharing the longest prefix of `prompt`, up to `limit` tokens (ties: the
        most recent)."""
        if limit <= 0:
            return None
        depth, candidates = 0, self.by_first.get(prompt[0], set())
        h = 0
        for start in range(0, limit - BLOCK + 1, BLOCK):
            h = _block_hash(h, prompt[start : start + BLOCK])
            found = self.by_block.get(h)
            if not found:
                break
            depth, candidates = start + BLOCK, found
        best: Match | None = None
        for entry in candidates:
            length = min(depth + common_prefix(entry.tokens[depth:], prompt[depth:]), limit)
            if best is None or (length, entry.in_memory, entry.used) > (
                best.length,
                best.entry.in_memory,
                best.entry.used,
            ):
                best = Match(entry, length)
        if best is None or best.length <= 0:
            return None
        if best.entry.tokens[:depth] != list(prompt[:depth]):
            log.warning("block hash collision at %d tokens: not reused", depth)
            return None
        return best

    def containing_prefixes(self, tokens: list[int]) -> set[Entry]:
        """Entries that may be prefixes of `tokens` (to be checked token by token)."""
        if not tokens:
            return set()
        candidates = set(self.by_first.get(tokens[0], ()))
        h = 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            h = _block_hash(h, tokens[start : start + BLOCK])
            found = self.by_block.get(h)
            if not found:
                break
            candidates |= found
        return candidates


class PrefixCache:
    """Kept prompt caches, by the tokens they hold (see the module docstring)."""

    def __init__(
        self,
        max_bytes: int | None = None,
        *,
        max_entries: int = MAX_ENTRIES,
        store: ModelStore | None = None,
        on_change: ChainChange | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        """None: no bound on bytes (only on entries)."""
        self.max_entries = max_entries
        self.store = store
        self.on_change = on_change
        self._entries: set[Entry] = set()
        self._all = _Index()
        self._memory = _Index()
        """The entries in memory only."""
        self._chains: collections.Counter[str] = collections.Counter()
        self._nbytes = 0
        self._clock = 0
        if store is not None:
            for stored in store.entries():
                self._add(Entry(list(stored.tokens), None, 0, stored.chain, stored=stored))

    def __len__(self) -> int:
        """Entries in memory."""
        return sum(1 for e in self._entries if e.cache is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the entries in memory."""
        return self._nbytes

    @property
    def on_disk(self) -> int:
        """Entries whose only copy is on disk."""
        return sum(1 for e in self._entries if e.cache is None)

    def chains(self) -> list[str]:
        """Every prefix hash an entry holds (in memory or on disk)."""
        return list(self._chains)

    def entries(self) -> list[Entry]:
        """The entries, least recently used first (for tests and reports)."""
        return sorted(self._entries, key=lambda e: e.used)

    # --- lookup -----------------------------------------------------------------------

    def match(self, prompt: Sequence[int], *, memory_only: bool = False) -> Match | None:
        """The entry (in memory or on disk) sharing the longest prefix with `prompt`, at most
        all of it but its last token (generation needs that token's logits); None when none
        shares one. Of entries sharing as much, one in memory, then the most recent."""
        index = self._memory if memory_only else self._all
        return index.best(prompt, len(prompt) - 1)

    def take(
        self, prompt: Sequence[int], chain: tuple[str, ...] = ()
    ) -> tuple[list[Any] | None, int]:
        """A cache holding the longest prefix of `prompt` kept in memory (a view of the entry:
        see the module docstring) and that prefix's length; `(None, 0)` when no entry in
        memory shares one. `chain`: the request's prefix hashes."""
        found = self.match(prompt, memory_only=True)
        if found is None:
            return None, 0
        entry, length = found.entry, found.length
        assert entry.cache is not None
        self._note_reuse(entry, length, chain)
        return view(entry.cache, length), length

    def _note_reuse(self, entry: Entry, length: int, chain: tuple[str, ...]) -> None:
        entry.hits += 1
        entry.used = self._tick()
        if length >= entry.reused:
            entry.reused = length
            entry.reused_chain = _common_chain(entry.chain, chain)

    # --- keeping ----------------------------------------------------------------------

    def put(self, tokens: Sequence[int], cache: list[Any], chain: tuple[str, ...] = ()) -> None:
        """Keep `cache`, which holds `tokens` or a prefix of them (its offset says how many).
        The caller gives it up: it must not write to it again.

        Caches that cannot be trimmed (a later prompt may diverge inside them) or that hold
        nothing are not kept; nor is one whose tokens start an entry already kept (that one
        serves them).
        """
        if self.max_entries <= 0 or not cache or not can_trim_prompt_cache(cache):
            return
        held = getattr(cache[0], "offset", None)
        if not isinstance(held, int) or not 0 < held <= len(tokens):
            return
        kept = list(tokens[:held])
        longer = self._all.best([*kept, -1], len(kept))  # -1: no token, all of `kept` may match
        if longer is not None and longer.length == len(kept):
            found = longer.entry
            if found.cache is not None or len(found.tokens) > len(kept):
                # An entry holds all of these tokens already (and more): it serves them.
                found.used = self._tick()
                return
            self.loaded(found, cache)  # the same tokens, on disk: now in memory too
            return
        entry = Entry(kept, cache, _nbytes(cache), chain, used=self._tick())
        shorter = self._prefixes_of(kept)
        self._add(entry)
        for old in shorter:
            # `entry` holds all of `old`: it takes over what was reused of it.
            if old.head or old.reused >= len(old.tokens):
                entry.reused = max(entry.reused, len(old.tokens))
                entry.reused_chain = max(entry.reused_chain, old.chain, key=len)
            elif old.reused > entry.reused:
                entry.reused, entry.reused_chain = old.reused, old.reused_chain
            entry.hits += old.hits
            self._drop(old)
        if self.store is not None:
            entry.storing = True
            self.store.save(entry)
        self._fit(self.max_bytes)

    def _prefixes_of(self, tokens: list[int]) -> list[Entry]:
        """The entries whose tokens are a prefix of `tokens` (shorter or as long)."""
        return [
            e
            for e in self._all.containing_prefixes(tokens)
            if len(e.tokens) <= len(tokens) and tokens[: len(e.tokens)] == e.tokens
        ]

    # --- the disk tier ----------------------------------------------------------------

    def load(self, entry: Entry) -> bool:
        """Start reading `entry` back from its file (it is on disk only); True while a read of
        it is under way (`poll` ends it)."""
        if entry.cache is not None or entry.stored is None or self.store is None:
            return False
        if not entry.loading:
            entry.loading = True
            self.store.load(entry)
        return True

    def poll(self) -> bool:
        """Take in what the store's threads finished (writes, reads, deletions); True when an
        entry came back into memory or a read failed (requests waiting on it may go on)."""
        if self.store is None:
            return False
        read = False
        for done in self.store.completions():
            read |= self.apply(done)
        return read

    def apply(self, done: Completion) -> bool:
        """One completion of the store's; True for a read."""
        if isinstance(done, Saved):
            self.stored(done.entry, done.stored)
            return False
        if isinstance(done, Loaded):
            done.entry.loading = False
            self.loaded(done.entry, done.cache)
            return True
        self.forget_file(done.stored)
        return False

    def stored(self, entry: Entry, stored: StoredEntry | None) -> None:
        """The store's word on `entry`'s write: its file, or None (the write failed). An entry
        dropped meanwhile has its file deleted again."""
        entry.storing = False
        if entry not in self._entries:
            if stored is not None and self.store is not None:
                self.store.delete(stored)
            return
        entry.stored = stored
        if entry.cache is None and stored is None:
            self._drop(entry)  # evicted from memory while the write failed: nothing is left

    def forget_file(self, stored: StoredEntry) -> None:
        """The store deleted `stored` (to stay within its budget): an entry on disk only goes."""
        for entry in list(self._entries):
            if entry.stored is stored:
                entry.stored = None
                if entry.cache is None:
                    self._drop(entry, delete=False)

    def loaded(self, entry: Entry, cache: list[Any] | None) -> None:
        """The caches read back from `entry`'s file (None: the file was bad, and deleted)."""
        if entry not in self._entries or entry.cache is not None:
            return
        if cache is None:
            entry.stored = None
            self._drop(entry, delete=False)
            return
        entry.cache = cache
        entry.nbytes = _nbytes(cache)
        self._nbytes += entry.nbytes
        self._memory.add(entry)
        entry.used = self._tick()
        self._fit(self.max_bytes, keep=entry)

    # --- bounds -----------------------------------------------------------------------

    def make_room(self, limit: int) -> None:
        """Evict from memory until the entries take at most `limit` bytes."""
        self._fit(limit)

    def evict_oldest(self) -> bool:
        """Evict one step's worth (cut a tail, or drop an entry) from memory; False when
        nothing is left to evict."""
        victim = self._victim()
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _fit(self, limit: int | None, keep: Entry | None = None) -> None:
        while len(self) > self.max_entries or (limit is not None and self._nbytes > limit):
            victim = self._victim(keep)
            if victim is None:
                return
            self._evict(victim)
        # Entries on disk only count against the entry bound too, oldest out.
        while len(self._entries) > 2 * self.max_entries:
            oldest = min((e for e in self._entries if e.cache is None), key=lambda e: e.used)
            self._drop(oldest)

    def _victim(self, keep: Entry | None = None) -> Entry | None:
        """What goes next: the least recently used entry with a tail to cut or no head,
        then the least recently used head."""
        in_memory = [e for e in self._entries if e.cache is not None and e is not keep]
        if not in_memory:
            return None
        tails = [e for e in in_memory if not e.head]
        return min(tails or in_memory, key=lambda e: e.used)

    def _evict(self, entry: Entry) -> None:
        """Cut `entry` back to its head (once), or take it out of memory: to its file if it
        has one (or is being written), else for good."""
        cuttable = not entry.head and BLOCK <= entry.reused < len(entry.tokens)
        if cuttable and self._cut(entry, entry.reused):
            return
        if entry.stored is not None or entry.storing:
            self._memory.remove(entry)
            self._nbytes -= entry.nbytes
            entry.cache, entry.nbytes = None, 0
            return
        self._drop(entry)

    def _cut(self, entry: Entry, length: int) -> bool:
        """Keep only the first `length` tokens of `entry` in memory (a copy of that part, so
        that the rest's memory is freed); False when its caches cannot be cut so."""
        assert entry.cache is not None
        cut = compact(entry.cache, length)
        if cut is None:
            return False
        self._unindex(entry)
        self._nbytes -= entry.nbytes
        old_chain = entry.chain
        entry.tokens = entry.tokens[:length]
        entry.cache, entry.nbytes = cut, _nbytes(cut)
        entry.chain = entry.reused_chain
        entry.head = True
        if entry.stored is not None and self.store is not None:
            self.store.delete(entry.stored)  # a file of the whole entry: written again below
            entry.stored = None
        self._nbytes += entry.nbytes
        self._index(entry)
        self._count_chain(entry.chain, old_chain)
        if self.store is not None and not entry.storing:
            entry.storing = True
            self.store.save(entry)
        return True

    # --- bookkeeping ------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _add(self, entry: Entry) -> None:
        self._entries.add(entry)
        self._nbytes += entry.nbytes
        self._index(entry)
        self._count_chain(entry.chain, ())

    def _drop(self, entry: Entry, *, delete: bool = True) -> None:
        """Forget `entry` in every tier."""
        if entry not in self._entries:
            return
        self._entries.discard(entry)
        self._nbytes -= entry.nbytes
        self._unindex(entry)
        self._count_chain((), entry.chain)
        entry.cache = None
        if delete and entry.stored is not None and self.store is not None:
            self.store.delete(entry.stored)
            entry.stored = None

    def _index(self, entry: Entry) -> None:
        tokens = entry.tokens
        entry.blocks = []
        h = 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            h = _block_hash(h, tokens[start : start + BLOCK])
            entry.blocks.append(h)
        self._all.add(entry)
        if entry.cache is not None:
            self._memory.add(entry)

    def _unindex(self, entry: Entry) -> None:
        self._all.remove(entry)
        self._memory.remove(entry)

    def _count_chain(self, added: Iterable[str], removed: Iterable[str]) -> None:
        chains = self._chains
        new: list[str] = []
        gone: list[str] = []
        for h in added:
            chains[h] += 1
            if chains[h] == 1:
                new.append(h)
        for h in removed:
            chains[h] -= 1
            if chains[h] <= 0:
                del chains[h]
                gone.append(h)
        # A hash both added and removed here (an entry replaced by one holding it) is held.
        both = set(new) & set(gone)
        new = [h for h in new if h not in both]
        gone = [h for h in gone if h not in both]
        if (new or gone) and self.on_change is not None:
            self.on_change(tuple(new), tuple(gone))


def view(cache: list[Any], length: int) -> list[Any]:
    """New caches over the same arrays as `cache`, holding its first `length` tokens.

    A plain or quantized KV cache is viewed: its arrays are shared and the first write into
    the view copies them (MLX arrays are values). When `length` is well below what the
    buffers hold, only that part is viewed, so that the copy is of the part reused, not the
    whole entry. Other trimmable caches are copied, then trimmed."""
    out: list[Any] = []
    for layer in cache:
        kind = type(layer)
        shared: Any
        if kind is KVCache and layer.keys is not None:
            shared = KVCache()
            shared.keys, shared.values = _viewed(layer.keys, length), _viewed(layer.values, length)
            shared.offset = length
        elif kind is QuantizedKVCache and layer.keys is not None:
            shared = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
            shared.keys = tuple(_viewed(a, length) for a in layer.keys)
            shared.values = tuple(_viewed(a, length) for a in layer.values)
            shared.offset = length
        else:
            shared = copy.deepcopy(layer)
            shared.trim(shared.offset - length)
        out.append(shared)
    return out


def _viewed(array: Any, length: int) -> Any:
    """`array` (keys or values, tokens on axis 2) as a new array object over its buffer: all
    of it, or its first `length` tokens when that is below WHOLE_VIEW of it."""
    if length >= WHOLE_VIEW * array.shape[2]:
        return array[...]
    return array[..., :length, :]


def compact(cache: list[Any], length: int) -> list[Any] | None:
    """A copy of `cache`'s first `length` tokens in buffers of that size (freeing the rest
    once the old caches go); None when a layer is not a plain or quantized KV cache or holds
    fewer."""
    out: list[Any] = []
    for layer in cache:
        kind = type(layer)
        if kind not in (KVCache, QuantizedKVCache) or layer.keys is None or layer.offset < length:
            return None
        cut: Any
        if kind is KVCache:
            cut = KVCache()
            cut.keys = mx.contiguous(layer.keys[..., :length, :])
            cut.values = mx.contiguous(layer.values[..., :length, :])
        else:
            cut = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
            cut.keys = tuple(mx.contiguous(a[..., :length, :]) for a in layer.keys)
            cut.values = tuple(mx.contiguous(a[..., :length, :]) for a in layer.values)
        cut.offset = length
        out.append(cut)
    mx.eval([c.state for c in out])
    return out


def _discard(index: dict[int, set[Entry]], key: int, entry: Entry) -> None:
    found = index.get(key)
    if found is not None:
        found.discard(entry)
        if not found:
            del index[key]


def _nbytes(cache: list[Any]) -> int:
    return sum(int(c.nbytes) for c in cache)


def _block_hash(previous: int, block: Sequence[int]) -> int:
    return hash((previous, tuple(block)))


def _common_chain(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """The leading prefix hashes `a` and `b` share."""
    return a[: common_prefix(list(a), list(b))]


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The number of leading items `a` and `b` share. Halves the span by comparing slices
    (a C loop) until it is short, then walks it: about a millisecond for two prompts of 30k
    tokens, where a Python loop over them takes tens."""
    if type(a) is not type(b):  # a list never equals a tuple, whatever they hold
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    lo, hi = 0, n
    if a[:n] == b[:n]:
        return n
    while hi - lo > 32:  # a[:lo] == b[:lo], and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo
