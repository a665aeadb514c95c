"""Gateway processes shared by the gateway's test modules (tests/gateway/conftest.py's
`gateways` and the fixtures built on it). A candidate for tests.support if other packages
start gateways by their options too."""

from __future__ import annotations

from tests.support import Gateway, secs, wait_until

SHORT_STREAM_TIMEOUT = 0.5
"""`short_timeout_gateway`'s --stream-timeout, in the tests' time unit."""

FAKE_RUNNERS = ("--liveness-timeout", secs(30))
"""For a gateway that fake runners connect to. A FakeRunner answers the gateway's heartbeats
only while its test reads from it (`next_request`): with the default 2.5 s of silence a
busy machine had one dropped while its test was doing something else."""


class Gateways:
    """Gateway processes shared by the modules of a run, one per set of options (a start
    costs seconds of CPU): started on first use, started again if one died, stopped when the
    run ends. Only for gateways without API keys, whose tests leave no runner behind: each
    is handed out once the last module's runners have left it."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, ...], Gateway] = {}

    def get(self, *options: str) -> Gateway:
        gateway = self._running.get(options)
        if gateway is not None and not gateway.process.alive():
            gateway.stop()
            gateway = None
        if gateway is None:
            gateway = self._running[options] = Gateway(*options)
        wait_until(lambda: gateway.runners() == [], 10, "the shared gateway's runners to leave")
        return gateway

    def close(self) -> None:
        for gateway in self._running.values():
            gateway.stop()
        self._running.clear()
