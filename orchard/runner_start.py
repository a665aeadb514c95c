"""Starting a runner (`orchard runner`): finding the gateway, making the engine (with
runner.startup), and serving until stopped; a refusal or a model that cannot load is one log
line and exit status 2."""

# The runner's client, discovery and engines load websockets, zeroconf and MLX: each is
# imported where it is used, so that `orchard --help` starts fast.
# ruff: noqa: PLC0415

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runner import startup
from runner.client import GATHER_S

if TYPE_CHECKING:
    from collections.abc import Mapping

    from runner.engine.base import Engine
    from runner.group.member import GroupMember
    from runner.model_options import ModelOptions


async def run_runner(  # noqa: PLR0917  # the runner command's options, in its order
    gateway_url: str | None,
    models: tuple[str, ...],
    name: str,
    max_concurrent: int,
    engine_kind: str,
    tokens_per_second: float,
    drain_timeout: float,
    liveness_timeout: float,
    token: str | None,
    max_kv_bytes: int | None,
    step: float = 0.001,
    gather: float = GATHER_S,
    max_memory: str | None = None,
    group: GroupMember | None = None,
    kv_disk: tuple[Path, int] | None = None,
    options: Mapping[str, ModelOptions] | None = None,
) -> None:
    from runner.client import Runner
    from runner.discovery import find_gateway
    from runner.errors import AmbiguousGateway, ModelLoadError, Unauthorized, UntrustedGateway
    from runner.hardware import detect, mlx_backend

    wanted = None if gateway_url is None or _is_url(gateway_url) else gateway_url
    rediscover = None
    if gateway_url is None or wanted is not None:

        async def rediscover() -> str:
            return (await find_gateway(wanted)).url()

        try:
            gateway_url = await rediscover()
        except AmbiguousGateway as exc:
            logging.getLogger("runner").error("%s", exc)
            sys.exit(2)

    eng: Engine
    if engine_kind == "scripted":
        from runner.engine.scripted import ScriptedEngine

        startup.refuse_for_scripted(options or {})
        eng = ScriptedEngine(
            models=models,
            tokens_per_second=tokens_per_second,
            max_concurrent=max_concurrent,
            min_step=step,
        )
        backend = "none"
    else:
        backend = mlx_backend()
    hardware = detect(backend)
    store = None
    if engine_kind != "scripted":
        from runner.engine.kv_store import KvStore

        if kv_disk is not None and kv_disk[1] > 0:
            store = KvStore(*kv_disk)
        make = startup.mlx_engines(
            engine_kind, max_concurrent, max_kv_bytes, hardware, store, options=options or {}
        )
        eng = (
            make(models[0])
            if len(models) == 1
            else startup.shelf(models, make, max_memory, hardware)
        )
    if group is not None:
        eng = group.engine
    run = (Runner if group is None else group.runner_class())(
        gateway_url,
        eng,
        name=name,
        max_concurrent=max_concurrent,
        hardware=hardware,
        drain_timeout=drain_timeout,
        liveness_timeout=liveness_timeout,
        token=token or None,
        gather=gather,
        rediscover=rediscover,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, run.stop)
    try:
        await run.run()
    except Unauthorized as exc:
        logging.getLogger("runner").error(
            "the gateway refused this runner: %s. Check --token / ORCHARD_RUNNER_TOKEN.", exc
        )
        sys.exit(2)
    except ModelLoadError as exc:
        logging.getLogger("runner").error("could not load %s: %s", models[0], exc)
        sys.exit(2)
    except (AmbiguousGateway, UntrustedGateway) as exc:
        logging.getLogger("runner").error("%s", exc)
        sys.exit(2)
    finally:
        if store is not None:
            await asyncio.to_thread(store.close)  # the writes queued still reach the disk


def _is_url(gateway: str) -> bool:
    """A URL or host:port, not a gateway's name on the LAN."""
    return "://" in gateway or ":" in gateway or gateway.replace(".", "").isdigit()
