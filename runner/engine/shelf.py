"""Several models on one runner, loaded on demand within a memory budget (`--model` given
more than once, `--max-memory`).

`ModelShelf` is an `Engine` that holds one engine per loaded model (each on its own thread,
as any engine here) and routes every request to its model's engine. A request for a model
that is not loaded waits on the shelf while the model is fetched (downloaded from the Hugging
Face Hub when it is not on disk, with progress), room is made and it is loaded; then it runs
like any other. Room is made by unloading the least recently used models that have nothing
running or waiting; when the loaded ones are all busy, the least recently used one is evicted
(it finishes what it runs while new requests for it wait for its next load), so a busy model
cannot keep another out for ever. A model larger than the whole budget, a failed download or
a failed load ends the requests waiting for it with a `model_load_failed` Failure naming the
cause, and the model stays loadable (the next request tries again).

Every change of a model's state (loading, with download progress; loaded; loadable again)
goes to the watcher `watch_models` installed, which the runner turns into `ModelStatus`
frames. Loads run one at a time on the shelf's loader thread; `submit` and `cancel` never
block on them.

Each loaded engine keeps its own prefix cache; what they hold goes to the watcher
`watch_cache` installed. An unloaded model holds nothing in memory (its disk cache, under the
runner's `kv_store`, is found again when it is loaded).
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import mlx.core as mx

from protocol.frames import Download, Generate, ModelInfo, Speculation, Usage
from runner.engine.base import (
    CacheChange,
    CacheWatcher,
    Engine,
    EngineEvent,
    Failure,
    KvUsage,
    Output,
    Sink,
    emit,
)
from runner.errors import EngineStateError, ModelLoadError

log = logging.getLogger("runner.engine")

Progress = Callable[[int, int], None]
"""Told bytes done and bytes in all as a download goes."""
MakeEngine = Callable[[str, str], Engine]
"""An engine (not started) serving the model named by the first argument from the files at
the second."""
ModelWatcher = Callable[[ModelInfo], None]


class ModelSource(Protocol):
    """Where models' files come from (`runner.model_source.HubSource`: the demo model, local
    directories and the Hugging Face Hub)."""

    def on_disk(self, name: str) -> str | None:
        """The model's directory if its files are all here, without any download."""

    def fetch(self, name: str, progress: Progress) -> str:
        """The model's directory, downloading what is missing; raises with a clear message."""

    def size(self, path: str) -> int:
        """The bytes the model at `path` will take in memory (its weight files' size)."""


@attrs.define(eq=False)
class _Model:
    """One model of the shelf, as the shelf tracks it (under the shelf's lock)."""

    name: str
    info: ModelInfo
    engine: Engine | None = None
    running: set[str] = attrs.field(factory=set)
    """Requests given to its engine that have not ended."""
    waiting: list[Generate] = attrs.field(factory=list)
    """Requests that arrived while it was not loaded (or while it was `evicting`), in order."""
    last_used: float = 0.0
    evicting: bool = False
    """Loaded, but a load waits for it to finish what it runs and be unloaded: requests that
    arrive meanwhile wait for its next load, so a busy model cannot starve the others."""

    @property
    def unloadable(self) -> bool:
        """Loaded, and nothing runs on it (nor waits for it, unless it is being evicted)."""
        held = bool(self.waiting) and not self.evicting
        return self.engine is not None and not self.running and not held


class ModelShelf(Engine):
    """Serves `models`, keeping loaded what fits in `max_memory` bytes (see the module)."""

    def __init__(
        self,
        models: Sequence[str],
        *,
        make_engine: MakeEngine,
        source: ModelSource,
        max_memory: int,
        preload: int = 1,
    ) -> None:
        if not models:
            raise ValueError("a shelf needs at least one model")
        if len(set(models)) != len(models):
            raise ValueError(f"a model is named twice: {', '.join(models)}")
        self.max_memory = max_memory
        self._make_engine = make_engine
        self._source = source
        self._preload = preload
        self._models = {
            name: _Model(name, ModelInfo(name, None, state="loadable")) for name in models
        }
        self._sink: Sink | None = None
        self._watcher: ModelWatcher | None = None
        self._cache_watcher: CacheWatcher | None = None
        self._lock = threading.Condition()
        self._where: dict[str, _Model] = {}
        """Running requests by id."""
        self._loads: collections.deque[_Model] = collections.deque()
        self._loader: threading.Thread | None = None
        self._closing = False
        self.loads = 0
        self.unloads = 0
        """Counts, for tests and logs."""

    # --- what the runner reads ------------------------------------------------------------

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        with self._lock:
            return tuple(m.info for m in self._models.values())

    @property
    def loaded_bytes(self) -> int:
        """What the loaded models take together."""
        with self._lock:
            return self._used()

    def kv_usage(self) -> KvUsage:
        """The loaded engines' KV caches together (for heartbeats); the disk cache is the
        runner's, shared: one engine's figure."""
        with self._lock:
            usages = [m.engine.kv_usage() for m in self._models.values() if m.engine is not None]

        def total(values: list[int | None]) -> int | None:
            known = [v for v in values if v is not None]
            return sum(known) if known else None

        disk = next((u for u in usages if u.disk_bytes is not None), KvUsage())
        return KvUsage(
            bytes=total([u.bytes for u in usages]),
            limit_bytes=total([u.limit_bytes for u in usages]),
            prefix_bytes=total([u.prefix_bytes for u in usages]),
            disk_bytes=disk.disk_bytes,
            disk_limit_bytes=disk.disk_limit_bytes,
        )

    def memory_budget(self) -> int | None:
        return self.max_memory

    def speculation(self) -> tuple[Speculation, ...]:
        """The loaded models' drafts (a model's counts start again when it is reloaded)."""
        with self._lock:
            engines = [m.engine for m in self._models.values() if m.engine is not None]
        return tuple(s for engine in engines for s in engine.speculation())

    def watch_models(self, watcher: ModelWatcher) -> None:
        self._watcher = watcher

    def watch_cache(self, watcher: CacheWatcher) -> None:
        self._cache_watcher = watcher

    def cache_held(self) -> dict[str, tuple[str, ...]]:
        with self._lock:
            engines = [m.engine for m in self._models.values() if m.engine is not None]
        held: dict[str, tuple[str, ...]] = {}
        for engine in engines:
            held.update(engine.cache_held())
        return held

    # --- the Engine interface -------------------------------------------------------------

    def start(self, sink: Sink) -> None:
        """Size what is on disk, load the first `preload` models, then serve. A failure to
        load those is raised (`ModelLoadError`), as a single engine's would be."""
        if self._sink is not None:
            raise EngineStateError("the engine was already started")
        self._sink = sink
        for model in self._models.values():
            self._size_on_disk(model)
        for model in list(self._models.values())[: self._preload]:
            error = self._load(model)
            if error is not None:
                self.close()
                raise ModelLoadError(error)
        self._loader = threading.Thread(target=self._load_loop, name="model-shelf", daemon=True)
        self._loader.start()

    def submit(self, request: Generate) -> None:
        if self._sink is None:
            raise EngineStateError("submit before start")
        engine = None
        with self._lock:
            model = self._models.get(request.model)
            failure = self._refusal(request, model)
            if model is not None and failure is None:
                model.last_used = time.monotonic()
                engine = model.engine
                if engine is None or model.evicting:
                    engine = None
                    model.waiting.append(request)
                    self._want_loaded(model)
                else:
                    model.running.add(request.request_id)
                    self._where[request.request_id] = model
        if failure is not None:
            emit(self._sink, failure)
        elif engine is not None:
            engine.submit(request)

    def _refusal(self, request: Generate, model: _Model | None) -> Failure | None:
        if self._closing:
            return Failure(request.request_id, "internal_error", "the engine is closed")
        if model is None:
            served = ", ".join(self._models)
            return Failure(
                request.request_id,
                "model_not_found",
                f"This runner serves {served}, not {request.model}.",
            )
        return None

    def cancel(self, request_id: str) -> None:
        with self._lock:
            running = self._where.get(request_id)
            engine = running.engine if running is not None else None
            waited = None
            if running is None:
                for model in self._models.values():
                    for request in model.waiting:
                        if request.request_id == request_id:
                            waited = request
                            model.waiting.remove(request)
                            self._lock.notify_all()
                            break
        if engine is not None:
            engine.cancel(request_id)
        elif waited is not None:
            # It never reached a model: nothing was read or generated.
            emit(self._sink, Output(request_id, "", "", 0, Usage(0, 0), finish_reason="cancelled"))

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
            engines = [m.engine for m in self._models.values() if m.engine is not None]
        for engine in engines:
            engine.close()
        loader = self._loader
        if loader is not None and loader is not threading.current_thread():
            loader.join(30)

    # --- loading --------------------------------------------------------------------------

    def _want_loaded(self, model: _Model) -> None:
        """Queue a load of `model` unless one is queued or running (under the lock)."""
        if model.info.state == "loadable":
            self._change(model, state="loading", error=None)
            self._loads.append(model)
            self._lock.notify_all()

    def _load_loop(self) -> None:
        while True:
            with self._lock:
                while not self._loads and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                model = self._loads.popleft()
            error = self._load(model)
            if error is not None and not self._closing:  # closing: dropped without events
                self._fail_waiting(model, error)

    def _load(self, model: _Model) -> str | None:
        """Fetch, make room for and start `model`'s engine; hand it what waits. Returns why
        it failed, or None. Runs on the loader thread (or in `start`)."""
        name = model.name
        with self._lock:
            self._change(model, state="loading", error=None)
        try:
            last = [0.0]

            def progress(done: int, total: int) -> None:
                now = time.monotonic()
                if now - last[0] >= PROGRESS_EVERY or done >= total:
                    last[0] = now
                    with self._lock:
                        self._change(model, download=Download(done, total))

            path = self._source.fetch(name, progress)
            size = self._source.size(path)
        except Exception as exc:
            return self._failed(model, f"{name}: {_reason(exc)}")
        with self._lock:
            self._change(model, size_bytes=size, download=None)
        if size > self.max_memory:
            return self._failed(
                model,
                f"{name} needs {_gib(size)} and this runner's memory budget is "
                f"{_gib(self.max_memory)} (--max-memory)",
            )
        if not self._make_room(model, size):
            return self._failed(model, "the runner is closing")
        log.info(
            "loading %s (%s of %s in use)", name, _gib(self.loaded_bytes), _gib(self.max_memory)
        )
        engine = self._make_engine(name, path)
        if self._cache_watcher is not None:
            engine.watch_cache(self._cache_watcher)
        try:
            engine.start(self._relay(model))
        except Exception as exc:
            return self._failed(model, f"{name}: {_reason(exc)}")
        info = next((i for i in engine.models if i.id == name), None)
        with self._lock:
            if self._closing:
                closing = True
            else:
                closing = False
                model.engine = engine
                self.loads += 1
                base = info or ModelInfo(name, None)
                model.info = attrs.evolve(
                    base,
                    state="loaded",
                    size_bytes=base.size_bytes or size,
                    download=None,
                    error=None,
                )
                waiting, model.waiting = model.waiting, []
                for request in waiting:  # under the lock: before any request after them
                    model.running.add(request.request_id)
                    self._where[request.request_id] = model
                    engine.submit(request)
                self._announce(model)
        if closing:
            engine.close()
            return "the runner is closing"
        return None

    def _make_room(self, model: _Model, size: int) -> bool:
        """Unload least recently used idle models until `size` more bytes fit. When that is
        not enough, the least recently used busy one is evicted: it finishes what it runs,
        new requests for it wait for its next load, then it is unloaded (and loaded again
        after this load if requests wait for it). False if the shelf closes first."""
        while True:
            with self._lock:
                if self._closing:
                    return False
                if self._used() + size <= self.max_memory:
                    self._stop_evicting()
                    return True
                others = [m for m in self._models.values() if m is not model]
                idle = [m for m in others if m.unloadable]
                if not idle:
                    self._evict(model, others)
                    self._lock.wait(1.0)
                    continue
                victim = min(idle, key=lambda m: m.last_used)
                engine, victim.engine = victim.engine, None
                victim.evicting = False
                self.unloads += 1
                self._change(victim, state="loadable")
                if victim.waiting:
                    self._want_loaded(victim)  # after this load: it is queued behind it
            log.info("unloading %s to make room for %s", victim.name, model.name)
            assert engine is not None
            engine.close()
            if self._cache_watcher is not None:
                self._cache_watcher(CacheChange(victim.name, reset=True))
            gc.collect()
            _clear_accelerator_cache()

    def _evict(self, model: _Model, others: list[_Model]) -> None:
        """Mark the least recently used loaded model not being evicted yet for eviction
        (under the lock), unless those being evicted will make room already."""
        evicting = [m for m in others if m.evicting]
        freed = sum(m.info.size_bytes or 0 for m in evicting)
        size = model.info.size_bytes or 0
        if evicting and self._used() - freed + size <= self.max_memory:
            return
        loaded = [m for m in others if m.engine is not None and not m.evicting]
        if loaded:
            victim = min(loaded, key=lambda m: m.last_used)
            victim.evicting = True
            log.info(
                "%s waits for %s to finish its %d request(s)",
                model.name,
                victim.name,
                len(victim.running),
            )

    def _stop_evicting(self) -> None:
        """Room was made without them: models marked for eviction serve again, and what
        waited for them runs (under the lock)."""
        for m in self._models.values():
            if m.evicting and m.engine is not None:
                m.evicting = False
                held, m.waiting = m.waiting, []
                for request in held:
                    m.running.add(request.request_id)
                    self._where[request.request_id] = m
                    m.engine.submit(request)

    def _failed(self, model: _Model, reason: str) -> str:
        log.error("could not load %s", reason)
        with self._lock:
            self._change(model, state="loadable", download=None, error=reason)
        return reason

    def _fail_waiting(self, model: _Model, reason: str) -> None:
        with self._lock:
            waiting, model.waiting = model.waiting, []
        for request in waiting:
            emit(
                self._sink,
                Failure(request.request_id, "model_load_failed", f"Could not load {reason}."),
            )

    def _size_on_disk(self, model: _Model) -> None:
        """A model already on disk gets its size before any load (for /v1/runners)."""
        try:
            path = self._source.on_disk(model.name)
            size = None if path is None else self._source.size(path)
        except Exception as exc:
            log.warning("%s: %s", model.name, _reason(exc))
            return
        if size is None:
            return  # not on disk yet: its size is known once downloaded
        with self._lock:
            self._change(model, size_bytes=size)

    # --- bookkeeping (under the lock) -----------------------------------------------------

    def _used(self) -> int:
        return sum(m.info.size_bytes or 0 for m in self._models.values() if m.engine is not None)

    def _change(self, model: _Model, **changes: object) -> None:
        model.info = attrs.evolve(model.info, **changes)  # type: ignore[arg-type]
        self._announce(model)

    def _announce(self, model: _Model) -> None:
        watcher = self._watcher
        if watcher is not None:
            watcher(model.info)

    def _relay(self, model: _Model) -> Sink:
        """The sink of `model`'s engine: events go on to the runner; a request's end frees
        it from the model's books (and may let a waiting load unload the model)."""
        sink = self._sink
        assert sink is not None

        def relay(event: EngineEvent) -> None:
            if isinstance(event, Failure) or event.finish_reason is not None:
                with self._lock:
                    model.running.discard(event.request_id)
                    self._where.pop(event.request_id, None)
                    if not model.running:
                        self._lock.notify_all()
            sink(event)

        return relay


PROGRESS_EVERY = 0.5
"""Seconds between two download progress reports of one model."""


def _reason(exc: BaseException) -> str:
    # An engine's start wraps what its load raised; a download error is worded for people.
    cause = exc.__cause__ if type(exc) is ModelLoadError and exc.__cause__ else exc
    return str(cause) or type(cause).__name__


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def _clear_accelerator_cache() -> None:
    """Hand an unloaded model's buffers back (MLX keeps freed buffers cached)."""
    mx.clear_cache()
