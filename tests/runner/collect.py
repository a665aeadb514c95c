"""An engine sink for tests, and helpers to check a request's events against the contract."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

from runner.engine.base import EngineEvent, Failure, Output
from tests.support import UNIT


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

    def wait(self, request_id: str, timeout: float = 20) -> list[EngineEvent]:
        with self._changed:
            if not self._changed.wait_for(lambda: self._finished(request_id), timeout * UNIT):
                raise AssertionError(f"{request_id} did not finish: {self.events[request_id]}")
            return list(self.events[request_id])


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
