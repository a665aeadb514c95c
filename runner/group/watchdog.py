"""A member that stops hearing from its group ends its own process.

A collective on `mlx.distributed` has no timeout: a member that hangs (stopped, swapping, a
cable pulled without a reset) would hold every other member inside `all_sum` forever. The
watchdog is a thread of its own that ends the process, with a message saying why, when

- the engine thread has been inside one step (its collectives and the forward pass) for
  longer than `timeout` (`busy()` ... `idle()`), or, on a follower, no step message came for
  that long (rank 0 sends one at least every `timeout / 4` even when idle: `beat()`);
- the process that started this one (the launcher) is gone: a member never outlives it.

It ends the process with `os._exit`: the thread it would have to stop is stuck in MLX, and
rank 0's WebSocket closes with the process, so the gateway drops the group at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("runner.group")

LEAVE_SIGNAL = signal.SIGUSR1
"""What a group's supervisor sends the members still running when one failed: they
`leave` at once (`runner.group.member.leave_when_told`)."""
EXIT_GROUP_LOST = 3
"""The exit status of a member whose group broke (a member died, hung or was left alone)."""


def leave(message: str, *args: object) -> None:
    """Log why this member leaves, then end the process at once (status `EXIT_GROUP_LOST`)."""
    log.critical("leaving the runner group: " + message, *args)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_GROUP_LOST)


class Watchdog:
    """Ends the process when the group goes silent for `timeout` seconds (module docstring).

    `expire` is what ending means (tests pass their own); by default `leave`.
    """

    def __init__(
        self,
        timeout: float,
        *,
        rank: int,
        expire: Callable[[str], None] | None = None,
        check_every: float | None = None,
    ) -> None:
        self.timeout = timeout
        self.rank = rank
        self._expire = expire or (lambda message: leave("%s", message))
        self._check_every = check_every or min(0.25, timeout / 8)
        self._parent = os.getppid()
        self._busy_since: float | None = None
        self._last_beat = time.monotonic()
        self._following = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="group-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def busy(self) -> None:
        """The engine thread starts a step."""
        self._busy_since = time.monotonic()

    def idle(self) -> None:
        """The engine thread finished a step."""
        self._busy_since = None

    def beat(self) -> None:
        """A follower got a step message; from the first one on, silence counts."""
        self._following = True
        self._last_beat = time.monotonic()

    def check(self) -> str | None:
        """Why the process should end now, or None."""
        now = time.monotonic()
        if os.getppid() != self._parent:
            return f"rank {self.rank}: the launcher that started this member is gone"
        busy_since = self._busy_since
        if busy_since is not None and now - busy_since > self.timeout:
            return (
                f"rank {self.rank}: one step has waited {now - busy_since:.1f} s on the "
                "other members (more than the group timeout): a member died or hangs"
            )
        if self._following and now - self._last_beat > self.timeout:
            return (
                f"rank {self.rank}: no step from rank 0 for {now - self._last_beat:.1f} s "
                "(more than the group timeout): rank 0 or another member died or hangs"
            )
        return None

    def _watch(self) -> None:
        while not self._stop.wait(self._check_every):
            reason = self.check()
            if reason is not None:
                self._expire(reason)
                return
