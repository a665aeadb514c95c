"""Runner groups: one model split across several Macs on MLX's own distributed engine.

A group is N runner processes started by MLX's launcher (`mlx.launch`: the ring backend over
TCP, or JACCL over Thunderbolt), one per Mac. They load one model split with mlx-lm's
`sharded_load` (pipeline stages or tensor shards) and decode in lock step: every rank runs
every step of the same batched engine, and rank 0, the only one connected to the gateway,
shares each step's admissions, cancellations and closing with the others first.

    launch.py     `--hostfile` (mlx.launch) / `--local-group N` (N processes here) and the
                  supervisor that leaves no process behind
    split.py      pipeline or tensor: what the model allows, and `sharded_load`
    exchange.py   the per-step message and the collectives that carry it
    watchdog.py   a member that hears nothing for the timeout ends its process
    engine.py     `GroupLockStep`: the batched engine, in lock step on every rank
    member.py     one member process: rank 0 serves the gateway, the others follow

Errors (under `runner.errors.RunnerError`):

    GroupError            a runner group cannot start as asked (flags, hostfile, model)
"""

from __future__ import annotations

from runner.errors import RunnerError


class GroupError(RunnerError):
    """A runner group cannot start as asked; the message says what to change."""
