"""ThreadedEngine's own rules, on a minimal engine built on its subclass interface: a bug in a
step, load errors, and the thread-exit hook. (The rules every engine shows, such as submit
after close, are in test_contract.)"""

from __future__ import annotations

import logging
import threading

import pytest

from protocol.frames import Generate, GenerationStats, Message, ModelInfo, Usage
from runner.engine.base import Output
from runner.engine.threaded import AT_ONCE, Submit, ThreadedEngine
from runner.errors import ModelLoadError
from tests.runner.collect import Collector, final, run
from tests.support import wait_until


class Echo(ThreadedEngine):
    """Ends each request at the next step with one Output; a request for model "bug" makes the
    step raise."""

    def __init__(self, load_error: BaseException | None = None) -> None:
        super().__init__(thread_name="echo", close_timeout=5.0)
        self._raise_on_load = load_error
        self.exits: list[str] = []

    def _load(self) -> None:
        if self._raise_on_load is not None:
            raise self._raise_on_load
        self._models = (ModelInfo("echo", 8),)

    def _next_step_at(self, pending: bool) -> float | None:
        return AT_ONCE if pending else None

    def _step(self, now: float, submits: list[Submit], cancels: list[str]) -> None:
        for request, _ in submits:
            if request.model == "bug":
                raise RuntimeError("a bug")
            stats = GenerationStats(0.0, 0.0, 0, 0.0)
            self._emit(Output(request.request_id, "hi", "", 1, Usage(1, 1), "stop", stats))

    def _thread_exit(self) -> None:
        self.exits.append(threading.current_thread().name)


def ask(request_id: str, model: str = "echo") -> Generate:
    return Generate(request_id, model, (Message("user", "Hi"),))


def test_a_step_that_raises_is_logged_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, collector = Echo(), Collector()
    engine.start(collector)
    try:
        assert engine.models == (ModelInfo("echo", 8),)
        with caplog.at_level(logging.ERROR, logger="runner.engine"):
            engine.submit(ask("r1", model="bug"))
            wait_until(lambda: bool(caplog.records), 5, "the step to fail")
            assert final(run(engine, collector, ask("r2"))).text == "hi"
    finally:
        engine.close()
    assert [r.getMessage() for r in caplog.records] == ["echo: step failed"]
    assert "r1" not in collector.events
    assert engine.exits == ["echo"]


def test_a_load_error_is_raised_by_start_after_the_thread_ended() -> None:
    error = ValueError("no such model")
    engine = Echo(load_error=error)
    with pytest.raises(ModelLoadError, match=r"^ValueError: no such model$") as raised:
        engine.start(Collector())
    assert raised.value.__cause__ is error
    assert engine.exits == ["echo"]  # the exit hook runs after a failed load too
    assert engine.models == ()


class Interrupted(BaseException):
    pass


def test_what_is_not_an_error_is_raised_unchanged() -> None:
    engine = Echo(load_error=Interrupted())
    with pytest.raises(Interrupted):
        engine.start(Collector())
    assert engine.exits == ["echo"]
