"""A group member for tests/runner/test_group_engine.py: `python -m tests.runner.group_script
MODE OUT`, started twice with the ring environment (`runner.group.launch.local_members`).
Each rank writes what it saw as JSON to OUT.rank<N>.

- exchange: share bytes, a step message and a gather across the ranks, then exit;
- hang: load the group engine on orchard-demo-qwen2 (timeout 1.5 s), rank 0 starts a long
  request and, at its first token, stops rank 1 with SIGSTOP: rank 0's watchdog must end it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx

from protocol.frames import Generate, Hardware, Message, SamplingParams
from runner.demo_model import DEMO_PIPELINE_MODEL_ID
from runner.engine.base import EngineEvent, Output
from runner.group.exchange import Exchange, StepMessage
from runner.group.member import GroupMember

TIMEOUT = 1.5


def exchange(out: dict[str, object]) -> None:
    ex = Exchange(mx.distributed.init(strict=True, backend="ring"))
    out["rank"], out["size"] = ex.rank, ex.size
    out["shared"] = ex.share(b"from rank 0" if ex.rank == 0 else None).decode()
    out["empty"] = ex.share(None).decode()
    big = bytes(range(256)) * 35  # 8960 bytes: 3 chunks of 4096 with the length
    out["big"] = ex.share(big if ex.rank == 0 else None) == big
    message = StepMessage(
        (Generate("r1", "m", (Message("user", "hi"),), max_tokens=3),), ("r0",), False
    )
    got = ex.share_step(message if ex.rank == 0 else None)
    out["step"] = [got.submits[0].request_id, list(got.cancels), got.close]
    out["gathered"] = [
        b.decode() for b in ex.gather(f"rank {ex.rank} says hi".encode() * (ex.rank + 1))
    ]
    out["collectives"] = ex.collectives


def hang(path: Path, out: dict[str, object]) -> None:
    member = GroupMember(
        DEMO_PIPELINE_MODEL_ID,
        Hardware("test", 1, 1, "cpu", "test"),
        split="auto",
        timeout=TIMEOUT,
        max_concurrent=2,
    )
    pids = [int(p) for p in member.exchange.gather(str(os.getpid()).encode())]
    out["rank"] = member.rank
    if member.rank > 0:
        path.write_text(json.dumps(out))
        member.follow()
        return

    def sink(event: EngineEvent) -> None:
        if isinstance(event, Output) and "stopped_at" not in out:
            os.kill(pids[1], signal.SIGSTOP)
            out["stopped_at"] = time.monotonic()
            path.write_text(json.dumps(out))

    member.engine.start(sink)
    request = Generate(
        "long", DEMO_PIPELINE_MODEL_ID, (Message("user", "Go on."),), max_tokens=1500,
        sampling=SamplingParams(temperature=0.0),
    )  # fmt: skip
    member.engine.submit(request)
    time.sleep(30)  # the watchdog ends this process long before
    out["still_alive"] = True
    path.write_text(json.dumps(out))


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    mode, base = sys.argv[1], sys.argv[2]
    path = Path(f"{base}.rank{os.environ['MLX_RANK']}")
    out: dict[str, object] = {}
    if mode == "exchange":
        exchange(out)
        path.write_text(json.dumps(out))
    else:
        hang(path, out)


if __name__ == "__main__":
    main()
