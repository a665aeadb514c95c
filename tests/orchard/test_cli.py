"""The `orchard` command: its gateway options take their defaults from GatewayConfig, so a
gateway started with no flags runs exactly the documented defaults."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from gateway.config import GatewayConfig, default_store_path
from orchard import cli, gateway_start, serve
from tests.fakehub import FakeHub, runner_against
from tests.support import orchard_command


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[GatewayConfig]:
    """The configs `orchard gateway` / `orchard serve` would start, instead of starting."""
    configs: list[GatewayConfig] = []

    async def run_gateway(config: GatewayConfig, *_: Any, **__: Any) -> None:
        configs.append(config)

    monkeypatch.setattr(gateway_start, "run_gateway", run_gateway)
    monkeypatch.setattr(serve, "supervise", run_gateway)
    monkeypatch.delenv("ORCHARD_RUNNER_TOKEN", raising=False)
    monkeypatch.delenv("ORCHARD_API_KEYS", raising=False)
    return configs


def test_gateway_without_flags_runs_the_config_defaults(started: list[GatewayConfig]) -> None:
    result = CliRunner().invoke(cli.main, ["gateway"])
    assert result.exit_code == 0, result.output
    # But for the stores' file: GatewayConfig's default is memory (for embedders and tests).
    assert started == [GatewayConfig(store_path=default_store_path())]


def test_the_gateway_is_announced_by_name_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    announced: list[dict[str, Any]] = []

    async def run_gateway(config: GatewayConfig, log_level: str, **options: Any) -> None:
        announced.append(options)

    monkeypatch.setattr(gateway_start, "run_gateway", run_gateway)
    monkeypatch.setenv("ORCHARD_RUNNER_TOKEN", "t")
    for args in ([], ["--name", "studio"], ["--no-advertise"]):
        result = CliRunner().invoke(cli.main, ["gateway", *args])
        assert result.exit_code == 0, result.output
    assert announced == [
        {"name": socket.gethostname(), "advertise": True, "tls": None},
        {"name": "studio", "advertise": True, "tls": None},
        {"name": socket.gethostname(), "advertise": False, "tls": None},
    ]


def test_every_gateway_flag_sets_its_config_field(started: list[GatewayConfig]) -> None:
    flags = {
        "--queue-size": ("queue_size", 3),
        "--queue-timeout": ("queue_timeout", 1.5),
        "--liveness-timeout": ("liveness_timeout", 4.0),
        "--model-grace": ("model_grace", 2.0),
        "--start-grace": ("start_grace", 4.0),
        "--stream-timeout": ("stream_timeout", 9.0),
        "--drain-timeout": ("drain_timeout", 8.0),
        "--first-token-wait": ("first_token_wait", 0.5),
        "--keepalive-interval": ("keepalive_interval", 7.0),
        "--header-timeout": ("header_timeout", 6.0),
        "--handshake-timeout": ("handshake_timeout", 5.0),
        "--max-body-bytes": ("max_body_bytes", 1000),
        "--max-tokens-limit": ("max_tokens_limit", 99),
        "--max-client-sockets": ("max_client_sockets", 12),
        "--port": ("port", 9123),
        "--store": ("store_path", Path("/nowhere/store.sqlite3")),
    }
    args = [part for flag, (_, value) in flags.items() for part in (flag, str(value))]
    result = CliRunner().invoke(cli.main, ["gateway", *args])
    assert result.exit_code == 0, result.output
    [config] = started
    fields: dict[str, Any] = dict(flags.values())
    expected = attrs.evolve(GatewayConfig(), **fields)
    assert config == expected


def test_help_shows_the_config_defaults() -> None:
    result = CliRunner().invoke(cli.main, ["gateway", "--help"], terminal_width=200)
    assert result.exit_code == 0
    defaults = GatewayConfig()
    assert f"[default: {defaults.stream_timeout}]" in result.output
    assert f"[default: {defaults.max_tokens_limit}]" in result.output


def test_serve_listens_where_the_config_says(started: list[GatewayConfig]) -> None:
    result = CliRunner().invoke(cli.main, ["serve"])
    assert result.exit_code == 0, result.output
    [config] = started
    assert (config.host, config.port) == (GatewayConfig().host, GatewayConfig().port)
    assert config.runner_token  # serve always makes one for its local runner


def test_a_model_that_does_not_load_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = orchard_command(
        *("runner", "--gateway", "http://127.0.0.1:9"),
        *("--model", str(missing), "--log-level", "warning"),
    )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.endswith(
        f"runner: could not load {missing}: {missing} is neither a directory here nor a "
        "Hugging Face model id (organization/model): check the path or the name."
    ), line
    assert "Traceback" not in proc.stderr


def test_a_hub_model_that_is_not_there_is_one_clear_line(tmp_path: Path) -> None:
    # The runner downloads a Hub id itself (runner.download), from a local fake Hub here.
    with FakeHub() as hub:
        proc = runner_against(hub, tmp_path, "--model", "orchard-test/nope")
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.endswith(
        f"runner: could not load orchard-test/nope: orchard-test/nope was not found on "
        f"{hub.url}: check the name (organization/model). If it is private or gated, set "
        "HF_TOKEN to an access token that can read it (and accept its license on the "
        "model's page)."
    ), line


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ("--max-memory", "12 parsecs"),
            "Invalid value for --max-memory: '12 parsecs': unknown unit 'parsecs' "
            "(B, KB, MB, GB, TB, KiB ... TiB)",
        ),
        (
            ("--max-memory", "150%"),
            "Invalid value for --max-memory: '150%': a share is more than 0% and at most 100%",
        ),
        (("--model", "a"), "Invalid value for --model: a model is named twice"),
    ],
)
def test_bad_model_flags_are_usage_errors(flags: tuple[str, ...], error: str) -> None:
    result = CliRunner().invoke(
        cli.main,
        ["runner", "--gateway", "http://127.0.0.1:9", "--model", "a", "--model", "b", *flags],
    )
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == f"Error: {error}"


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_the_store_flags_set_their_config_fields(
    started: list[GatewayConfig], command: str
) -> None:
    result = CliRunner().invoke(
        cli.main,
        [
            command,
            *("--store-max-completions", "5"),
            *("--store-max-bytes", "4096"),
            *("--store-ttl", "2.5"),
        ],
    )
    assert result.exit_code == 0, result.output
    [config] = started
    assert (config.store_max_completions, config.store_max_bytes, config.store_ttl) == (
        5,
        4096,
        2.5,
    )
