"""Options more than one `orchard` command takes: the log level, TLS, the stores (their file
and bounds), and gateway settings whose defaults are GatewayConfig's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import click

from gateway.config import GatewayConfig, default_store_path

F = TypeVar("F", bound=Callable[..., Any])

log_level_option = click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)


def tls_options(command: F) -> F:
    """--tls/--no-tls, --tls-cert and --tls-key (gateway and serve)."""
    options = [
        click.option(
            "--tls/--no-tls",
            default=None,
            help="Serve HTTPS / WSS. Default: on when listening off loopback. Unless "
            "--tls-cert and --tls-key give a certificate, a local certificate authority made "
            "on first start and kept in $ORCHARD_TLS_DIR (~/.orchard/tls, ca.pem) issues one "
            "for the current addresses at each start where they changed; clients trust "
            "ca.pem, runners pin it once the gateway proves it knows the runner token "
            "(docs/security.md).",
        ),
        click.option(
            "--tls-cert",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Certificate (PEM) to serve instead of a generated one.",
        ),
        click.option(
            "--tls-key",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="The private key (PEM) of --tls-cert.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def config_option(name: str, help: str) -> Callable[[F], F]:
    """A `gateway` option whose default is GatewayConfig's, so each default is written once."""
    field = attrs.fields_dict(GatewayConfig)[name]
    flag = "--" + name.replace("_", "-")
    return click.option(flag, default=field.default, show_default=True, help=help)


MEMORY = "memory"
"""`--store memory`: nothing written, nothing kept across restarts."""


def _store_path(ctx: click.Context, param: click.Parameter, value: str) -> Path | None:
    return None if value == MEMORY else Path(value).expanduser()


def store_options(command: F) -> F:
    """The stores' file and bounds (`store: true`, stored responses), on `gateway` and `serve`
    alike."""
    options = (
        click.option(
            "--store",
            "store_path",
            metavar="PATH|memory",
            default=lambda: str(default_store_path()),
            show_default="$ORCHARD_STATE_DIR/store.sqlite3, else ~/.orchard/state/store.sqlite3",
            callback=_store_path,
            help="The SQLite file (WAL mode) stored chat completions and responses are "
            "written to, so that they outlive a restart; one gateway at a time (a lock file "
            "beside it). memory: kept in memory only, lost when the gateway stops.",
        ),
        config_option(
            "store_max_completions",
            "Stored chat completions kept, and as many stored responses; past it the oldest "
            "goes (0: store nothing, refuse store: true).",
        ),
        config_option("store_max_bytes", "Their total size as JSON; past it the oldest go."),
        config_option("store_ttl", "Seconds a stored chat completion is kept."),
    )
    for option in reversed(options):
        command = option(command)
    return command
