"""What `orchard runner` starts with: the engine factory, the disk cache, the model shelf and
the runner group, each from the command's options.

An option whose value cannot be used raises `StartupError` naming the option; the CLI turns it
into a usage error.
"""

# The engines, the shelf and the group load MLX: each is imported where it is made, so that
# `orchard --help` (which imports this module) starts fast and without MLX.
# ruff: noqa: PLC0415

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from runner.errors import AdapterError, RunnerError

if TYPE_CHECKING:
    from protocol.frames import Hardware
    from runner.engine.base import Engine
    from runner.engine.kv_store import KvStore
    from runner.group.member import GroupMember
    from runner.model_options import ModelOptions


class StartupError(RunnerError):
    """An option's value the runner cannot start with; `option` names it (`--kv-disk`)."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


def mlx_engines(
    kind: str,
    max_concurrent: int,
    max_kv_bytes: int | None,
    hardware: Hardware,
    store: KvStore | None,
    *,
    options: Mapping[str, ModelOptions],
) -> Callable[..., Engine]:
    """What makes the runner's engine for a model (and its files' directory, if known), with
    its options (`runner.model_options`)."""
    from runner.budget import default_prefix_bytes

    kept = max_kv_bytes if max_kv_bytes is not None else default_prefix_bytes(hardware)

    def make(model: str, path: str | None = None) -> Engine:
        from runner.engine.mlx_engine import MlxEngine, Strategy

        strategy: Strategy | None = None  # MlxEngine's default: interleaved decoding
        if kind == "mlx-batched":
            from runner.engine.batched import Batched

            strategy = Batched(max_kv_bytes=max_kv_bytes)
        return MlxEngine(
            model,
            max_concurrent=max_concurrent,
            strategy=strategy,
            prefix_cache_bytes=kept,
            kv_store=store,
            path=path,
            options=options.get(model),
        )

    return make


MODEL_OPTIONS = (
    "draft model, KV quantization, adapter, chat template, remote code or sampling defaults "
    "(--temp, --top-p, --top-k, --min-p, --max-tokens)"
)


def refuse_for_scripted(options: Mapping[str, ModelOptions]) -> None:
    """The scripted engine has no model to draft for, adapt, template or sample from."""
    if any(_any_set(option) for option in options.values()):
        raise StartupError(f"the scripted engine takes no {MODEL_OPTIONS}", "--engine")


def _any_set(option: ModelOptions) -> bool:
    """One of the model options is set (runner.model_options)."""
    from runner.model_options import ModelOptions

    return attrs.evolve(option, model=None) != ModelOptions()


def kv_disk(size: str | None) -> tuple[Path, int]:
    """Where the disk cache goes and what it may take (0: off); a bad size is a StartupError."""
    from runner.demo_model import cache_dir
    from runner.engine.kv_store import default_budget, parse_disk_size

    root = cache_dir() / "kv"
    if size is None:
        return root, default_budget(root)
    try:
        return root, parse_disk_size(size, root)
    except ValueError as exc:
        raise StartupError(str(exc), "--kv-disk") from exc


def shelf(
    models: tuple[str, ...],
    make: Callable[[str, str], Engine],
    max_memory: str | None,
    hardware: Hardware,
    options: Mapping[str, ModelOptions] | None = None,
) -> Engine:
    """Several models (by served id), loaded on demand within the memory budget
    (runner.engine.shelf); `options` say the model of each `MODEL:ADAPTER` id."""
    from runner.budget import default_budget, parse_size
    from runner.engine.shelf import ModelShelf
    from runner.model_source import HubSource

    if len(set(models)) != len(models):
        raise StartupError("a model is named twice", "--model")
    try:
        budget = (
            default_budget(hardware) if max_memory is None else parse_size(max_memory, hardware)
        )
    except ValueError as exc:
        raise StartupError(str(exc), "--max-memory") from exc
    bases = {served: option.base(served) for served, option in (options or {}).items()}
    return ModelShelf(models, make_engine=make, source=HubSource(bases), max_memory=budget)


def check_adapters(options: Mapping[str, ModelOptions]) -> None:
    """Each adapter that is a directory: its files, and that it fits its model when the
    model is on disk (the built-in ones are built for it). A Hub id is checked when it is
    downloaded, as its model loads. A broken one is a StartupError."""
    from runner import adapter
    from runner.model_source import HubSource

    source = HubSource()
    for served, option in options.items():
        if option.adapter_path is None:
            continue
        base = option.base(served)
        try:
            directory = adapter.locate(option.adapter_path, download=False)
            if directory is None:
                continue  # a Hub id not downloaded yet
            adapter.check_files(directory)
            model_dir = source.on_disk(base)
            if model_dir is not None:
                adapter.check_fit(
                    directory, model_dir, base, trust_remote_code=option.trust_remote_code
                )
        except AdapterError as exc:
            raise StartupError(f"{served}: {exc}", "--adapter-path") from exc


def runner_group(
    models: tuple[str, ...],
    engine: str,
    max_kv_bytes: int | None,
    timeout: float,
    *,
    split: str,
    member: bool,
    params: Iterable[Any],
    values: Mapping[str, Any],
    options: Mapping[str, ModelOptions],
) -> GroupMember:
    """A runner group: as its starter, launch it and exit with its status; as a member of
    rank > 0, follow rank 0 and exit; as rank 0, the member to serve the gateway with.

    `params` are the `orchard runner` command's options and `values` what they were parsed
    to, as `runner.group.launch.member_argv` takes them.
    """
    from runner.group import GroupError
    from runner.group import launch as group_launch

    hostfile, local_group = values["hostfile"], values["local_group"]
    try:
        if len(models) != 1:
            raise GroupError("a runner group serves exactly one model: give one --model")
        if engine != "mlx-batched":
            raise GroupError(f"a runner group runs the mlx-batched engine, not {engine}")
        if max_kv_bytes is not None:
            raise GroupError("--max-kv-bytes is not supported in a runner group yet")
        if any(_any_set(option) for option in options.values()):
            # Each member would need the draft or the adapter split as the model is, and the
            # members' lock step loads the model without options: refused, not ignored.
            raise GroupError(f"a runner group takes no {MODEL_OPTIONS}")
        if not member:
            sys.exit(
                group_launch.run_group(
                    group_launch.member_argv(params, dict(values)),
                    hostfile=hostfile,
                    local_group=local_group,
                    token=values.get("token"),
                    grace=values["drain_timeout"] + 2 * timeout,
                    failure_grace=2 * timeout,
                )
            )
        from runner.group.member import GroupMember
        from runner.hardware import detect, mlx_backend

        joined = GroupMember(
            models[0],
            detect(mlx_backend()),
            split=split,  # type: ignore[arg-type]  # click.Choice checked it
            timeout=timeout,
            max_concurrent=values["max_concurrent"],
        )
    except GroupError as exc:
        logging.getLogger("runner.group").error("%s", exc)
        sys.exit(2)
    if joined.rank > 0:
        sys.exit(joined.follow())
    return joined
