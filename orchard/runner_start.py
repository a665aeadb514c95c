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

    from protocol.frames import Hardware
    from runner.engine.base import Engine
    from runner.engine.kv_store import KvStore
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

    options = options or {}
    # Each adapter checked before anything connects or loads (a StartupError).
    startup.check_adapters(options)
    served = tuple(options) or models  # the ids it serves: MODEL:ADAPTER for an adapter's

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

    eng, hardware, store = _engine(
        engine_kind,
        served,
        max_concurrent=max_concurrent,
        max_kv_bytes=max_kv_bytes,
        max_memory=max_memory,
        tokens_per_second=tokens_per_second,
        step=step,
        kv_disk=kv_disk,
        options=options,
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
        logging.getLogger("runner").error("could not load %s: %s", served[0], exc)
        sys.exit(2)
    except (AmbiguousGateway, UntrustedGateway) as exc:
        logging.getLogger("runner").error("%s", exc)
        sys.exit(2)
    finally:
        if store is not None:
            await asyncio.to_thread(store.close)  # the writes queued still reach the disk


def _engine(
    engine_kind: str,
    served: tuple[str, ...],
    *,
    max_concurrent: int,
    max_kv_bytes: int | None,
    max_memory: str | None,
    tokens_per_second: float,
    step: float,
    kv_disk: tuple[Path, int] | None,
    options: Mapping[str, ModelOptions],
) -> tuple[Engine, Hardware, KvStore | None]:
    """The runner's engine (one model's, or a shelf of several, by served id), the hardware
    it runs on and its disk cache."""
    from runner.hardware import detect, mlx_backend

    if engine_kind == "scripted":
        from runner.engine.scripted import ScriptedEngine

        startup.refuse_for_scripted(options)
        scripted = ScriptedEngine(
            models=served,
            tokens_per_second=tokens_per_second,
            max_concurrent=max_concurrent,
            min_step=step,
        )
        return scripted, detect("none"), None
    from runner.engine.kv_store import KvStore

    hardware = detect(mlx_backend())
    store = KvStore(*kv_disk) if kv_disk is not None and kv_disk[1] > 0 else None
    from runner.preflight import check_drafts, check_kv_groups

    check_drafts(options)
    check_kv_groups(options)
    make = startup.mlx_engines(
        engine_kind, max_concurrent, max_kv_bytes, hardware, store, options=options
    )
    if len(served) == 1:
        return make(served[0]), hardware, store
    return startup.shelf(served, make, max_memory, hardware, options), hardware, store


def _is_url(gateway: str) -> bool:
    """A URL or host:port, not a gateway's name on the LAN."""
    return "://" in gateway or ":" in gateway or gateway.replace(".", "").isdigit()
