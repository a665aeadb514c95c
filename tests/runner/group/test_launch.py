"""Starting a runner group (runner.group.launch), with no second process of a member: the
members' command line, the hostfile, the ring's addresses, the supervisor (on plain child
processes), and what `orchard runner` refuses for a group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import pytest

from runner.group import GroupError, launch
from runner.group.watchdog import EXIT_GROUP_LOST
from tests.support import UNIT

# --- the members' command line ---------------------------------------------------------------


def test_member_argv_repeats_every_option_given_but_the_group_options_and_the_token() -> None:
    @click.command()
    @click.option("--gateway")
    @click.option("--model", "models", multiple=True)
    @click.option("--max-concurrent", type=int, default=8)
    @click.option("--verbose/--quiet", default=False)
    @click.option("--debug", is_flag=True)
    @click.option("--local-group", type=int)
    @click.option("--hostfile")
    @click.option("--token", envvar="SOME_TOKEN")
    def command(**_: Any) -> None: ...

    ctx = command.make_context(
        "runner",
        ["--gateway", "http://gw:8000", "--model", "m", "--local-group", "2", "--token", "s3"],
    )
    assert launch.member_argv(ctx.command.params, ctx.params) == [
        "--gateway", "http://gw:8000", "--model", "m", "--max-concurrent", "8", "--quiet",
    ]  # fmt: skip
    assert launch.member_command(["--x"]) == [
        sys.executable, "-m", "orchard", "runner", "--x", "--group-member",
    ]  # fmt: skip


# --- hostfiles and the ring -----------------------------------------------------------------


def _hostfile(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(data))
    return path


def test_hostfile_in_both_of_mlx_launch_forms(tmp_path: Path) -> None:
    hosts = [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]
    assert launch.read_hostfile(_hostfile(tmp_path, hosts)) == (hosts, "ring")
    jaccl = {"backend": "jaccl", "hosts": [{"ssh": "a"}, {"ssh": "b"}]}
    assert launch.read_hostfile(_hostfile(tmp_path, jaccl)) == (jaccl["hosts"], "jaccl")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([{"ssh": "mac1", "ips": ["10.0.0.1"]}], "at least 2 hosts, it lists 1"),
        ([{"ssh": "a", "ips": ["1.1.1.1"]}, {"ssh": "b"}], "needs each host's IP addresses"),
        ({"backend": "mpi", "hosts": [{"ssh": "a"}, {"ssh": "b"}]}, "backend 'mpi'"),
        ([{"host": "a"}, {"host": "b"}], "expected a list of hosts"),
        ("not json{", "cannot read the hostfile"),
    ],
)
def test_hostfile_that_cannot_start_a_group(tmp_path: Path, data: Any, message: str) -> None:
    path = tmp_path / "hosts.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(GroupError, match=message):
        launch.read_hostfile(path)


def test_local_members_get_mlx_launch_ring_environment(tmp_path: Path) -> None:
    ring = tmp_path / "ring.json"
    members = launch.local_members(["orchard"], 3, ring)
    assert [m.env["MLX_RANK"] for m in members] == ["0", "1", "2"]
    assert {m.env["MLX_HOSTFILE"] for m in members} == {str(ring)}
    addresses = json.loads(ring.read_text())
    first = int(addresses[0][0].rsplit(":", 1)[1])
    assert addresses == [[f"127.0.0.1:{first + r}"] for r in range(3)]
    with pytest.raises(GroupError, match="at least 2"):
        launch.local_members(["orchard"], 1, ring)


def test_hostfile_members_go_through_mlx_launch_with_the_token_as_env(tmp_path: Path) -> None:
    path = _hostfile(tmp_path, [{"ssh": "a", "ips": ["1.1.1.1"]}, {"ssh": "b", "ips": ["2.2.2.2"]}])
    child = launch.launched_members(["orchard", "runner"], path, "s3")
    argv = list(child.argv)
    assert argv[argv.index("--hostfile") + 1] == str(path)
    assert argv[argv.index("--backend") + 1] == "ring"
    assert argv[argv.index("--env") + 1] == "ORCHARD_RUNNER_TOKEN=s3"
    assert argv[argv.index("--") + 1 :] == ["orchard", "runner"]


# --- the supervisor -------------------------------------------------------------------------


def _python(code: str) -> launch.Child:
    return launch.Child((sys.executable, "-c", code))


def test_supervisor_tells_the_other_members_at_once_when_one_fails(tmp_path: Path) -> None:
    # A member that listens as group members do (member.leave_when_told) leaves at once,
    # with its message, not a watchdog timeout later. The other fails once it listens.
    ready = tmp_path / "listening"
    listening = (
        "import pathlib, time; from runner.group.member import leave_when_told;"
        f" leave_when_told(0); pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    )
    failing = (
        "import pathlib, sys, time\n"
        f"while not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.02)\n"
        "sys.exit(3)"
    )
    supervisor = launch.Supervisor(
        [_python(listening), _python(failing)],
        grace=30,
        failure_grace=30,  # never reached: told, it leaves by itself
        launcher=False,
    )
    started = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - started < 20 * UNIT  # importing mlx in the listener, mostly
    assert [p.returncode for p in supervisor._procs] == [EXIT_GROUP_LOST, 3]


def test_supervisor_kills_what_is_left_when_a_member_fails(tmp_path: Path) -> None:
    # Deaf to SIGTERM and to the supervisor's word (as a stopped process is).
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "signal.signal(signal.SIGUSR1, signal.SIG_IGN); time.sleep(60)"
    )
    supervisor = launch.Supervisor(
        [_python(stubborn), _python("import sys; sys.exit(3)")],
        grace=30,  # after SIGTERM: not the case here
        failure_grace=0.5 * UNIT,
        launcher=False,
    )
    started = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - started < 5 * UNIT  # killed, not left to sleep its minute
    assert [p.returncode for p in supervisor._procs] == [-signal.SIGKILL, 3]


def test_supervisor_passes_sigterm_on_and_exits_0_when_all_do(tmp_path: Path) -> None:
    # Each member says when it listens for SIGTERM; the test's SIGTERM comes once both do
    # and the supervisor has taken the signal over (before, it would end pytest).
    ready = [tmp_path / f"member-{i}" for i in range(2)]
    members = [
        _python(
            "import pathlib, signal, sys, time;"
            " signal.signal(signal.SIGTERM, lambda *a: sys.exit(0));"
            f" pathlib.Path({str(path)!r}).touch(); time.sleep(60)"
        )
        for path in ready
    ]
    supervisor = launch.Supervisor(members, grace=10, launcher=False)
    signalled: list[float] = []

    def listening() -> bool:
        handler = signal.getsignal(signal.SIGTERM)
        return handler == supervisor._on_signal and all(path.exists() for path in ready)

    def terminate_when_ready() -> None:
        deadline = time.monotonic() + 30 * UNIT
        while not listening():
            if time.monotonic() > deadline:
                return  # never ready: the members sleep out their minute and the test fails
            time.sleep(0.01)
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    terminator = threading.Thread(target=terminate_when_ready)
    terminator.start()
    try:
        assert supervisor.run() == 0
    finally:
        terminator.join()
    assert signalled
    # Passed on at once: the members were not killed a grace of 10 s later.
    assert time.monotonic() - signalled[0] < 5 * UNIT
    assert [p.returncode for p in supervisor._procs] == [0, 0]


# --- what `orchard runner` refuses for a group ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "a", "--model", "b"], "a runner group serves exactly one model"),
        (["--engine", "mlx"], "a runner group runs the mlx-batched engine, not mlx"),
        (["--max-kv-bytes", "1000000"], "--max-kv-bytes is not supported in a runner group"),
        (["--local-group", "1"], "--local-group needs at least 2 processes, not 1"),
    ],
)
def test_orchard_runner_refuses_what_a_group_cannot_do(
    args: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    from click.testing import CliRunner

    from orchard.cli import main

    group = [] if "--local-group" in args else ["--local-group", "2"]
    result = CliRunner().invoke(main, ["runner", "--gateway", "http://127.0.0.1:9", *group, *args])
    assert result.exit_code == 2
    assert message in caplog.text


def test_orchard_status_says_a_runner_is_a_group() -> None:
    from orchard.status import row

    hardware = {"chip": "Apple M2", "cpu_count": 8, "memory_bytes": 2**34, "backend": "gpu"}
    runner = {
        "name": "grp",
        "models": [{"id": "m"}],
        "hardware": hardware,
        "members": [hardware, hardware],
        "active": 0,
        "max_concurrent": 8,
        "draining": False,
        "tokens_generated": 0,
        "connected_since": 0.0,
    }
    assert row(runner, 1.0)[2] == "Apple M2, 8 cpu, 16.0 GiB, gpu, group of 2"
    assert row({**runner, "members": []}, 1.0)[2] == "Apple M2, 8 cpu, 16.0 GiB, gpu"


def test_a_local_ring_listens_below_the_ephemeral_ports() -> None:
    # Outgoing connections and port-0 listeners (every gateway a test starts) take ephemeral
    # ports; a local ring's ports are never among them.
    linux = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(linux.read_text().split()[0]) if linux.exists() else 49152  # else macOS's
    for _ in range(20):
        first = launch.free_ports(3)
        assert first in launch.RING_PORTS
        assert first + 3 <= min(low, launch.RING_PORTS.stop)
        with contextlib.ExitStack() as stack:  # all three free: bindable now
            for port in range(first, first + 3):
                sock = stack.enter_context(socket.socket())
                sock.bind(("127.0.0.1", port))
