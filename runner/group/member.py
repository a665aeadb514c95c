"""One member of a runner group: a process `mlx.launch` started with `--group-member`.

Every member joins the group (`mx.distributed.init`), shares its hardware with the others and
loads its part of the model (`group_engine`, in lock step: `GroupLockStep`). Then rank 0
serves the gateway as an ordinary runner whose hello lists every member (`GroupRunner`), and
the other ranks follow rank 0's steps until it closes the group; they ignore SIGTERM and
SIGINT, which are rank 0's to act on (it drains, then closes the group).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import orjson

from protocol.codec import converter
from protocol.frames import Hardware, Hello
from runner.client import Runner
from runner.errors import ModelLoadError
from runner.group import GroupError
from runner.group import split as splitting
from runner.group.engine import GroupLockStep, group_engine
from runner.group.exchange import Exchange
from runner.group.watchdog import LEAVE_SIGNAL, Watchdog, leave

log = logging.getLogger("runner.group")


def join_group() -> tuple[Any, str]:
    """This process's group and its backend; `GroupError` if it was not started as a member."""
    if "MLX_RANK" not in os.environ:
        raise GroupError(
            "--group-member is for the processes mlx.launch starts; use --hostfile or --local-group"
        )
    backend = "jaccl" if os.environ.get("MLX_JACCL_COORDINATOR") else "ring"
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise GroupError(f"could not join the group over {backend}: {exc}") from exc
    return group, backend


class GroupMember:
    """This process's place in the group: its rank, the members' hardware, the engine."""

    def __init__(
        self,
        model: str,
        hardware: Hardware,
        *,
        split: splitting.Split,
        timeout: float,
        max_concurrent: int,
    ) -> None:
        group, backend = join_group()
        self.exchange = Exchange(group)
        self.rank = self.exchange.rank
        self.size = self.exchange.size
        _tag_logs(self.rank, self.size)
        gathered = self.exchange.gather(_encode(hardware))
        self.members = tuple(_decode(data) for data in gathered)
        self.watchdog = Watchdog(timeout, rank=self.rank)
        leave_when_told(self.rank)
        self.lock_step = GroupLockStep(
            self.exchange, self.watchdog, split=split, backend=backend, heartbeat=timeout / 4
        )
        self.engine = group_engine(model, self.lock_step, max_concurrent=max_concurrent)

    def follow(self) -> int:
        """Ranks 1..N-1: load, then run rank 0's steps until it closes the group."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            self.engine.start(lambda event: None)
        except ModelLoadError as exc:
            log.error("rank %d: could not load %s: %s", self.rank, self.engine.model_name, exc)
            return 2
        self.engine.wait()
        return 0

    def runner_class(self) -> Callable[..., Runner]:
        """Rank 0's `Runner`, whose hello lists the members."""
        return partial(GroupRunner, members=self.members)


def leave_when_told(rank: int) -> None:
    """Leave at once when the group's supervisor says a member failed (`LEAVE_SIGNAL`)."""

    def told(signum: int, frame: object) -> None:
        leave("rank %d: the group's supervisor saw another member fail", rank)

    signal.signal(LEAVE_SIGNAL, told)


class GroupRunner(Runner):
    """A `Runner` whose hello lists every member's hardware (rank 0's first)."""

    def __init__(self, *args: Any, members: tuple[Hardware, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.members = members

    def hello(self) -> Hello:
        return attrs.evolve(super().hello(), members=self.members)


def _encode(hardware: Hardware) -> bytes:
    return orjson.dumps(converter.unstructure(hardware))


def _decode(data: bytes) -> Hardware:
    hardware: Hardware = converter.structure(orjson.loads(data), Hardware)
    return hardware


def _tag_logs(rank: int, size: int) -> None:
    """Every log line of this process says which member wrote it."""
    formatter = logging.Formatter(
        f"%(asctime)s %(levelname)-7s [rank {rank}/{size}] %(name)s: %(message)s", "%H:%M:%S"
    )
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
