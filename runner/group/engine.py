"""`GroupLockStep`: the batched mlx-lm engine, run in lock step by every rank of a group.

Every rank runs the same engine on its part of the model (`split.load`). A pipeline or tensor
split model runs collectives inside each forward pass, so all ranks must run the same forward
passes in the same order: the same batch, the same admissions, the same prefill chunks. The
engine's decisions depend only on what it was given and when (in steps), so it is enough that
every rank's engine gets the same submits and cancels before the same step:

- rank 0 is an ordinary threaded engine (`ThreadedEngine`): the runner's transport submits
  and cancels; before each step its engine thread shares what it drained (`exchange`), then
  steps. Idle, it still steps every `heartbeat` seconds, so that silence means trouble;
- the other ranks have no transport: their engine thread takes each step's message from rank
  0 and runs that step, and stops when rank 0 says the group closes.

`group_engine` makes each rank's engine: an `MlxEngine` with the `Batched` strategy and this
module's `GroupLockStep` as its `lock_step` (the collaborator that loads the rank's part of the
model, shares each step and, on a follower, is the engine thread's loop).

What would make ranks diverge is fixed at load: the draws of requests without a seed come
from a generator every rank seeds alike, and the batch's prefill budget, which adapts to
measured step times, is off (`prefill_share=None`: fixed chunks, as configured).

Failure: an error in a step (MLX raises when a peer's connection drops) or a step that
waits on the others past the timeout (the watchdog) ends the process with a message; the
launcher then ends the others. On rank 0 an "internal_error" Failure emitted during a step is
held until the next step's exchange succeeds: when a member died mid-step, the requests end
as the gateway ends those of a lost runner (`runner_lost`), not as the engine's error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from protocol.frames import ModelInfo
from runner.engine.base import EngineEvent, Failure, Sink
from runner.engine.batched import Batched
from runner.engine.mlx_engine import MlxEngine, engine_version
from runner.engine.mlx_model import MlxModel
from runner.engine.sampling import seed_unseeded
from runner.engine.threaded import AT_ONCE, Follow, Step, Submit
from runner.group import split as splitting
from runner.group.exchange import Exchange, StepMessage
from runner.group.watchdog import Watchdog, leave

log = logging.getLogger("runner.group")


def group_engine(
    model: str,
    lock_step: GroupLockStep,
    *,
    max_concurrent: int = 32,
    **options: Any,
) -> MlxEngine:
    """This rank's engine: batched, in lock step across `lock_step`'s group (module
    docstring). On rank 0 it is an `Engine` like any other; on the others, `start` loads and
    `wait` follows rank 0 until it closes the group."""
    # Measured step times differ by rank: no adaptive prefill budget (see above).
    strategy = Batched(prefill_share=None)
    return MlxEngine(model, max_concurrent, strategy=strategy, lock_step=lock_step, **options)


class GroupLockStep:
    """An `MlxEngine`'s `LockStep` across `exchange`'s group (module docstring).

    Attributes: `steps`, `exchange_seconds` (rank 0: time spent sharing step messages),
    `split` (the one chosen, once loaded).
    """

    def __init__(
        self,
        exchange: Exchange,
        watchdog: Watchdog,
        *,
        split: splitting.Split = "auto",
        backend: str = "ring",
        heartbeat: float = 0.5,
    ) -> None:
        self.exchange = exchange
        self.rank = exchange.rank
        self.watchdog = watchdog
        self.split: splitting.Split = split
        self._backend = backend
        self._heartbeat = heartbeat
        self._last_step_at = time.perf_counter()
        self._outer_sink: Sink | None = None
        self._held: list[EngineEvent] = []
        self._thread: threading.Thread | None = None
        """The engine thread (it loads)."""
        self.steps = 0
        self.exchange_seconds = 0.0
        self.follow: Follow | None = self._follow if self.rank > 0 else None

    def sink(self, sink: Sink) -> Sink:
        self._outer_sink = sink
        return self._hold_errors if self.rank == 0 else _discard

    def _hold_errors(self, event: EngineEvent) -> None:
        if (
            isinstance(event, Failure)
            and event.code == "internal_error"
            and threading.current_thread() is self._thread
        ):
            self._held.append(event)
            return
        assert self._outer_sink is not None
        self._outer_sink(event)

    # The engine thread, every rank.

    def load(self, name: str, context_length: int | None) -> MlxModel:
        self._thread = threading.current_thread()
        # While loading it only watches the launcher: a load has no bound (downloads).
        self.watchdog.start()
        exchange = self.exchange
        # Every rank draws unseeded requests' keys alike (rank 0's seed).
        seed = exchange.share(os.urandom(8) if self.rank == 0 else None)
        seed_unseeded(int.from_bytes(seed, "little"))
        model, tokenizer, config, chosen = splitting.load(
            name, exchange.group, self.split, self._backend
        )
        self.split = chosen
        return MlxModel(name, model, tokenizer, config, context_length=context_length)

    def model_info(self, model: MlxModel, warm_up_seconds: float) -> ModelInfo:
        exchange = self.exchange
        engine = f"{engine_version()}, {self.split} split over {exchange.size} ranks"
        log.info(
            "rank %d/%d: loaded %s (%s split, warmed up in %.0f ms)",
            self.rank,
            exchange.size,
            model.name,
            self.split,
            warm_up_seconds * 1000,
        )
        return ModelInfo(model.name, model.context_length, engine)

    def next_step_at(self, due: bool) -> float | None:
        if due:
            return AT_ONCE
        return self._last_step_at + self._heartbeat

    def step(self, step: Step, now: float, submits: list[Submit], cancels: list[str]) -> None:
        """Rank 0: share what was drained, release held errors, then step like every rank."""
        self.watchdog.busy()
        try:
            started = time.perf_counter()
            self.exchange.share_step(StepMessage(tuple(g for g, _ in submits), tuple(cancels)))
            self.exchange_seconds += time.perf_counter() - started
            held, self._held = self._held, []
            for event in held:
                assert self._outer_sink is not None
                self._outer_sink(event)
            step(now, submits, cancels)
        except Exception as exc:
            leave("rank 0: a step failed: %s", exc)
        self.steps += 1
        self.watchdog.idle()
        self._last_step_at = time.perf_counter()

    def _follow(self, step: Step) -> None:
        """Ranks 1..N-1: the engine thread's loop, rank 0's steps until it closes the group."""
        watchdog = self.watchdog
        while True:
            try:
                message = self.exchange.share_step()
            except Exception as exc:
                leave("rank %d: lost the group: %s", self.rank, exc)
            watchdog.beat()
            if message.close:
                log.info("rank %d: rank 0 closed the group", self.rank)
                return
            now = time.perf_counter()
            watchdog.busy()
            try:
                step(now, [(g, now) for g in message.submits], list(message.cancels))
            except Exception as exc:
                leave("rank %d: a step failed: %s", self.rank, exc)
            self.steps += 1
            watchdog.idle()

    def exit(self, loaded: bool) -> None:
        try:
            if self.rank == 0 and loaded:
                try:
                    self.exchange.share_step(StepMessage(close=True))
                except Exception as exc:
                    log.warning("rank 0: could not tell the group to close: %s", exc)
                log.info(
                    "rank 0: closed the group after %d steps (sharing each took %.0f µs)",
                    self.steps,
                    self.exchange_seconds / max(self.steps, 1) * 1e6,
                )
        finally:
            self.watchdog.stop()


def _discard(event: EngineEvent) -> None:
    """A follower's events: rank 0 reports the same ones."""
