"""An engine sink for tests, and helpers to check a request's events against the contract."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from protocol.frames import Generate
from runner.accounting import Piece, RequestAccounting
from runner.demo_model import DEMO_MODEL_ID
from runner.engine.base import Engine, EngineEvent, Failure, Output
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


E = TypeVar("E", bound=Engine)


def run(engine: Engine, collector: Collector, request: Generate) -> list[EngineEvent]:
    """Submit one request and wait for all its events."""
    engine.submit(request)
    return collector.wait(request.request_id)


@contextlib.contextmanager
def engine_starter(make: Callable[..., E]) -> Iterator[Callable[..., tuple[E, Collector]]]:
    """A `start(**options)` that builds and starts engines; all are closed on exit."""
    engines: list[E] = []

    def start(**options: Any) -> tuple[E, Collector]:
        collector = Collector()
        engine = make(DEMO_MODEL_ID, **options)
        engine.start(collector)
        engines.append(engine)
        return engine, collector

    try:
        yield start
    finally:
        for engine in engines:
            engine.close()


def check_failure_stays_alone(
    engine: Engine,
    collector: Collector,
    boom: Generate,
    others: list[Generate],
    *,
    message: str,
    expected_texts: Callable[[Generate], list[str]],
) -> None:
    """Submit `boom` (made to fail at its third token) beside `others`: it ends with one
    internal_error Failure after two outputs, and the others lose nothing."""
    engine.submit(boom)
    for request in others:
        engine.submit(request)
    events = collector.wait(boom.request_id)
    assert [type(e) for e in events] == [Output, Output, Failure]
    failure = events[-1]
    assert isinstance(failure, Failure)
    assert failure.code == "internal_error"
    assert message in failure.message
    for request in others:
        assert [o.text for o in outputs(collector.wait(request.request_id))] == (
            expected_texts(request)
        )


def fail_third_token(monkeypatch: pytest.MonkeyPatch, prompt_tokens: int, message: str) -> None:
    """Make the mlx engines fail while handling the third generated token of the request whose
    prompt is `prompt_tokens` long (through `RequestAccounting`, which both decoders feed)."""
    real = RequestAccounting.feed

    def feed(self: RequestAccounting, token_id: int, text: str) -> Piece:
        piece = real(self, token_id, text)
        if self.prompt_tokens == prompt_tokens and self.completion_tokens == 3:
            raise RuntimeError(message)
        return piece

    monkeypatch.setattr(RequestAccounting, "feed", feed)
