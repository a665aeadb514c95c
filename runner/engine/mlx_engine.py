"""An Engine on mlx-lm: one generation thread serves every request, a token each in turn.

MLX arrays, the model and its KV caches belong to the thread that made them, so `MlxEngine`
loads the model on its own generation thread (a `ThreadedEngine`) and touches MLX nowhere
else. Before serving it warms up (`_warm_up`: a few requests nobody sees, so the first real
one is as fast as the hundredth). For each request the generation thread:

1. on intake, applies the chat template and checks the lengths (`mlx_model.MlxModel`), so
   errors come at once and a cancelled queued request still reports its real prompt usage;
2. when one of the `max_concurrent` slots is free, starts it on its decoding strategy, from
   the prefix cache's longest match for its prompt;
3. advances every running request by one token per step, routes each token through
   `runner.accounting.RequestAccounting` and emits one `Output` per token
   (`generation.Generation`);
4. at the end keeps the request's KV cache in the prefix cache for the requests after it
   (shared by every later request that starts with it, bounded by `prefix_cache_bytes`, and
   written to the runner's disk cache, `kv_store`, when it has one).

How it decodes is its `Strategy`, an object it is given: interleaved by default
(`interleaved.Interleaved`: one `stream_generate` per request, round robin), or batched
(`batched.Batched`). What it counts is an `EngineStats`. A runner group's members run it in
lock step (`LockStep`, `runner.group.engine`).
"""

from __future__ import annotations

import logging
import threading
import time
from importlib.metadata import version
from typing import Protocol

import mlx.core as mx

from protocol.frames import Generate, Message, ModelInfo, SamplingParams, Speculation
from runner.engine.base import CacheChange, CacheWatcher, EngineEvent, KvUsage, Sink
from runner.engine.generation import Generation, Stepping
from runner.engine.interleaved import Interleaved
from runner.engine.kv_store import KvStore, model_identity
from runner.engine.mlx_model import MlxModel
from runner.engine.model_info import with_options
from runner.engine.prefix_cache import MAX_ENTRIES, PrefixCache
from runner.engine.stats import EngineStats
from runner.engine.threaded import AT_ONCE, Follow, Step, Submit, ThreadedEngine
from runner.model_options import ModelOptions

log = logging.getLogger("runner.engine")


class Strategy(Protocol):
    """How an `MlxEngine` decodes (`interleaved.Interleaved`, `batched.Batched`): the
    `Stepping` it makes on the generation thread, and what its KV caches take."""

    def stepping(self, generation: Generation, stats: EngineStats) -> Stepping:
        """The decoding strategy for `generation`, once the model is loaded; it counts in
        `stats` (the engine's, or the warm-up's scratch record)."""

    def prefix_bytes(self) -> int | None:
        """The prefix cache's bound in bytes when the engine is given none."""

    def kv_bytes(self, stats: EngineStats, prefix: int | None) -> int | None:
        """Every KV cache in memory now (`prefix`: the kept prompts'), for heartbeats."""

    def kv_limit(self, prefix_cache_bytes: int | None) -> int | None:
        """What the KV caches may take together, for heartbeats."""


class LockStep(Protocol):
    """What runs an `MlxEngine` in step with others (`runner.group.engine.GroupLockStep`): it
    loads the model, wraps the sink, decides when steps are due and wraps each step; on a
    follower it is the engine thread's loop (`follow`)."""

    follow: Follow | None
    """The engine thread's loop on a member that follows another (`ThreadedEngine`)."""

    def load(self, name: str, context_length: int | None) -> MlxModel:
        """Load this member's part of the model (on the engine thread)."""

    def model_info(self, model: MlxModel, warm_up_seconds: float) -> ModelInfo:
        """What the engine serves, once warmed up (and logs it)."""

    def sink(self, sink: Sink) -> Sink:
        """The sink the engine emits to, in place of `sink`."""

    def next_step_at(self, due: bool) -> float | None:
        """When the next step is due; `due`: requests are pending or busy (under the lock)."""

    def step(self, step: Step, now: float, submits: list[Submit], cancels: list[str]) -> None:
        """Run `step` as this member must (the others told first)."""

    def exit(self, loaded: bool) -> None:
        """The engine thread ends (`loaded`: it served)."""


class MlxEngine(ThreadedEngine):
    """Serves one mlx-lm model (a local MLX directory, a Hugging Face id or "orchard-demo").

    `strategy` chooses how it decodes (`interleaved.Interleaved` by default, or
    `batched.Batched`); `lock_step` runs it in step with the other members of a runner group.
    What it counts is `stats` (an `EngineStats`, written by the generation thread), with
    `warm_up_seconds` and `weights_bytes`.
    """

    def __init__(
        self,
        model: str,
        max_concurrent: int = 4,
        *,
        strategy: Strategy | None = None,
        prefix_cache_size: int = MAX_ENTRIES,
        prefix_cache_bytes: int | None = None,
        kv_store: KvStore | None = None,
        context_length: int | None = None,
        close_timeout: float = 30.0,
        path: str | None = None,
        lock_step: LockStep | None = None,
        options: ModelOptions | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {max_concurrent}")
        follow: Follow | None = None
        if lock_step is not None and lock_step.follow is not None:
            follows = lock_step.follow

            def follow(step: Step) -> None:
                # A follower steps as told: its own step, not the lock step's sharing one.
                follows(self._step_alone)

        super().__init__(
            thread_name=f"mlx-engine:{model}", close_timeout=close_timeout, follow=follow
        )
        self.model_name = model
        self.options = options if options is not None else ModelOptions()
        """Its draft model, KV quantization, adapter, template and sampling defaults."""
        self.path = path
        """Where the model's files are, when `model` is only its name (`runner.engine.shelf`
        downloads first, then loads from the Hub's cache)."""
        self.max_concurrent = max_concurrent
        self.strategy: Strategy = strategy if strategy is not None else Interleaved()
        self.lock_step = lock_step
        self.prefix_cache_size = prefix_cache_size
        """Kept prompt caches at most (entries)."""
        if prefix_cache_bytes is None:
            # Kept prompts take from the same budget as running requests (batched).
            prefix_cache_bytes = self.strategy.prefix_bytes()
        self.prefix_cache_bytes = prefix_cache_bytes
        """What kept prompt caches may take in memory (None: no bound but the entries')."""
        self.kv_store = kv_store
        """The runner's disk cache, shared by its models (None: memory only)."""
        self._context_length = context_length
        self._cache_watcher: CacheWatcher | None = None
        self._woken = False
        """The disk store finished something: step once to take it in (under the lock)."""
        self._prefixes_lock = threading.Lock()
        self._prefixes: set[str] = set()
        """The prefix hashes the prefix cache holds (a copy, for other threads)."""
        # The generation thread's own state, made by _load.
        self._generation: Generation | None = None
        self._stepping: Stepping | None = None

        self.stats = EngineStats()
        self.warm_up_seconds = 0.0
        self.weights_bytes = 0
        """The loaded model's parameters, in bytes."""

    def start(self, sink: Sink) -> None:
        super().start(sink if self.lock_step is None else self.lock_step.sink(sink))

    def watch_cache(self, watcher: CacheWatcher) -> None:
        self._cache_watcher = watcher

    def cache_held(self) -> dict[str, tuple[str, ...]]:
        with self._prefixes_lock:
            return {self.model_name: tuple(self._prefixes)} if self._prefixes else {}

    def kv_usage(self) -> KvUsage:
        generation = self._generation
        prefix = generation.prefix_cache.nbytes if generation is not None else None
        draft = generation.model.draft if generation is not None else None
        drafts = draft.kept.nbytes if draft is not None and draft.kept is not None else 0
        held = self.strategy.kv_bytes(self.stats, prefix)
        store = self.kv_store
        disk = store.nbytes if store is not None and store.enabled else None
        return KvUsage(
            # The draft's kept caches count with the model's.
            bytes=None if held is None else held + drafts,
            limit_bytes=self.strategy.kv_limit(self.prefix_cache_bytes),
            prefix_bytes=None if prefix is None else prefix + drafts,
            disk_bytes=disk,
            disk_limit_bytes=store.max_bytes if disk is not None and store is not None else None,
        )

    def speculation(self) -> tuple[Speculation, ...]:
        generation = self._generation
        draft = generation.model.draft if generation is not None else None
        if draft is None:
            return ()
        return (Speculation(self.model_name, draft.name, draft.drafted, draft.accepted),)

    def _cache_changed(self, added: tuple[str, ...], removed: tuple[str, ...]) -> None:
        """The prefix cache's word (generation thread): keep the copy, tell the watcher."""
        with self._prefixes_lock:
            self._prefixes.update(added)
            self._prefixes.difference_update(removed)
        watcher = self._cache_watcher
        if watcher is not None:
            watcher(CacheChange(self.model_name, added, removed))

    def _wake(self) -> None:
        """Step soon (the disk store finished something); from any thread."""
        with self._lock:
            self._woken = True
            self._lock.notify()

    def _make_prefix_cache(self, model: MlxModel) -> PrefixCache:
        store = None
        if self.kv_store is not None and self.kv_store.enabled and model.directory is not None:
            identity = model_identity(self.model_name, model.directory)
            if model.adapter_directory is not None:  # its weights shape the cache too
                identity = model_identity(identity, model.adapter_directory)
            store = self.kv_store.for_model(identity, wake=self._wake)
        return PrefixCache(
            self.prefix_cache_bytes,
            max_entries=self.prefix_cache_size,
            store=store,
            on_change=self._cache_changed,
        )

    # The generation thread.

    def _load(self) -> None:
        assert self._sink is not None
        if self.lock_step is not None:
            model = self.lock_step.load(self.model_name, self._context_length)
            self._start_serving(model)
            self._models = (self.lock_step.model_info(model, self.warm_up_seconds),)
            return
        model = MlxModel.load(
            self.model_name,
            path=self.path,
            context_length=self._context_length,
            options=self.options,
        )
        self.weights_bytes = model.weights_bytes()
        self._start_serving(model)
        self._models = (
            with_options(
                ModelInfo(
                    self.model_name,
                    model.context_length,
                    engine_version(),
                    size_bytes=self.weights_bytes,
                ),
                self.options,
            ),
        )
        log.info(
            "loaded %s (context %d tokens, %s, warmed up in %.0f ms)",
            self.model_name,
            model.context_length,
            type(self._stepping).__name__,
            self.warm_up_seconds * 1000,
        )

    def _start_serving(self, model: MlxModel) -> None:
        """Warm up on the loaded model, then make the generation and the strategy that
        serve it (on the generation thread, at the end of a `_load`)."""
        assert self._sink is not None
        self.warm_up_seconds = self._warm_up(model)
        if model.draft is not None:
            # The draft's kept caches: a quarter of the model's budget (a draft is smaller).
            budget = self.prefix_cache_bytes
            model.draft.kept = PrefixCache(
                None if budget is None else budget // 4, max_entries=self.prefix_cache_size
            )
        generation = Generation(
            model,
            sink=self._sink,
            stats=self.stats,
            max_concurrent=self.max_concurrent,
            prefix_cache=self._make_prefix_cache(model),
        )
        self._stepping = self.strategy.stepping(generation, self.stats)
        self._generation = generation

    def _warm_up(self, model: MlxModel) -> float:
        """Serve a few requests nobody sees before serving anyone: a lone one, a pair and a
        group (greedy and sampled, prompts of different lengths), so that what the first
        requests would otherwise pay once (the chat template's compilation, kernels built on
        first use, the allocator's first buffers) is paid before the runner registers. They
        run on a scratch generation and strategy with their own counters and no prefix
        cache: the engine's figures start from zero. Returns the seconds it took."""
        start = time.perf_counter()
        scratch = EngineStats()
        generation = Generation(
            model,
            sink=_discard,
            stats=scratch,
            max_concurrent=self.max_concurrent,
            prefix_cache=PrefixCache(max_entries=0),
        )
        stepping = self.strategy.stepping(generation, scratch)
        try:
            for group in _warm_up_groups(min(WARM_UP_GROUP, self.max_concurrent), model.name):
                for generate in group:
                    generation.intake(generate, time.perf_counter(), stepping.check)
                for _ in range(WARM_UP_STEPS):
                    if not generation.busy:
                        break
                    generation.admit(stepping.place)
                    stepping.step()
        finally:
            stepping.drop_all()
            generation.drop_all()
        if model.draft is not None:  # its counts too start from zero
            model.draft.reset()
        return time.perf_counter() - start

    def _next_step_at(self, pending: bool) -> float | None:
        assert self._generation is not None
        if self.lock_step is not None:
            return self.lock_step.next_step_at(pending or self._generation.busy)
        woken, self._woken = self._woken, False
        return AT_ONCE if pending or woken or self._generation.busy else None

    def _step(self, now: float, submits: list[Submit], cancels: list[str]) -> None:
        if self.lock_step is not None:
            self.lock_step.step(self._step_alone, now, submits, cancels)
        else:
            self._step_alone(now, submits, cancels)

    def _step_alone(self, now: float, submits: list[Submit], cancels: list[str]) -> None:
        """One step of this engine's own: intake, cancels, disk reads, admissions, decoding."""
        generation, stepping = self._generation, self._stepping
        assert generation is not None
        assert stepping is not None
        for request, submitted_at in submits:
            generation.intake(request, submitted_at, stepping.check)
        for request_id in cancels:
            generation.cancel(request_id)
        generation.poll()
        generation.admit(stepping.place)
        stepping.step()

    def _thread_exit(self) -> None:
        try:
            if self.lock_step is not None:
                self.lock_step.exit(self._generation is not None)
        finally:
            self._drop_all()

    def _drop_all(self) -> None:
        try:
            if self._stepping is not None:
                self._stepping.drop_all()
            if self._generation is not None:
                self._generation.drop_all()
        finally:
            # MLX 0.32 aborts the process at exit ("terminate called without an active
            # exception") unless a thread that used MLX destroys its streams before it ends.
            mx.clear_streams()


WARM_UP_GROUP = 8
"""The most requests warmed up together (capped by the engine's slots)."""
WARM_UP_TOKENS = 4
WARM_UP_STEPS = 200
"""A bound on each warm-up group's steps (a group that cannot finish is left behind)."""


def _warm_up_groups(group: int, model: str) -> list[list[Generate]]:
    """A lone greedy request; a greedy and a sampled one together; then `group` at once."""

    def ask(i: int, temperature: float = 0.0) -> Generate:
        words = " ".join(["pear"] * (1 + 3 * i))  # a different length each, padded in a batch
        return Generate(
            f"warm-up-{i}",
            model,
            (Message("user", f"Warm up {words}."),),
            max_tokens=WARM_UP_TOKENS,
            sampling=SamplingParams(temperature=temperature),
        )

    sizes = [1, 2, group] if group > 2 else [1, group]
    groups: list[list[Generate]] = []
    first = 0
    for size in sizes:
        groups.append([ask(first + i, 0.7 if i == 1 else 0.0) for i in range(size)])
        first += size
    return groups


def _discard(event: EngineEvent) -> None:
    """The warm-up's sink: nobody asked."""


def engine_version() -> str:
    """What generates here, for clients' `system_fingerprint`: library versions and device."""
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return f"mlx-lm {version('mlx-lm')}, mlx {version('mlx')}, {device}"
