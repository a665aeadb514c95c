"""The thread model every engine here shares: one engine thread, fed through locked inboxes.

`submit`, `cancel` and `close` come from other threads (the runner's event loop); they only
append to lock-protected lists and wake the engine thread, which drains them between steps.
Everything else (the models, the requests, MLX state) belongs to the engine thread alone, so
it needs no lock. Rules shared by every engine:

- `start` starts the thread and blocks until the subclass's `_load` has run there; an error
  in `_load` is raised from `start` as a `ModelLoadError`, its cause the original error (a
  BaseException that is no Exception, such as KeyboardInterrupt, and a `ModelLoadError`
  such as a failed download's, unchanged).
- `submit` before `start` (or `start` twice) raises `EngineStateError`.
- `submit` after `close` answers at once, from the caller's thread, with a Failure
  "internal_error" "the engine is closed": no engine thread is left to answer.
- `close` stops the thread at the end of the current step (an engine may stop emitting
  within it); requests still running are dropped without events. It may be called from
  inside the sink, on the engine thread: the thread then ends once the step is over.
- A step that raises is a bug: it is logged and the thread goes on (stopping would hang every
  request in flight). Per-request errors are each engine's to turn into a Failure.
- With a `follow` function (a runner group's member of rank > 0, `runner.group.engine`), the
  engine thread runs it instead of its own loop: it calls `step` with the submits and
  cancels that come from elsewhere, and returns when they stop coming.

A subclass implements the engine thread's side:

- `_load()`: on the engine thread, before serving (load models, build per-thread state);
- `_next_step_at(pending)`: under the lock, when the next step is due; `pending` says whether
  submits or cancels are waiting;
- `_step(now, submits, cancels)`: one step, outside the lock, with what was drained;
- `_thread_exit()`: last thing on the engine thread, whether `_load` succeeded or not.
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
from collections.abc import Callable

from protocol.frames import Generate, ModelInfo
from runner.engine.base import Engine, EngineEvent, Failure, Sink, emit
from runner.errors import EngineStateError, ModelLoadError

log = logging.getLogger("runner.engine")

AT_ONCE = -math.inf
"""`_next_step_at` value: step now."""

Submit = tuple[Generate, float]
"""A submitted request and its `time.perf_counter()` at submission."""
Step = Callable[[float, list[Submit], list[str]], None]
"""`_step(now, submits, cancels)`."""
Follow = Callable[[Step], None]
"""What the engine thread runs instead of its own loop (see the module docstring)."""


class ThreadedEngine(Engine):
    """An `Engine` served by one thread of its own (see the module docstring)."""

    def __init__(
        self, *, thread_name: str, close_timeout: float, follow: Follow | None = None
    ) -> None:
        self._thread_name = thread_name
        self._follow = follow
        self._close_timeout = close_timeout
        self._models: tuple[ModelInfo, ...] = ()
        self._sink: Sink | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None

        # Shared with the callers of submit, cancel and close: only under the lock.
        self._lock = threading.Condition()
        self._inbox: list[Submit] = []
        self._cancels: list[str] = []
        self._closing = False

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        return self._models

    def start(self, sink: Sink) -> None:
        """Start the engine thread and wait until it has loaded what it serves.

        Raises `ModelLoadError` if that failed (the thread has ended then).
        """
        if self._thread is not None:
            raise EngineStateError("the engine was already started")
        self._sink = sink
        self._thread = threading.Thread(target=self._serve, name=self._thread_name, daemon=True)
        self._thread.start()
        self._ready.wait()
        error = self._load_error
        if error is not None:
            self._thread.join()
            if not isinstance(error, Exception) or isinstance(error, ModelLoadError):
                raise error  # KeyboardInterrupt and the like, or worded already (a download)
            raise ModelLoadError(f"{type(error).__name__}: {error}") from error

    def submit(self, request: Generate) -> None:
        if self._sink is None:
            raise EngineStateError("submit before start")
        with self._lock:
            closed = self._closing
            if not closed:
                self._inbox.append((request, time.perf_counter()))
                self._lock.notify()
        if closed:
            emit(self._sink, Failure(request.request_id, "internal_error", "the engine is closed"))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.append(request_id)
            self._lock.notify()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        thread = self._thread
        # From inside the sink (the engine thread) the loop ends when the sink returns.
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._close_timeout)
            if thread.is_alive():
                log.warning("%s still busy %.0f s after close", thread.name, self._close_timeout)

    def wait(self) -> None:
        """Block until the engine thread ends (a follower's: when what it follows stops)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def _emit(self, event: EngineEvent) -> None:
        """Hand an event to the sink, from the engine thread."""
        emit(self._sink, event)

    # The engine thread.

    def _serve(self) -> None:
        try:
            try:
                self._load()
            except BaseException as exc:  # raised by start(), on the thread that called it
                self._load_error = exc
                return
            finally:
                self._ready.set()
            if self._follow is not None:
                self._follow(self._step)
            else:
                self._loop()
        finally:
            self._thread_exit()

    def _loop(self) -> None:
        lock = self._lock
        while True:
            with lock:
                while True:
                    if self._closing:
                        return
                    now = time.perf_counter()
                    due = self._next_step_at(bool(self._inbox or self._cancels))
                    if due is not None and now >= due:
                        break
                    lock.wait(None if due is None else due - now)
                submits, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            try:
                self._step(now, submits, cancels)
            except Exception:
                # Engines handle per-request errors themselves: this is a bug, and stopping
                # would hang every request in flight.
                log.exception("%s: step failed", self._thread_name)

    def _load(self) -> None:
        """Load what the engine serves and set `_models`; runs on the engine thread."""

    @abc.abstractmethod
    def _next_step_at(self, pending: bool) -> float | None:
        """When the next step is due, as a `time.perf_counter()` time (`AT_ONCE`: now), or
        None to sleep until a submit, cancel or close. Called under the lock."""

    @abc.abstractmethod
    def _step(self, now: float, submits: list[Submit], cancels: list[str]) -> None:
        """Take in `submits` and `cancels`, then advance the requests due at `now`."""

    def _thread_exit(self) -> None:
        """Release what the engine thread holds; its last call, also after a failed load."""
