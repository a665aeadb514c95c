"""Starting the gateway (`orchard gateway`, and `orchard serve`'s): the client API keys, the
exposure check, TLS, the server (its stores' file opened: `StartRefused` when it cannot be),
mDNS, and the drain on SIGTERM."""

# gateway.server, gateway.tls and gateway.discovery load Litestar, uvicorn, cryptography and
# zeroconf: each is imported where it is used, so that `orchard --help` starts fast.
# ruff: noqa: PLC0415

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import click

from gateway.config import GatewayConfig
from gateway.errors import StoreUnavailable
from orchard.running import run


class StartRefused(click.ClickException):
    """The gateway cannot start as configured (its `--store` file cannot be used): one line,
    exit status 2, which a service manager is told not to retry (docs/operations.md)."""

    exit_code = 2


def refusing_to_start(start: Callable[[], None]) -> None:
    """Run `start`; a `StoreUnavailable` from it becomes a `StartRefused`, not a traceback."""
    try:
        start()
    except StoreUnavailable as exc:
        raise StartRefused(str(exc)) from None


def client_keys(api_key: tuple[str, ...], api_key_file: Path | None) -> frozenset[str]:
    """The client API keys of --api-key, ORCHARD_API_KEYS and --api-key-file together."""
    keys = set(api_key)
    keys.update(k.strip() for k in os.environ.get("ORCHARD_API_KEYS", "").split(",") if k.strip())
    if api_key_file is not None:
        keys.update(line.strip() for line in api_key_file.read_text().splitlines() if line.strip())
    return frozenset(keys)


def start(
    config: GatewayConfig,
    log_level: str,
    *,
    tls: bool | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    name: str,
    advertise: bool,
) -> None:
    """Check the exposure, settle TLS, then serve until stopped."""
    check_exposure(config)
    config, files = with_tls(config, tls, tls_cert, tls_key)
    refusing_to_start(
        lambda: run(run_gateway(config, log_level, name=name, advertise=advertise, tls=files))
    )


def with_tls(
    config: GatewayConfig, tls: bool | None, cert: Path | None, key: Path | None
) -> tuple[GatewayConfig, tuple[Path, Path] | None]:
    """The config with the certificate chain it serves and its authority's fingerprint, and
    the certificate and key to serve TLS with (None: plain HTTP)."""
    files = tls_files(config, tls, cert, key)
    if files is None:
        return config, None
    from gateway.tls import authority_fingerprint, served_chain

    served = attrs.evolve(
        config, tls_fingerprint=authority_fingerprint(files[0]), tls_chain=served_chain(files[0])
    )
    return served, files


def tls_files(
    config: GatewayConfig, tls: bool | None, cert: Path | None, key: Path | None
) -> tuple[Path, Path] | None:
    """The certificate and key to serve TLS with, or None (plain HTTP)."""
    from gateway.auth import is_loopback

    if (cert is None) != (key is None):
        raise click.UsageError("--tls-cert and --tls-key go together.")
    if tls is None:
        tls = cert is not None or not is_loopback(config.host)
    if not tls:
        return None
    if cert is not None and key is not None:
        return cert, key
    from gateway.discovery import addresses_for
    from gateway.tls import default_directory, ensure_certificate

    return ensure_certificate(default_directory(), addresses_for(config.host))


def check_exposure(config: GatewayConfig) -> None:
    """Refuse to expose the runner endpoint on the LAN without a token unless told to."""
    from gateway.auth import is_loopback

    log = logging.getLogger("gateway")
    if config.runner_token is None and not config.insecure:
        if not is_loopback(config.host):
            raise click.UsageError(
                f"listening on {config.host} with no runner token would let anyone on the "
                "network register a runner. Set --runner-token (or ORCHARD_RUNNER_TOKEN), "
                "or pass --insecure to accept that risk."
            )
        log.info("no runner token set: accepting runners from this machine (loopback) only")
    if config.insecure:
        log.warning(
            "!!! --insecure: ANY machine that can reach %s:%d may register a runner and "
            "receive your users' prompts. Use --runner-token instead. !!!",
            config.host,
            config.port,
        )
    if config.api_keys:
        log.info("client API keys required on /v1/* (%d configured)", len(config.api_keys))


def server(config: GatewayConfig, log_level: str, tls: tuple[Path, Path] | None = None) -> Any:
    from gateway.server import make_server

    return make_server(config, log_level, tls)


def close(served: Any) -> None:
    """What the stopped server's app holds open (the stores' file and its lock)."""
    from gateway.app import close_app

    close_app(served.config.app)


async def run_gateway(
    config: GatewayConfig,
    log_level: str,
    *,
    name: str = "",
    advertise: bool = False,
    tls: tuple[Path, Path] | None = None,
) -> None:
    from gateway.discovery import advertiser_for
    from protocol.frames import PROTOCOL_VERSION

    served = server(config, log_level, tls)
    log_tls(config, tls)
    advertiser = advertiser_for(
        name=name or socket.gethostname(),
        host=config.host,
        port=config.port,
        protocol_version=PROTOCOL_VERSION,
        token_required=config.runner_token is not None,
        enabled=advertise,
        tls=tls is not None,
    )
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def stop() -> None:
        if stopping:  # a second signal: stop now
            served.should_exit = True
            return
        stopping.append(asyncio.create_task(_drain_and_exit(served)))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    if advertiser is not None:
        await advertiser.start()
    try:
        await served.serve()
    finally:
        if advertiser is not None:
            await advertiser.close()
        close(served)


def log_tls(config: GatewayConfig, tls: tuple[Path, Path] | None) -> None:
    if tls is not None:
        from gateway.tls import trust_file

        logging.getLogger("gateway").info(
            "serving HTTPS: certificate %s, its certificate authority %s, SHA-256 fingerprint "
            "%s (what runners pin). Clients trust it with SSL_CERT_FILE=%s (the openai SDK, "
            "httpx, curl --cacert)",
            tls[0],
            trust_file(tls[0]),
            config.tls_fingerprint,
            trust_file(tls[0]),
        )


async def _drain_and_exit(server: Any) -> None:
    """Refuse new requests, let streams finish, send runners away, then stop uvicorn."""
    app = server.config.app
    await app.state.pool.drain(app.state.config.drain_timeout)
    background = getattr(app.state, "background", None)
    if background is not None:
        await background.close()  # runs not done by now end failed, and are stored so
    server.should_exit = True
