"""`just soak --chaos` for 45 seconds: every fault and client behaviour at least once, no
violation, and at least 95% of the started streams complete and exact.

Real processes (a gateway, four scripted runners and the firehose runner) on real sockets;
the gateway's liveness timeout, and with it the freeze, in the tests' time unit.
"""

from __future__ import annotations

import sys

from bench import chaos
from bench.chaos_dialects import COMPLETE, DIALECTS, DISCONNECT, SLOW
from bench.chaos_fleet import GATEWAY, RUNNER_FAULTS
from tests.support import UNIT

SECONDS = 45


async def test_chaos_soak_45_seconds() -> None:
    args = chaos.parser().parse_args(
        [
            f"--minutes={SECONDS / 60}",
            "--seed=24",
            "--concurrency=12",
            "--fault-every=3",
            "--gateway-restarts=2",  # one drained, one killed
            f"--liveness-timeout={2.5 * UNIT:g}",
            "--sample-every=1",
        ]
    )
    report = await chaos.soak(args)
    sys.stderr.write(f"{report.text}\n")  # the figures, shown with -s
    figures = f"\n{report.text}"
    assert report.violation_count == 0, figures
    assert report.ratio >= chaos.REQUIRED_RATIO, figures
    assert all(report.faults[kind] >= 1 for kind in (*RUNNER_FAULTS, GATEWAY)), figures
    assert report.behaviours[DISCONNECT] >= 1, figures
    assert report.behaviours[SLOW] >= 1, figures
    assert report.merged >= 1, figures
    assert all(report.outcomes[COMPLETE, dialect] >= 1 for dialect in DIALECTS), figures
    assert report.runners_back, figures
    assert report.left == [], figures
