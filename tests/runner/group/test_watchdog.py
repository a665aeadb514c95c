"""The group member's watchdog (runner.group.watchdog)."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from runner.group.watchdog import Watchdog
from tests.support import UNIT

# --- the watchdog ---------------------------------------------------------------------------


TIMEOUT = 0.3 * UNIT
"""The watchdogs' timeout here."""


def _watch(timeout: float) -> tuple[Watchdog, list[str], threading.Event]:
    reasons: list[str] = []
    fired = threading.Event()

    def expire(reason: str) -> None:
        reasons.append(reason)
        fired.set()

    return Watchdog(timeout, rank=1, expire=expire, check_every=0.02), reasons, fired


def _waited(reason: str, pattern: str) -> float:
    """The seconds a watchdog's reason says it waited (`pattern` has one group for them)."""
    match = re.fullmatch(pattern, reason)
    assert match is not None, reason
    return float(match[1])


def test_watchdog_fires_on_a_step_that_waits_too_long() -> None:
    dog, reasons, fired = _watch(TIMEOUT)
    dog.start()
    started = time.monotonic()
    dog.busy()
    assert fired.wait(2 * UNIT)
    assert TIMEOUT <= time.monotonic() - started < 1.0 * UNIT
    assert reasons == [reasons[0]]
    waited = _waited(reasons[0], r"rank 1: one step has waited (\d+\.\d) s on the other members .*")
    assert waited >= round(TIMEOUT, 1)


def test_watchdog_stays_quiet_while_steps_end_and_beats_come() -> None:
    dog, reasons, fired = _watch(TIMEOUT)
    dog.start()
    for _ in range(10):
        dog.beat()
        dog.busy()
        time.sleep(0.05)
        dog.idle()
    assert not fired.wait(0.1)
    dog.stop()
    assert reasons == []


def test_watchdog_fires_when_a_follower_hears_nothing() -> None:
    dog, reasons, fired = _watch(TIMEOUT)
    dog.start()
    # Before its first message a follower is loading: no limit.
    assert not fired.wait(TIMEOUT + 0.2 * UNIT)
    beat = time.monotonic()
    dog.beat()
    assert fired.wait(2 * UNIT)
    assert time.monotonic() - beat >= TIMEOUT
    waited = _waited(reasons[0], r"rank 1: no step from rank 0 for (\d+\.\d) s .*")
    assert waited >= round(TIMEOUT, 1)


def test_watchdog_fires_when_the_launcher_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    dog, reasons, fired = _watch(10)
    monkeypatch.setattr(os, "getppid", lambda: 1)
    dog.start()
    assert fired.wait(2 * UNIT)
    assert reasons == ["rank 1: the launcher that started this member is gone"]
