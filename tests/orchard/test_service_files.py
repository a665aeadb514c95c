"""docs/operations.md's launchd plist and systemd unit for a runner, parsed as launchd and
systemd would read them: the keys a drained, restarted runner needs, and arguments that
`orchard runner` accepts, with a stop timeout longer than the runner's drain."""

from __future__ import annotations

import configparser
import plistlib
import re
import shlex
from typing import Any

import click
import pytest

from orchard import cli
from tests.support import REPO

DOC = (REPO / "docs" / "operations.md").read_text()
SECTION = DOC[DOC.index("## Running a runner as a service") :]
SECTION = SECTION[: SECTION.index("\n## ", 1)]


def fenced(lang: str, marker: str) -> str:
    """The one fenced block of `lang` in the service section that contains `marker`."""
    blocks = re.findall(rf"^```{lang}\n(.*?)^```$", SECTION, flags=re.MULTILINE | re.DOTALL)
    [block] = [b for b in blocks if marker in b]
    return str(block)


def runner_params(args: list[str]) -> dict[str, Any]:
    """`orchard ARGS...` checked as the runner command would parse them: every option one it
    has, every value one it takes. Returns the parsed parameters, defaults included."""
    assert args[0].endswith("/orchard"), args
    assert args[1] == "runner", args
    command = cli.runner
    assert isinstance(command, click.Command)
    known = {opt for param in command.params for opt in param.opts}
    options = [a.split("=", 1)[0] for a in args[2:] if a.startswith("-")]
    assert options, args
    assert set(options) <= known, set(options) - known
    assert "--token" not in options  # `ps` shows arguments; the token goes in the environment
    ctx = command.make_context("runner", args[2:], resilient_parsing=False)
    assert ctx.params["gateway_url"].startswith("http")
    return ctx.params


def seconds(value: str) -> float:
    """A systemd time span as this page writes it: 45, 45s or 1min."""
    match = re.fullmatch(r"(\d+)\s*(s|sec|min)?", value.strip())
    assert match, value
    return int(match[1]) * (60 if match[2] == "min" else 1)


def unit_name() -> str:
    match = re.search(r"/etc/systemd/system/([\w-]+\.service)", SECTION)
    assert match
    return match[1]


def test_the_launchd_plist() -> None:
    plist = plistlib.loads(fenced("xml", "<plist").encode())
    assert {
        "Label",
        "ProgramArguments",
        "EnvironmentVariables",
        "RunAtLoad",
        "KeepAlive",
        "ExitTimeOut",
        "StandardOutPath",
        "StandardErrorPath",
    } <= plist.keys()
    label = plist["Label"]
    assert f"~/Library/LaunchAgents/{label}.plist" in SECTION
    assert f"gui/$(id -u)/{label}" in SECTION  # the commands name the same job
    params = runner_params(plist["ProgramArguments"])
    assert plist["ExitTimeOut"] > params["drain_timeout"]
    assert plist["EnvironmentVariables"]["ORCHARD_RUNNER_TOKEN"]
    assert plist["RunAtLoad"] is True
    # Restarted when it fails, not after a drain (exit 0).
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key].startswith("/"), "launchd does not expand ~"


def test_the_systemd_unit() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    unit.read_string(fenced("ini", "[Service]"))
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    params = runner_params(shlex.split(service["ExecStart"]))
    assert seconds(service["TimeoutStopSec"]) > params["drain_timeout"]
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "2"  # a refused token is not retried
    env_file = service["EnvironmentFile"]
    # The page says how to write that file, and what goes in it.
    assert env_file in SECTION.replace(f"EnvironmentFile={env_file}", "")
    assert re.search(r"^```\nORCHARD_RUNNER_TOKEN=\S+\n```$", SECTION, flags=re.MULTILINE)
    assert "network-online.target" in unit["Unit"]["After"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert f"/etc/systemd/system/{unit_name()}" in SECTION
    assert f"systemctl enable --now {unit_name().removesuffix('.service')}" in SECTION


@pytest.mark.parametrize(
    "bad",
    [
        ["/x/orchard", "runner", "--gateway", "http://h:1", "--no-such-flag"],
        ["/x/orchard", "runner", "--gateway", "http://h:1", "--drain-timeout", "soon"],
    ],
)
def test_the_check_catches_a_wrong_option(bad: list[str]) -> None:
    with pytest.raises((AssertionError, click.UsageError)):
        runner_params(bad)
