"""Where the pool has put each request: the runners it knows and the requests on them.

A `RunnerConn` is one connected runner; its session (`protocol.session.GatewaySession`)
holds the `Placement` of every request the pool gave it. A `Placement` is the pool's record
of one request: the runner it is on, how many runners it has been given to, its prefix
hashes (for routing) and its meter. Its `stream` is what the request's client reads
(`gateway.streaming.request_stream`); the stream sees its placement only through the small
interface it declares (`Placed`), so that it imports nothing of the pool.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Final

from gateway.observability.metrics import Meter
from gateway.pool.affinity import Holdings
from gateway.streaming.request_stream import RequestStream
from protocol.frames import Generate, ModelInfo
from protocol.prefix import PrefixChain
from protocol.session import GatewaySession


class RunnerConn:
    """One connected, registered runner: its session (every request it carries, its slots,
    its drain state and counters: `protocol.session.GatewaySession`) and its socket."""

    def __init__(
        self,
        runner_id: str,
        session: GatewaySession[Placement],
        send: Callable[[bytes], Awaitable[None]],
        close: Callable[[int, str], Awaitable[None]],
    ) -> None:
        assert session.hello is not None, "a runner joins the pool after its hello"
        self.id = runner_id
        self.hello: Final = session.hello
        self.session = session
        self.send = send
        self.close = close
        self.connected_at = time.time()
        self.holdings = Holdings()
        """The prefixes its caches hold, its requests' waiting prefill, its measured rates
        (`gateway.pool.affinity`)."""

    @property
    def name(self) -> str:
        return self.hello.runner_name

    @property
    def models(self) -> frozenset[str]:
        """Every model it serves, loaded or loadable on demand."""
        return self.session.models

    def infos(self) -> list[ModelInfo]:
        """Its models as it last described them (state, size, download progress)."""
        return list(self.session.model_infos.values())

    def loading(self, model: str) -> bool:
        """`model` is loading here (requests for it wait on the runner meanwhile)."""
        info = self.session.model_infos.get(model)
        return info is not None and info.state == "loading"

    def has_in_memory(self, model: str) -> bool:
        """`model` is loaded here, or loading."""
        info = self.session.model_infos.get(model)
        return info is not None and info.state != "loadable"


class Placement:
    """One request as the pool places it: on which runner, how often, with what prefix.
    Made with its `stream`, which points back to it."""

    __slots__ = ("attempts", "meter", "prefix", "runner", "stream")

    def __init__(
        self, generate: Generate, meter: Meter | None = None, prefix: PrefixChain | None = None
    ) -> None:
        self.meter = meter
        """Counts the request in the gateway's metrics (gateway.observability.metrics)."""
        self.prefix = prefix if prefix is not None else PrefixChain((), ())
        """Its prefix hashes and the prompt characters each covers (`gateway.pool.affinity`)."""
        self.runner: RunnerConn | None = None
        """The runner it was last given to; None while it waits for one."""
        self.attempts = 0
        """Runners this request has been given to (failover retries once)."""
        self.stream = RequestStream(generate, meter, self)
        """What the request's client reads."""

    @property
    def generate(self) -> Generate:
        return self.stream.generate

    @property
    def request_id(self) -> str:
        return self.stream.generate.request_id

    def model_loading(self) -> bool:
        """Its runner is loading its model (downloading it, perhaps): silence is expected
        until it is loaded, and does not count toward the stream timeout (the runner's
        heartbeats say it is alive)."""
        runner = self.runner
        return runner is not None and runner.loading(self.stream.generate.model)
