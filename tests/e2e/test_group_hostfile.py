"""`orchard runner --hostfile` through MLX's own launcher: a hostfile of two hosts that are
this machine (`mlx.launch` runs a host named 127.0.0.1 without ssh), ring over loopback. The
group registers as one runner of two members; SIGTERM drains it, rank 0 closes the group,
and every process exits 0 with none left behind."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import pytest

from runner.demo_model import DEMO_PIPELINE_MODEL_ID
from tests.support import UNIT, Gateway, secs, start_runner, wait_until

pytestmark = pytest.mark.timeout(int(120 * UNIT))


def test_hostfile_group_starts_through_mlx_launch_and_stops_cleanly(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    local = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
    hostfile.write_text(json.dumps([local, local]))
    gateway = Gateway("--liveness-timeout", secs(2.5))  # its default, in the time unit
    group = start_runner(
        gateway,
        *("--model", DEMO_PIPELINE_MODEL_ID, "--hostfile", str(hostfile), "--log-level", "info"),
        *("--max-concurrent", "1"),  # the shortest warm-up
        # The default, in the time unit: the members' watchdogs and the supervisor's grace.
        *("--liveness-timeout", secs(3)),
        name="hosts",
    )
    try:
        wait_until(lambda: len(gateway.runners()) == 1 or not group.alive(), 90, "the group")
        assert group.alive(), group.stop()
        (info,) = gateway.runners()
        assert info["name"] == "hosts"
        assert len(info["members"]) == 2
        # The supervisor runs mlx.launch, which runs the two members.
        (launcher,) = psutil.Process(group.proc.pid).children()
        assert "mlx.launch" in " ".join(launcher.cmdline())
        members = launcher.children()
        assert sorted(m.environ()["MLX_RANK"] for m in members) == ["0", "1"]

        group.proc.send_signal(signal.SIGTERM)
        assert group.proc.wait(20 * UNIT) == 0, group.stop()
        wait_until(lambda: gateway.runners() == [], 5, "the group to leave the pool")
        gone, alive = psutil.wait_procs([launcher, *members], timeout=5 * UNIT)
        assert alive == []
        assert {p.returncode for p in gone} <= {0, None}  # None: not our child to reap
        assert "rank 0 closed the group" in group.stop()
    finally:
        group.stop()
        gateway.stop()
