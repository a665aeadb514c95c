"""An engine sink for tests, helpers to check a request's events against the contract, and
engines started once and lent to a module's tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from protocol.frames import Generate
from runner.engine.base import Engine, EngineEvent, Failure, Output
from tests.support import UNIT

if TYPE_CHECKING:
    from runner.engine.mlx_engine import MlxEngine


class Collector:
    """An engine sink that files events per request and lets a test wait for the end of one."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.events: dict[str, list[EngineEvent]] = defaultdict(list)
        self.on_event: Callable[[EngineEvent], None] | None = None

    def __call__(self, event: EngineEvent) -> None:
        with self._changed:
            self.events[event.request_id].append(event)
            self._changed.notify_all()
        if self.on_event is not None:
            self.on_event(event)

    def _finished(self, request_id: str) -> bool:
        events = self.events.get(request_id)
        return events is not None and bool(events) and is_terminal(events[-1])

    def wait(self, request_id: str, timeout: float = 60) -> list[EngineEvent]:
        """Wait for the end of a request; its events. The timeout is for a hang: a long
        prompt takes 20 s of a busy CPU here."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._finished(request_id), timeout * UNIT):
                raise AssertionError(f"{request_id} did not finish: {self.events[request_id]}")
            return list(self.events[request_id])

    def wait_for_outputs(self, request_id: str, count: int, timeout: float = 60) -> None:
        """Wait until `count` events of a request have come."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: len(self.events.get(request_id, ())) >= count, timeout * UNIT
            ):
                raise AssertionError(f"{request_id}: {self.events[request_id]}")


def is_terminal(event: EngineEvent) -> bool:
    return isinstance(event, Failure) or event.finish_reason is not None


def outputs(events: list[EngineEvent]) -> list[Output]:
    """The events of a request that ended with an Output (asserting the contract)."""
    assert all(isinstance(e, Output) for e in events), events
    result = [e for e in events if isinstance(e, Output)]
    assert all(e.finish_reason is None for e in result[:-1])
    assert result[-1].finish_reason is not None
    assert result[-1].stats is not None
    return result


def text_of(events: list[EngineEvent]) -> str:
    return "".join(o.text for o in outputs(events))


def final(events: list[EngineEvent]) -> Output:
    return outputs(events)[-1]


E = TypeVar("E", bound=Engine)


def run(engine: Engine, collector: Collector, request: Generate) -> list[EngineEvent]:
    """Submit one request and wait for all its events."""
    # A request id seen before would find that request's events.
    assert not collector.events.get(request.request_id), f"{request.request_id} is taken"
    engine.submit(request)
    return collector.wait(request.request_id)


@contextlib.contextmanager
def engine_starter(make: Callable[..., E]) -> Iterator[Callable[..., tuple[E, Collector]]]:
    """A `start(**options)` that builds engines with `make(**options)` and starts them; all
    are closed on exit."""
    engines: list[E] = []

    def start(**options: Any) -> tuple[E, Collector]:
        collector = Collector()
        engine = make(**options)
        engine.start(collector)
        engines.append(engine)
        return engine, collector

    try:
        yield start
    finally:
        for engine in engines:
            engine.close()


M = TypeVar("M", bound="MlxEngine")


class SharedEngine(Generic[M]):
    """A started mlx engine that a module's tests borrow one at a time, so that its load and
    warm-up are paid once (a module-scoped fixture's, with `shared_engine`).

    A borrower gets a `Collector` of its own (its request ids are its own) and leaves
    nothing running. The engine's counters and prefix cache carry over from test to test:
    tests read counters as differences, and one that needs them from zero, an empty prefix
    cache or options of its own starts an engine of its own.
    """

    def __init__(self, make: Callable[[], M]) -> None:
        self._make = make
        self._collector = Collector()
        self.engine = self._started()

    def _started(self) -> M:
        engine = self._make()
        engine.start(self._forward)
        return engine

    def _forward(self, event: EngineEvent) -> None:
        self._collector(event)

    @contextlib.contextmanager
    def borrow(self) -> Iterator[tuple[M, Collector]]:
        """The engine and a new collector that gets its events until the borrower is done;
        then the engine must be idle. One left busy (a test that failed half-way, or left a
        request running) is replaced, so the next test gets an idle one, and that is an
        error of this test."""
        collector = self._collector = Collector()
        try:
            yield self.engine, collector
        finally:
            self._collector = Collector()  # what comes later is nobody's
            running = sorted(
                request_id
                for request_id, events in collector.events.items()
                if events and not is_terminal(events[-1])
            )
            if running or not self._idle():
                self.engine.close()
                self.engine = self._started()
                raise AssertionError(f"the module's engine was left busy: {running} running")

    def _idle(self) -> bool:
        # A request's counters change at the end of the step that emitted its last event.
        deadline = time.monotonic() + 5 * UNIT
        while self.engine.stats.active_requests or self.engine.stats.waiting_requests:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self.engine.close()


@contextlib.contextmanager
def shared_engine(make: Callable[[], M]) -> Iterator[SharedEngine[M]]:
    """A `SharedEngine` made with `make()`, closed on exit."""
    shared = SharedEngine(make)
    try:
        yield shared
    finally:
        shared.close()


def hold(
    engine: Engine,
    collector: Collector,
    gate: Generate,
    then: Callable[[EngineEvent], None] | None = None,
) -> threading.Event:
    """Block the engine thread inside the sink, on the first event of the one-token `gate`
    request, until the returned event is set: what is submitted meanwhile reaches the engine
    in one step. Later events go to `then`."""
    release = threading.Event()

    def on_event(event: EngineEvent) -> None:
        if event.request_id == gate.request_id:
            release.wait(5 * UNIT)
        elif then is not None:
            then(event)

    collector.on_event = on_event
    run(engine, collector, gate)
    return release
