"""`just bench prefix-cache`: what the runner's prefix cache costs per request, against
mlx-lm's own `LRUPromptCache` (docs/benchmarks.md §11).

- Lookup: 8 agent contexts of 32k tokens sharing a 2k-token system prompt; the time to find
  the longest cached prefix of (a) a new conversation on the same system prompt and (b) a
  later turn of one of them, with `runner.engine.prefix_cache.PrefixCache` (block hashes)
  and with mlx-lm's `PromptTrie` (a dictionary per token).
- Sharing: the cost for one request to start from a kept cache and write its first token,
  by copying the entry first (`copy.deepcopy`, as `LRUPromptCache.fetch_nearest_cache` does)
  or by viewing it (`prefix_cache.view`: new cache objects over the same arrays, copied by
  the first write), for KV caches the size of a 16-layer, 8-KV-head model's at 2k and 16k
  tokens, reusing nearly all of it or 1k tokens of it.
- Disk tier: one stream decodes on the batched engine (the built-in model) while the disk tier
  writes, then reads back, a 16k-token cache of that size (1 GiB) on its own threads: the
  stream's gaps between tokens (p50, p99) during each, against the same stream's with the
  disk idle.

Medians of `runs` repetitions, measured in one process.
"""

from __future__ import annotations

import copy
import itertools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

LAYERS, HEADS, DIM = 16, 8, 128


def _median_ms(work: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def lookup(runs: int) -> None:
    from mlx_lm.models import cache as mlx_cache

    from runner.engine.prefix_cache import KVCache, PrefixCache

    prompt_trie: Any = mlx_cache.PromptTrie  # unannotated in mlx-lm

    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(2_000)]
    contexts = [system + [rng.randrange(50_000) for _ in range(30_000)] for _ in range(8)]
    new_conversation = [*system, 1, 2, 3]
    later_turn = [*contexts[3][:25_000], 7]

    trie = prompt_trie()
    for i, tokens in enumerate(contexts):
        trie.add("m", tokens, i)
    ours = PrefixCache(max_entries=64)
    for tokens in contexts:
        layer = KVCache()
        layer.offset = len(tokens)
        layer.keys = layer.values = _array((1, 1, 1, 1))  # the index is what is measured
        ours.put(tokens, [layer])
    print("§11 prefix-cache lookup, 8 contexts of 32k tokens sharing a 2k system prompt:")
    for name, prompt in (("new conversation", new_conversation), ("later turn", later_turn)):
        mine = _median_ms(lambda p=prompt: ours.match(p), runs)  # type: ignore[misc]
        theirs = _median_ms(lambda p=prompt: trie.search("m", p), max(1, min(runs, 2)))  # type: ignore[misc]
        print(f"  {name:>16}: PrefixCache {mine:8.2f} ms   mlx-lm PromptTrie {theirs:10.1f} ms")


def _array(shape: tuple[int, ...]) -> Any:
    import mlx.core as mx

    return mx.zeros(shape, dtype=mx.float16)


def sharing(runs: int) -> None:
    import mlx.core as mx

    from runner.engine.prefix_cache import view

    def first_write(cache: list[Any]) -> None:
        one = mx.zeros((1, HEADS, 1, DIM), dtype=mx.float16)
        for layer in cache:
            layer.update_and_fetch(one, one)
        mx.eval([c.state for c in cache])

    print("§11 starting a request from a kept cache (16 layers x 8 KV heads x 128, float16):")
    entries: dict[int, list[Any]] = {}
    for tokens, reuse in ((2_048, 2_038), (16_384, 16_374), (16_384, 1_024)):
        entry = entries.get(tokens) or entries.setdefault(tokens, _kept(tokens))
        size = sum(c.nbytes for c in entry) / 2**20

        def deep(entry: list[Any] = entry, reuse: int = reuse) -> None:
            cache = copy.deepcopy(entry)
            for layer in cache:
                layer.trim(layer.offset - reuse)
            first_write(cache)

        def viewed(entry: list[Any] = entry, reuse: int = reuse) -> None:
            first_write(view(entry, reuse))

        copied, shared = _median_ms(deep, runs), _median_ms(viewed, runs)
        print(
            f"  reusing {reuse:>6} of {tokens:>6} tokens ({size:5.0f} MiB): deepcopy "
            f"{copied:7.1f} ms   view {shared:7.1f} ms   ratio {copied / shared:4.1f}x"
        )


def _kept(tokens: int) -> list[Any]:
    import mlx.core as mx

    from runner.engine.prefix_cache import KVCache

    cache = []
    for _ in range(LAYERS):
        layer = KVCache()
        keys = mx.random.normal((1, HEADS, tokens, DIM)).astype(mx.float16)
        layer.update_and_fetch(keys, keys)
        cache.append(layer)
    mx.eval([c.state for c in cache])
    return cache


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class _Stream:
    """One sampled stream on an engine, its tokens' arrival times recorded."""

    def __init__(self) -> None:
        import threading

        self.stamps: list[float] = []
        self.finished = threading.Event()

    def sink(self, event: Any) -> None:
        from runner.engine.base import Output

        if isinstance(event, Output) and event.request_id.startswith("stream"):
            self.stamps.append(time.perf_counter())
            if event.finish_reason is not None:
                self.finished.set()

    def gaps_during(self, work: Callable[[], object] | None) -> tuple[list[float], float]:
        """The gaps (ms) between tokens while `work` runs (a second when None), and how
        long it took (s)."""
        begin, started = len(self.stamps), time.perf_counter()
        if work is None:
            time.sleep(1.0)
        else:
            work()
        took = time.perf_counter() - started
        got = self.stamps[begin - 1 :]
        return [(b - a) * 1000 for a, b in itertools.pairwise(got)], took


def _until(files: Any, kind: type) -> Any:
    while True:
        for completion in files.completions():
            if isinstance(completion, kind):
                return completion
        time.sleep(0.001)


def disk_tier(runs: int) -> None:
    import tempfile
    from pathlib import Path

    from protocol.frames import Generate, Message, SamplingParams
    from runner.demo_model import DEMO_LONG_MODEL_ID, resolve_model
    from runner.engine.batched import batched_engine
    from runner.engine.kv_store import KvStore, Loaded, Saved
    from runner.engine.prefix_cache import Entry

    model = str(resolve_model(DEMO_LONG_MODEL_ID))
    stream = _Stream()
    cache = _kept(16_384)
    size = sum(c.nbytes for c in cache)
    gaps: dict[str, list[float]] = {"disk idle": [], "writing": [], "reading": []}
    took: dict[str, list[float]] = {"writing": [], "reading": []}
    with tempfile.TemporaryDirectory() as root:
        store = KvStore(Path(root), 8 << 30)
        engine = batched_engine(model, kv_store=store)
        engine.start(stream.sink)
        files = store.for_model("bench")
        try:
            for run in range(runs):
                stream.stamps.clear()
                stream.finished.clear()
                request = Generate(
                    f"stream{run}",
                    model,
                    (Message("user", "Go on"),),
                    max_tokens=30_000,
                    sampling=SamplingParams(seed=run),
                )
                engine.submit(request)
                while len(stream.stamps) < 20:
                    time.sleep(0.01)
                entry = Entry(list(range(16_384)), cache, size)

                def write(entry: Entry = entry) -> None:
                    files.save(entry)
                    entry.stored = _until(files, Saved).stored

                def read(entry: Entry = entry) -> None:
                    files.load(entry)
                    assert _until(files, Loaded).cache is not None

                for name, work in (("disk idle", None), ("writing", write), ("reading", read)):
                    window, seconds = stream.gaps_during(work)
                    gaps[name].extend(window)
                    if work is not None:
                        took[name].append(seconds)
                engine.cancel(request.request_id)
                stream.finished.wait(10)
        finally:
            engine.close()
            store.close()
    print(
        f"§11 disk tier while a stream decodes (batched engine, built-in model, 32k context; "
        f"a {size / 2**30:.1f} GiB cache, {runs} runs):"
    )
    for name, window in gaps.items():
        spent = f", took {statistics.median(took[name]):.2f} s" if name in took else ""
        print(
            f"  {name:>9}: gap p50 {_percentile(window, 0.5):6.1f} ms  p99 "
            f"{_percentile(window, 0.99):6.1f} ms  ({len(window)} gaps{spent})"
        )


def main(runs: int, tokens: int) -> None:
    del tokens
    lookup(runs)
    sharing(runs)
    disk_tier(runs)
