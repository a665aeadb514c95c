"""A runner group's exchange and watchdog across two real processes on MLX's ring backend
over loopback (started as `--local-group` starts them): rank 0's bytes reach every rank, a
gather collects every rank's, and a member that hangs mid-request ends rank 0 within the
group timeout, with a message, and the supervisor leaves no process behind."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner.group import launch
from runner.group.watchdog import EXIT_GROUP_LOST
from tests.runner import group_script
from tests.support import REPO, UNIT

pytestmark = pytest.mark.timeout(int(120 * UNIT))


def _run(mode: str, tmp_path: Path, grace: float) -> tuple[launch.Supervisor, list[dict[str, Any]]]:
    base = tmp_path / "out"
    command = [sys.executable, "-m", "tests.runner.group_script", mode, str(base)]
    members = launch.local_members(command, 2, tmp_path / "ring.json")
    members = [launch.Child(m.argv, {**m.env, "PYTHONPATH": str(REPO)}) for m in members]
    supervisor = launch.Supervisor(members, grace=grace, launcher=False)
    supervisor.run()
    outs = []
    for rank in range(2):
        path = Path(f"{base}.rank{rank}")
        outs.append(json.loads(path.read_text()) if path.exists() else {})
    return supervisor, outs


def test_share_step_and_gather_reach_every_rank(tmp_path: Path) -> None:
    supervisor, outs = _run("exchange", tmp_path, grace=30)
    assert [p.returncode for p in supervisor._procs] == [0, 0]
    for rank, out in enumerate(outs):
        assert out == {
            "rank": rank,
            "size": 2,
            "shared": "from rank 0",
            "empty": "",
            "big": True,
            "step": ["r1", ["r0"], False],
            "gathered": ["rank 0 says hi", "rank 1 says hirank 1 says hi"],
            # share, empty share, step: 1 chunk each; big: 3; gather: 2 (lengths, table)
            "collectives": 8,
        }


def test_a_hung_member_ends_rank_0_within_the_timeout_and_nothing_is_left(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    supervisor, outs = _run("hang", tmp_path, grace=1.0)
    leader, follower = supervisor._procs
    assert leader.returncode == EXIT_GROUP_LOST
    assert follower.returncode == -signal.SIGKILL  # stopped: only SIGKILL ends it
    assert "still_alive" not in outs[0]
    stopped_at = outs[0]["stopped_at"]
    assert supervisor._failed_at is not None
    # The watchdog's timeout, plus its check interval and the supervisor's poll.
    assert supervisor._failed_at - stopped_at < group_script.TIMEOUT + 1.0 * UNIT
    assert time.monotonic() - started < 60 * UNIT
    err = capfd.readouterr().err
    assert "leaving the runner group: rank 0: one step has waited" in err, err
