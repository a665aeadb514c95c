"""The engine interface: what the runner's transport loop needs from a model backend.

An engine owns its models and its own thread(s). The transport calls `submit` and `cancel`
from the event loop; the engine reports progress by calling the sink from its own thread
(the transport hops back to the loop). Per request, the engine emits zero or more `Output`s
without a finish_reason, then exactly one terminal event: an `Output` with a finish_reason
("stop", "length" or "cancelled") or a `Failure`.

The engines here (mlx_engine, batched, scripted) share one thread model, `threaded.ThreadedEngine`,
which states the rules around these calls (before start, after close, load errors).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable

import attrs

from protocol.frames import (
    Echo,
    ErrorCode,
    FinishReason,
    Generate,
    GenerationStats,
    ModelInfo,
    Speculation,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)


@attrs.frozen
class Output:
    """Text produced for a request since its previous Output."""

    request_id: str
    text: str
    reasoning: str
    tokens: int
    """Completion tokens this output covers."""
    usage: Usage
    """Usage of the whole request so far."""
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    """Set on the terminal output."""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0
    """The choice, for a request with n > 1 (see `protocol.frames.Chunk`)."""
    choice_finish: FinishReason | None = None
    echo: Echo | None = None
    """The prompt, on the first outputs of each choice of a request with `echo` (a long one
    in pieces, before the choice's first token)."""
    matched_stop: str | None = None
    """The stop string that ended the request or choice (see `protocol.frames.Chunk`)."""


@attrs.frozen
class Failure:
    """The request failed; no more events follow for it."""

    request_id: str
    code: ErrorCode
    message: str
    param: str | None = None
    """The request parameter at fault, as OpenAI names it."""


EngineEvent = Output | Failure
Sink = Callable[[EngineEvent], None]


@attrs.frozen
class CacheChange:
    """Prefix hashes (`protocol.frames.Generate.prefix`) of `model` that the engine's KV
    caches started to hold (`added`) or stopped holding in any tier (`removed`). With
    `reset`, `added` is all it holds now (nothing, for a model unloaded)."""

    model: str
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    reset: bool = False


CacheWatcher = Callable[[CacheChange], None]


@attrs.frozen
class KvUsage:
    """What an engine's KV caches take, for heartbeats (None: not known or not bounded)."""

    bytes: int | None = None
    """Running requests' and kept prompts' caches in memory."""
    limit_bytes: int | None = None
    prefix_bytes: int | None = None
    """Of `bytes`, the kept prompts' (the prefix cache's memory tier)."""
    disk_bytes: int | None = None
    """The prefix cache's files."""
    disk_limit_bytes: int | None = None


log = logging.getLogger("runner.engine")


def emit(sink: Sink | None, event: EngineEvent) -> None:
    """Hand an event to the sink from an engine's own thread. A broken sink is logged, never
    raised: it must not take that thread (and every request on it) down."""
    assert sink is not None
    try:
        sink(event)
    except Exception:
        log.exception("engine sink failed on %r", event)


class Engine(abc.ABC):
    """A model backend serving one or more models."""

    @property
    @abc.abstractmethod
    def models(self) -> tuple[ModelInfo, ...]:
        """The models served, valid after `start`."""

    @abc.abstractmethod
    def start(self, sink: Sink) -> None:
        """Load models and start serving; blocks until ready. `sink` gets every event."""

    @abc.abstractmethod
    def submit(self, request: Generate) -> None:
        """Queue a request. Thread-safe and non-blocking; errors come back as a Failure."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Stop a request at its next token; it ends with an Output finish "cancelled".

        Unknown or finished ids are ignored.
        """

    def watch_cache(self, watcher: CacheWatcher) -> None:
        """Have `watcher` told, from the engine's thread, of every change to the prefix hashes
        its caches hold, in order with the events of the sink: a request's cache is reported
        before its last output. Engines that keep no prefix cache never call it."""
        del watcher

    def cache_held(self) -> dict[str, tuple[str, ...]]:
        """The prefix hashes held now, by model (thread-safe: for a new connection)."""
        return {}

    def kv_usage(self) -> KvUsage:
        """What the KV caches take now (thread-safe: for heartbeats)."""
        return KvUsage()

    def speculation(self) -> tuple[Speculation, ...]:
        """Each loaded model with a draft model: its drafted and accepted tokens so far
        (thread-safe: for heartbeats)."""
        return ()

    def memory_budget(self) -> int | None:
        """What the loaded models may take together, for an engine that loads models on
        demand (`Hello.memory_budget_bytes`); None otherwise."""
        return None

    def watch_models(self, watcher: Callable[[ModelInfo], None]) -> None:
        """Have `watcher` told of every change of a model's state (loading with download
        progress, loaded, unloaded), from any thread. Engines that load every model in
        `start` and keep it never call it."""
        del watcher  # nothing changes here

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine's threads; requests still running are dropped without events."""
