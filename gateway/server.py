"""The uvicorn server the gateway runs in, hardened against slow clients.

uvicorn waits forever for a request's headers: a client that opens a socket and sends
nothing, or dribbles a header line now and then (slowloris), holds a connection for good.
`GuardedHttpTools` gives every request `header_timeout` seconds to deliver its headers, then
closes the connection. Idle keep-alive connections are uvicorn's own `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import create_app
from gateway.config import GatewayConfig


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on request headers."""

    header_timeout = 10.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a keep-alive connection's next request gets its own deadline

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class Server(uvicorn.Server):
    """Leaves signal handling to the `orchard` command, which stops things in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_server(config: GatewayConfig, log_level: str, tls: tuple[Path, Path] | None = None) -> Any:
    """A uvicorn server running the gateway app with `config`; over TLS with `tls`, a
    certificate and key file (`gateway.tls`)."""
    protocol = type("HttpProtocol", (GuardedHttpTools,), {"header_timeout": config.header_timeout})
    return Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            http=protocol,
            log_level=log_level,
            ws_max_size=config.max_runner_frame_bytes,
            ws_per_message_deflate=False,
            access_log=log_level == "debug",
            lifespan="off",
            ssl_certfile=str(tls[0]) if tls else None,
            ssl_keyfile=str(tls[1]) if tls else None,
        )
    )
