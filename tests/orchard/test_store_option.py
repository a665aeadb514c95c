"""`--store` on `orchard gateway` and `orchard serve`: the state directory's file by default,
`memory` or a path, and a file that cannot be used is one line and exit status 2 (what a
service manager is told not to retry), before `serve` starts its runner."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gateway.config import GatewayConfig
from gateway.stores.sqlite import Database
from orchard import cli, gateway_start, serve
from tests.support import free_port, orchard_command

COMMANDS = ["gateway", "serve"]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[GatewayConfig]:
    configs: list[GatewayConfig] = []

    async def run_gateway(config: GatewayConfig, *_: Any, **__: Any) -> None:
        configs.append(config)

    monkeypatch.setattr(gateway_start, "run_gateway", run_gateway)
    monkeypatch.setattr(serve, "supervise", run_gateway)
    monkeypatch.delenv("ORCHARD_RUNNER_TOKEN", raising=False)
    return configs


@pytest.mark.parametrize("command", COMMANDS)
def test_the_default_is_the_state_directory_s_file(
    started: list[GatewayConfig], command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCHARD_STATE_DIR", str(tmp_path))
    assert CliRunner().invoke(cli.main, [command]).exit_code == 0
    monkeypatch.delenv("ORCHARD_STATE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert CliRunner().invoke(cli.main, [command]).exit_code == 0
    assert [config.store_path for config in started] == [
        tmp_path / "store.sqlite3",
        tmp_path / "home" / ".orchard" / "state" / "store.sqlite3",
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_memory_or_a_path(started: list[GatewayConfig], command: str) -> None:
    for value in ("memory", "~/kept.sqlite3", "/srv/orchard.db"):
        result = CliRunner().invoke(cli.main, [command, "--store", value])
        assert result.exit_code == 0, result.output
    assert [config.store_path for config in started] == [
        None,
        Path.home() / "kept.sqlite3",
        Path("/srv/orchard.db"),
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_default(command: str) -> None:
    result = CliRunner().invoke(cli.main, [command, "--help"], terminal_width=200)
    assert "--store PATH|memory" in result.output
    assert "$ORCHARD_STATE_DIR/store.sqlite3, else ~/.orchard/state/store.sqlite3" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_a_store_in_use_is_one_line_and_status_2(command: str, tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    held = Database.open(path)  # the other gateway
    try:
        proc = orchard_command(
            *(command, "--port", str(free_port())),
            *("--store", str(path), "--log-level", "warning"),
            timeout=60,
        )
    finally:
        held.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"Error: the store {path} is in use by another gateway (pid {os.getpid()}; its lock is "
        f"{path}.lock). Start with --store memory (nothing kept across restarts) or --store "
        "ANOTHER_PATH."
    )
    assert "Traceback" not in proc.stderr
    assert "orchard-demo" not in proc.stdout  # serve never got to its runner nor its banner


def test_a_file_that_is_not_sqlite_is_one_line_and_status_2(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    path.write_bytes(os.urandom(4096))
    result = CliRunner().invoke(cli.main, ["serve", "--port", "1", "--store", str(path)])
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        f"Error: the store {path} is not a SQLite database (another kind of file, or damaged). "
        "Start with --store memory (nothing kept across restarts) or --store ANOTHER_PATH."
    )
