"""Give the memory of finished streams back to the operating system.

Python frees a stream's objects when it ends, but the C allocator keeps the freed pages for
reuse: after a burst of 1,000 streams or browser sockets the gateway's RSS stays at its peak.
When the last stream and socket are gone, `release_free_memory` asks the allocator to return
free pages (glibc `malloc_trim`, macOS `malloc_zone_pressure_relief`). It costs a few
milliseconds (with a full garbage collection first), so `IdleTrimmer` runs it only a while
after a sizeable load went away.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import sys
from collections.abc import Callable

log = logging.getLogger("gateway.memory")


def _ignore(_: object) -> None:
    pass


def _releaser() -> Callable[[], None] | None:
    try:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            trim = libc.malloc_trim  # glibc only; musl has none
            trim.argtypes = [ctypes.c_size_t]
            return lambda: _ignore(trim(0))
        if sys.platform == "darwin":
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.dylib")
            relief = libc.malloc_zone_pressure_relief
            relief.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            return lambda: _ignore(relief(None, 0))
    except (OSError, AttributeError):
        pass
    return None


_RELEASE = _releaser()


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS; False where there is no way to."""
    if _RELEASE is None:
        return False
    _RELEASE()
    return True


class IdleTrimmer:
    """Calls `release_free_memory` shortly after the last stream of a load ends."""

    def __init__(self, delay: float = 1.0, min_streams: int = 32) -> None:
        self.delay = delay
        """Seconds of idleness first, so a closed loop of requests never pays for it."""
        self.min_streams = min_streams
        """Loads smaller than this leave too little behind to be worth a trim."""
        self.trims = 0
        self._peak = 0
        self._timer: asyncio.TimerHandle | None = None

    def busy(self, in_flight: int) -> None:
        """A stream or socket opened; `in_flight` (of its kind) counts it."""
        self._peak = max(self._peak, in_flight)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def idle(self) -> None:
        """The last stream in flight (or the last socket) ended."""
        if self._peak < self.min_streams or self._timer is not None:
            return
        self._timer = asyncio.get_running_loop().call_later(self.delay, self._trim)

    def _trim(self) -> None:
        self._timer = None
        self._peak = 0
        # Closed connections leave reference cycles (tasks, exceptions and their tracebacks)
        # that only the cyclic collector frees, and it runs on allocations, which have stopped.
        gc.collect()
        if release_free_memory():
            self.trims += 1
            log.debug("returned free memory to the OS after a load of streams")
