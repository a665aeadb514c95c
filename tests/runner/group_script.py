"""A group member for tests/runner/group/test_engine.py: `python -m tests.runner.group_script
MODE OUT`, started twice with the ring environment (`runner.group.launch.local_members`).
Each rank writes what it saw as JSON to OUT.rank<N>.

- exchange: share bytes, a step message and a gather across the ranks, then exit;
- hang: load the group engine on orchard-demo-qwen2 (timeout 1.5 s in the time unit), rank 0
  starts a long request and, at its first token, stops rank 1 with SIGSTOP: rank 0's watchdog
  must end it;
- tensor: the group engine on the model directory in $GROUP_TENSOR_MODEL split by tensor;
  rank 0 answers `PROMPTS` greedily one at a time and writes each one's tokens and logprobs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from protocol.frames import Generate, Hardware, Message, SamplingParams
from runner.demo_model import DEMO_PIPELINE_MODEL_ID
from runner.engine.base import EngineEvent, Output
from runner.group.exchange import Exchange, StepMessage
from runner.group.member import GroupMember
from tests.support import UNIT

TIMEOUT = 1.5 * UNIT
"""The group timeout of the hang mode's members (their watchdogs')."""
PROMPTS = ("Tell me about pears.", "Hello", "Why do orchards need bees?")
TOKENS = 16


def answer(engine: Any, model: str) -> list[list[tuple[str, float]]]:
    """Each of `PROMPTS`, greedy, one at a time: its (token, logprob)s."""
    answers = []
    for i, prompt in enumerate(PROMPTS):
        done = threading.Event()
        got: list[tuple[str, float]] = []

        def sink(
            event: EngineEvent, got: list[tuple[str, float]] = got, done: threading.Event = done
        ) -> None:
            if isinstance(event, Output):
                got.extend((lp.token, lp.logprob) for lp in event.logprobs)
                if event.finish_reason is not None:
                    done.set()

        engine.sink = sink
        engine.submit(
            Generate(
                f"r{i}", model, (Message("user", prompt),), max_tokens=TOKENS,
                sampling=SamplingParams(temperature=0.0), logprobs=True,
            )
        )  # fmt: skip
        assert done.wait(60 * UNIT)
        answers.append(got)
    return answers


class Relay:
    """An engine sink that forwards to whatever `sink` is now (one per request above)."""

    def __init__(self) -> None:
        self.sink: Any = None

    def __call__(self, event: EngineEvent) -> None:
        if self.sink is not None:
            self.sink(event)


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


def tensor(out: dict[str, object]) -> None:
    model = os.environ["GROUP_TENSOR_MODEL"]
    member = GroupMember(
        model, Hardware("test", 1, 1, "cpu", "test"), split="tensor", timeout=30, max_concurrent=2
    )
    if member.rank > 0:
        member.follow()
        return
    relay = Relay()
    member.engine.start(relay)
    out["split"] = member.lock_step.split
    out["answers"] = answer(Submitter(member.engine, relay), model)
    member.engine.close()


class Submitter:
    """`answer`'s view of an engine whose sink is a `Relay`."""

    def __init__(self, engine: Any, relay: Relay) -> None:
        self._engine = engine
        self._relay = relay

    @property
    def sink(self) -> Any:
        return self._relay.sink

    @sink.setter
    def sink(self, value: Any) -> None:
        self._relay.sink = value

    def submit(self, request: Generate) -> None:
        self._engine.submit(request)


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    mode, base = sys.argv[1], sys.argv[2]
    path = Path(f"{base}.rank{os.environ['MLX_RANK']}")
    out: dict[str, object] = {}
    if mode == "exchange":
        exchange(out)
        path.write_text(json.dumps(out))
    elif mode == "tensor":
        tensor(out)
        path.write_text(json.dumps(out))
    else:
        hang(path, out)


if __name__ == "__main__":
    main()
