"""The `orchard` command: gateway, runner, serve (both), status, demo-model."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import click

from gateway.config import GatewayConfig
from runner.client import (
    DRAIN_TIMEOUT,
    GATHER_MIN_REQUESTS,
    GATHER_S,
    LIVENESS_TIMEOUT,
    MAX_CONCURRENT,
)
from runner.demo_families import FAMILIES
from runner.demo_model import DEMO_MODEL_ID

if TYPE_CHECKING:
    from protocol.frames import Hardware
    from runner.engine.base import Engine
    from runner.engine.kv_store import KvStore

if TYPE_CHECKING:
    from runner.group.member import GroupMember

F = TypeVar("F", bound=Callable[..., Any])


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where available: its C transports halve the relay's per-token cost
    (profiled: selector, write and handle dispatch were half of it on asyncio's loop)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


log_level_option = click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="orchard")
def main() -> None:
    """Orchard: the Macs on a LAN as one OpenAI-compatible LLM endpoint."""


def _tls_options(command: F) -> F:
    """--tls/--no-tls, --tls-cert and --tls-key (gateway and serve)."""
    options = [
        click.option(
            "--tls/--no-tls",
            default=None,
            help="Serve HTTPS / WSS. Default: on when listening off loopback. Unless "
            "--tls-cert and --tls-key give a certificate, a local certificate authority made "
            "on first start and kept in $ORCHARD_TLS_DIR (~/.orchard/tls, ca.pem) issues one "
            "for the current addresses at each start where they changed; clients trust "
            "ca.pem, runners pin it once the gateway proves it knows the runner token "
            "(docs/security.md).",
        ),
        click.option(
            "--tls-cert",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Certificate (PEM) to serve instead of a generated one.",
        ),
        click.option(
            "--tls-key",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="The private key (PEM) of --tls-cert.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _config_option(name: str, help: str) -> Callable[[F], F]:
    """A `gateway` option whose default is GatewayConfig's, so each default is written once."""
    field = attrs.fields_dict(GatewayConfig)[name]
    flag = "--" + name.replace("_", "-")
    return click.option(flag, default=field.default, show_default=True, help=help)


def _store_options(command: F) -> F:
    """The stored completions' bounds (`store: true`), on `gateway` and `serve` alike."""
    options = (
        _config_option(
            "store_max_completions",
            "Stored chat completions kept in memory; past it the oldest goes (0: store "
            "nothing, refuse store: true).",
        ),
        _config_option("store_max_bytes", "Their total size as JSON; past it the oldest go."),
        _config_option("store_ttl", "Seconds a stored chat completion is kept."),
    )
    for option in reversed(options):
        command = option(command)
    return command


@main.command()
@_config_option("host", "Address to listen on.")
@_config_option("port", "Port to listen on.")
@_config_option("queue_size", "Waiting requests per model.")
@_config_option("queue_timeout", "Seconds a request may wait.")
@_config_option("liveness_timeout", "Seconds of runner silence before it is dropped.")
@_config_option(
    "model_grace",
    "Seconds after a model's last runner left during which it answers 503, not 404.",
)
@_config_option(
    "start_grace",
    "Seconds after start during which a model no runner has registered yet answers 503, "
    "not 404 (runners reconnecting to a restarted gateway).",
)
@_config_option(
    "stream_timeout", "Seconds without a runner frame before a request is ended with an error."
)
@_config_option("drain_timeout", "On SIGTERM, seconds to let requests in flight finish.")
@_config_option(
    "first_token_wait",
    "Seconds a stream waits for its first token before committing to HTTP 200.",
)
@_config_option("keepalive_interval", "Seconds of SSE silence before a ': keep-alive' comment.")
@_config_option(
    "header_timeout", "Seconds a client has to send a request's headers (slowloris guard)."
)
@_config_option("handshake_timeout", "Seconds a runner has to say hello after connecting.")
@_config_option("max_body_bytes", "Largest HTTP body.")
@_config_option("max_tokens_limit", "Largest max_tokens a request may ask for.")
@_config_option("max_choices", "Largest n (choices per request) a request may ask for.")
@_config_option("max_client_sockets", "Browser WebSocket connections open at once.")
@_store_options
@click.option(
    "--runner-token",
    envvar="ORCHARD_RUNNER_TOKEN",
    help="Runners must present this token (env ORCHARD_RUNNER_TOKEN). Without it, only "
    "runners on this machine (loopback) are accepted.",
)
@click.option(
    "--api-key",
    "api_key",
    multiple=True,
    help="Require this client API key on /v1/* "
    "(repeatable; env ORCHARD_API_KEYS, comma-separated).",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Read client API keys from a file, one per line.",
)
@click.option(
    "--allow-origin",
    multiple=True,
    help="Browser origin allowed besides the gateway's own, e.g. https://app.example "
    "(repeatable; * for any).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Accept runners from any address without a token. "
    "Needed to listen on the LAN with no runner token.",
)
@click.option(
    "--metrics-open",
    is_flag=True,
    help="Serve GET /metrics (Prometheus) without an API key, for a scraper on the LAN. "
    "Without API keys it is open anyway.",
)
@click.option(
    "--name",
    "gateway_name",
    default=socket.gethostname(),
    show_default=True,
    help="The gateway's name on the LAN (what `orchard runner --gateway NAME` asks for).",
)
@_tls_options
@click.option(
    "--advertise/--no-advertise",
    default=True,
    show_default=True,
    help="Announce the gateway on the LAN over mDNS (_orchard._tcp), so runners find it "
    "with no URL. Never when listening on loopback only; the token is never announced.",
)
@log_level_option
def gateway(
    log_level: str,
    gateway_name: str,
    tls: bool | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    advertise: bool,
    runner_token: str | None,
    api_key: tuple[str, ...],
    api_key_file: Path | None,
    allow_origin: tuple[str, ...],
    insecure: bool,
    metrics_open: bool,
    **settings: Any,
) -> None:
    """Run the gateway: OpenAI API for clients, WebSocket endpoint for runners.

    SIGTERM drains: new requests get 503, streams in flight finish (up to --drain-timeout),
    runners are sent away with 1001 so they reconnect to the next gateway.
    """
    _setup_logging(log_level)
    keys = set(api_key)
    keys.update(k.strip() for k in os.environ.get("ORCHARD_API_KEYS", "").split(",") if k.strip())
    if api_key_file is not None:
        keys.update(line.strip() for line in api_key_file.read_text().splitlines() if line.strip())
    config = GatewayConfig(
        runner_token=runner_token or None,
        api_keys=frozenset(keys),
        allowed_origins=frozenset(allow_origin),
        insecure=insecure,
        metrics_open=metrics_open,
        **settings,
    )
    _check_exposure(config)
    config, files = _with_tls(config, tls, tls_cert, tls_key)
    _run(_run_gateway(config, log_level, name=gateway_name, advertise=advertise, tls=files))


def _with_tls(
    config: GatewayConfig, tls: bool | None, cert: Path | None, key: Path | None
) -> tuple[GatewayConfig, tuple[Path, Path] | None]:
    """The config with the certificate chain it serves and its authority's fingerprint, and
    the certificate and key to serve TLS with (None: plain HTTP)."""
    files = _tls_files(config, tls, cert, key)
    if files is None:
        return config, None
    from gateway.tls import authority_fingerprint, served_chain

    served = attrs.evolve(
        config, tls_fingerprint=authority_fingerprint(files[0]), tls_chain=served_chain(files[0])
    )
    return served, files


def _tls_files(
    config: GatewayConfig, tls: bool | None, cert: Path | None, key: Path | None
) -> tuple[Path, Path] | None:
    """The certificate and key to serve TLS with, or None (plain HTTP)."""
    from gateway.auth import is_loopback

    if (cert is None) != (key is None):
        raise click.UsageError("--tls-cert and --tls-key go together.")
    if tls is None:
        tls = cert is not None or not is_loopback(config.host)
    if not tls:
        return None
    if cert is not None and key is not None:
        return cert, key
    from gateway.discovery import addresses_for
    from gateway.tls import default_directory, ensure_certificate

    return ensure_certificate(default_directory(), addresses_for(config.host))


def _check_exposure(config: GatewayConfig) -> None:
    """Refuse to expose the runner endpoint on the LAN without a token unless told to."""
    from gateway.auth import is_loopback

    log = logging.getLogger("gateway")
    if config.runner_token is None and not config.insecure:
        if not is_loopback(config.host):
            raise click.UsageError(
                f"listening on {config.host} with no runner token would let anyone on the "
                "network register a runner. Set --runner-token (or ORCHARD_RUNNER_TOKEN), "
                "or pass --insecure to accept that risk."
            )
        log.info("no runner token set: accepting runners from this machine (loopback) only")
    if config.insecure:
        log.warning(
            "!!! --insecure: ANY machine that can reach %s:%d may register a runner and "
            "receive your users' prompts. Use --runner-token instead. !!!",
            config.host,
            config.port,
        )
    if config.api_keys:
        log.info("client API keys required on /v1/* (%d configured)", len(config.api_keys))


def _server(config: GatewayConfig, log_level: str, tls: tuple[Path, Path] | None = None) -> Any:
    from gateway.server import make_server

    return make_server(config, log_level, tls)


async def _run_gateway(
    config: GatewayConfig,
    log_level: str,
    *,
    name: str = "",
    advertise: bool = False,
    tls: tuple[Path, Path] | None = None,
) -> None:
    from gateway.discovery import advertiser_for
    from protocol.frames import PROTOCOL_VERSION

    server = _server(config, log_level, tls)
    _log_tls(config, tls)
    advertiser = advertiser_for(
        name=name or socket.gethostname(),
        host=config.host,
        port=config.port,
        protocol_version=PROTOCOL_VERSION,
        token_required=config.runner_token is not None,
        enabled=advertise,
        tls=tls is not None,
    )
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def stop() -> None:
        if stopping:  # a second signal: stop now
            server.should_exit = True
            return
        stopping.append(asyncio.create_task(_drain_and_exit(server)))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    if advertiser is not None:
        await advertiser.start()
    try:
        await server.serve()
    finally:
        if advertiser is not None:
            await advertiser.close()


def _log_tls(config: GatewayConfig, tls: tuple[Path, Path] | None) -> None:
    if tls is not None:
        from gateway.tls import trust_file

        logging.getLogger("gateway").info(
            "serving HTTPS: certificate %s, its certificate authority %s, SHA-256 fingerprint "
            "%s (what runners pin). Clients trust it with SSL_CERT_FILE=%s (the openai SDK, "
            "httpx, curl --cacert)",
            tls[0],
            trust_file(tls[0]),
            config.tls_fingerprint,
            trust_file(tls[0]),
        )


async def _drain_and_exit(server: Any) -> None:
    """Refuse new requests, let streams finish, send runners away, then stop uvicorn."""
    app = server.config.app
    await app.state.pool.drain(app.state.config.drain_timeout)
    server.should_exit = True


@main.command()
@click.option(
    "--gateway",
    "gateway_url",
    default=None,
    envvar="ORCHARD_GATEWAY",
    help="Gateway base URL, e.g. https://192.168.1.10:8000, or a gateway's name on the LAN "
    "(env ORCHARD_GATEWAY). Without it the runner finds the gateway over mDNS: it joins "
    "the only one, lists them when several answer, and keeps looking while none does.",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    default=(DEMO_MODEL_ID,),
    show_default=True,
    help="Model to serve: orchard-demo, a Hugging Face id (mlx-community/...) or a local MLX "
    "dir. Repeat it to serve several: the first is loaded at start, each other one when a "
    "request asks for it (downloaded first if need be), within --max-memory.",
)
@click.option(
    "--max-memory",
    metavar="SIZE",
    default=None,
    help="With several --model: what the loaded models' weights may take together, e.g. "
    "24GB, 20GiB or 60% (default: 70% of the GPU's working set on a Mac, of the memory "
    "elsewhere). To load a model that does not fit, the least recently used idle ones are "
    "unloaded.",
)
@click.option("--name", default=socket.gethostname(), show_default=True, help="Runner name.")
@click.option(
    "--max-concurrent", default=MAX_CONCURRENT, show_default=True, help="Requests run at once."
)
@click.option(
    "--engine",
    type=click.Choice(["mlx-batched", "mlx", "scripted"]),
    default="mlx-batched",
    show_default=True,
    help="mlx-batched: concurrent requests decoded as one batch (mlx-lm BatchGenerator); "
    "mlx: concurrent requests interleaved token by token, each on its own stream_generate; "
    "scripted: a deterministic fake for relay benchmarks and tests.",
)
@click.option(
    "--max-kv-bytes",
    type=int,
    default=None,
    help="KV-cache memory budget in bytes. mlx-batched: what running requests and kept "
    "prompts take together (a request starts when its worst case fits, kept prompts "
    "evicted first); mlx: what kept prompts take. Default: running requests unbounded, "
    "kept prompts 10% of the memory.",
)
@click.option(
    "--kv-disk",
    "kv_disk",
    metavar="SIZE",
    default=None,
    help="What the disk cache of kept prompts may take under ~/.cache/orchard/kv (or "
    "$ORCHARD_CACHE_DIR/kv), e.g. 20GB, 50GiB, 10% (of the free disk) or bytes; 0 turns it "
    "off. They outlive a restart and a model's unload. Default: 10% of the free disk, at "
    "most 64 GiB.",
)
@click.option(
    "--tokens-per-second",
    default=0.0,
    show_default=True,
    help="Scripted engine only: pace per stream (0 = as fast as possible).",
)
@click.option(
    "--step-ms",
    default=1.0,
    show_default=True,
    help="Scripted engine only: tokens due within one step go out together, like a "
    "batched engine's decode step (a token is late by at most this).",
)
@click.option(
    "--gather-ms",
    default=GATHER_S * 1000,
    show_default=True,
    help=f"With {GATHER_MIN_REQUESTS} or more requests in flight, gather chunks this long "
    "into one frame to the gateway (fewer, larger frames; 0 sends each burst at once).",
)
@click.option(
    "--drain-timeout",
    default=DRAIN_TIMEOUT,
    show_default=True,
    help="On SIGTERM, seconds to let requests in flight finish before cutting them short.",
)
@click.option(
    "--liveness-timeout",
    default=LIVENESS_TIMEOUT,
    show_default=True,
    help="Seconds of gateway silence before reconnecting.",
)
@click.option(
    "--token",
    envvar="ORCHARD_RUNNER_TOKEN",
    help="The gateway's runner token (env ORCHARD_RUNNER_TOKEN; prefer the env var: "
    "arguments are visible to other users in `ps`).",
)
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Start a runner group (one model split across several Macs) with MLX's launcher "
    "over the hosts in this mlx.launch hostfile: one member per host, rank 0 (the first "
    "host) connects to the gateway. See docs/distributed.md. Example hostfile, ring backend "
    'over the LAN: [{"ssh": "mac1.local", "ips": ["192.168.1.11"]}, {"ssh": "mac2.local", '
    '"ips": ["192.168.1.12"]}]; for JACCL over Thunderbolt, {"backend": "jaccl", "hosts": '
    "[...]} with each host's rdma devices (mlx.distributed_config writes it).",
)
@click.option(
    "--local-group",
    type=int,
    default=None,
    metavar="N",
    help="Start a runner group of N processes on this machine (ring backend over loopback): "
    "for trying groups out and for tests.",
)
@click.option(
    "--split",
    type=click.Choice(["auto", "pipeline", "tensor"]),
    default="auto",
    show_default=True,
    help="Runner groups: how to split the model. pipeline: each member holds some layers "
    "(one hand-off per member per step; suits a LAN); tensor: each member holds part of "
    "every layer (two all-sums per layer per step; suits Thunderbolt). auto: tensor over "
    "JACCL, else pipeline where the model supports it, else tensor.",
)
@click.option("--group-member", is_flag=True, hidden=True, help="Set by the group's launcher.")
@log_level_option
def runner(
    gateway_url: str | None,
    models: tuple[str, ...],
    max_memory: str | None,
    name: str,
    max_concurrent: int,
    engine: str,
    tokens_per_second: float,
    step_ms: float,
    gather_ms: float,
    drain_timeout: float,
    liveness_timeout: float,
    token: str | None,
    max_kv_bytes: int | None,
    kv_disk: str | None,
    log_level: str,
    hostfile: Path | None,
    local_group: int | None,
    split: str,
    group_member: bool,
) -> None:
    """Run a runner: serve a model to a gateway over one persistent WebSocket.

    SIGTERM drains: no new requests, those in flight finish, then it exits 0.

    \b
    A runner group serves one model too big for one Mac, split across several:
        orchard runner --gateway URL --model M --hostfile hosts.json
    runs `mlx.launch --hostfile hosts.json -- orchard runner ...` (one member per host,
    over ssh; the same Python environment at the same path on each), and
        orchard runner --gateway URL --model M --local-group 2
    runs two members here. Only rank 0 connects to the gateway, with
    ORCHARD_RUNNER_TOKEN (passed to remote hosts through the launcher's --env, visible in
    their `ps`); the group shows as one runner listing its members.
    Ring backend (the default; TCP over any LAN): each host's "ips" in the hostfile,
    passwordless ssh to each host, TCP ports from 32323 up open between them.
    JACCL (RDMA over Thunderbolt 5): macOS 26.2+, `rdma_ctl enable` once in recoveryOS,
    and a hostfile from `mlx.distributed_config --backend jaccl --over thunderbolt`.
    --split pipeline (each host some layers) suits the ring; tensor (each host part of
    every layer) suits JACCL; auto picks. See docs/distributed.md.
    """
    _setup_logging(log_level)
    if max_kv_bytes is not None and max_kv_bytes <= 0:
        raise click.BadParameter("must be more than 0 bytes", param_hint="--max-kv-bytes")
    disk = _kv_disk(kv_disk)
    member = None
    if hostfile is not None or local_group is not None or group_member:
        member = _runner_group(models, engine, max_kv_bytes, liveness_timeout, split, group_member)
    _run(
        _run_runner(
            gateway_url,
            models,
            name,
            max_concurrent,
            engine,
            tokens_per_second,
            drain_timeout,
            liveness_timeout,
            token,
            max_kv_bytes,
            step_ms / 1000,
            gather_ms / 1000,
            max_memory,
            group=member,
            kv_disk=None if member is not None else disk,
        )
    )


def _mlx_engines(
    kind: str,
    max_concurrent: int,
    max_kv_bytes: int | None,
    hardware: Hardware,
    store: KvStore | None,
) -> Callable[..., Engine]:
    """What makes the runner's engine for a model (and its files' directory, if known)."""
    from runner.budget import default_prefix_bytes

    kept = max_kv_bytes if max_kv_bytes is not None else default_prefix_bytes(hardware)

    def make(model: str, path: str | None = None) -> Engine:
        if kind == "mlx-batched":
            from runner.engine.batched import BatchedMlxEngine

            return BatchedMlxEngine(
                model,
                max_concurrent=max_concurrent,
                max_kv_bytes=max_kv_bytes,
                prefix_cache_bytes=kept,
                kv_store=store,
                path=path,
            )
        from runner.engine.mlx_engine import MlxEngine

        return MlxEngine(
            model, max_concurrent=max_concurrent, prefix_cache_bytes=kept, kv_store=store, path=path
        )

    return make


def _kv_disk(size: str | None) -> tuple[Path, int]:
    """Where the disk cache goes and what it may take (0: off); a bad size is a usage error."""
    from runner.demo_model import cache_dir
    from runner.engine.kv_store import default_budget, parse_disk_size

    root = cache_dir() / "kv"
    if size is None:
        return root, default_budget(root)
    try:
        return root, parse_disk_size(size, root)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-disk") from exc


async def _run_runner(
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
        make = _mlx_engines(engine_kind, max_concurrent, max_kv_bytes, hardware, store)
        eng = make(models[0]) if len(models) == 1 else _shelf(models, make, max_memory, hardware)
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


def _shelf(
    models: tuple[str, ...],
    make: Callable[[str, str], Engine],
    max_memory: str | None,
    hardware: Hardware,
) -> Engine:
    """Several models, loaded on demand within the memory budget (runner.engine.shelf)."""
    from runner.budget import default_budget, parse_size
    from runner.engine.shelf import ModelShelf
    from runner.model_source import HubSource

    if len(set(models)) != len(models):
        raise click.BadParameter("a model is named twice", param_hint="--model")
    try:
        budget = (
            default_budget(hardware) if max_memory is None else parse_size(max_memory, hardware)
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-memory") from exc
    return ModelShelf(models, make_engine=make, source=HubSource(), max_memory=budget)


def _runner_group(
    models: tuple[str, ...],
    engine: str,
    max_kv_bytes: int | None,
    timeout: float,
    split: str,
    member: bool,
) -> GroupMember:
    """A runner group: as its starter, launch it and exit with its status; as a member of
    rank > 0, follow rank 0 and exit; as rank 0, the member to serve the gateway with."""
    from runner.group import GroupError
    from runner.group import launch as group_launch

    ctx = click.get_current_context()
    hostfile, local_group = ctx.params["hostfile"], ctx.params["local_group"]
    try:
        if len(models) != 1:
            raise GroupError("a runner group serves exactly one model: give one --model")
        if engine != "mlx-batched":
            raise GroupError(f"a runner group runs the mlx-batched engine, not {engine}")
        if max_kv_bytes is not None:
            raise GroupError("--max-kv-bytes is not supported in a runner group yet")
        if not member:
            sys.exit(
                group_launch.run_group(
                    group_launch.member_argv(ctx.command.params, ctx.params),
                    hostfile=hostfile,
                    local_group=local_group,
                    token=ctx.params.get("token"),
                    grace=ctx.params["drain_timeout"] + 2 * timeout,
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
            max_concurrent=ctx.params["max_concurrent"],
        )
    except GroupError as exc:
        logging.getLogger("runner.group").error("%s", exc)
        sys.exit(2)
    if joined.rank > 0:
        sys.exit(joined.follow())
    return joined


def _is_url(gateway: str) -> bool:
    """A URL or host:port, not a gateway's name on the LAN."""
    return "://" in gateway or ":" in gateway or gateway.replace(".", "").isdigit()


@main.command()
@_config_option("host", "Address to listen on.")
@_config_option("port", "Port to listen on.")
@click.option(
    "--model", default=DEMO_MODEL_ID, show_default=True, help="Model for the local runner."
)
@click.option(
    "--max-concurrent", default=MAX_CONCURRENT, show_default=True, help="Local runner's slots."
)
@click.option(
    "--runner-token",
    envvar="ORCHARD_RUNNER_TOKEN",
    help="Token for runners (env ORCHARD_RUNNER_TOKEN); a random one is made when unset.",
)
@_tls_options
@_store_options
@log_level_option
def serve(
    host: str,
    port: int,
    model: str,
    max_concurrent: int,
    runner_token: str | None,
    tls: bool | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    log_level: str,
    **store: Any,
) -> None:
    """Run the gateway plus one local runner (a separate process, same WebSocket path).

    Off loopback it serves HTTPS, as `orchard gateway` does (--no-tls for plain HTTP).
    """
    _setup_logging(log_level)
    # Always a token: the local runner gets it through its environment, never argv.
    token = runner_token or secrets.token_urlsafe(24)
    config = GatewayConfig(host=host, port=port, runner_token=token, **store)
    _check_exposure(config)
    config, files = _with_tls(config, tls, tls_cert, tls_key)
    _run(_serve(config, model, max_concurrent, log_level, files))


async def _serve(
    config: GatewayConfig,
    model: str,
    max_concurrent: int,
    log_level: str,
    tls: tuple[Path, Path] | None = None,
) -> None:
    server = _server(config, log_level, tls)
    _log_tls(config, tls)
    # Signals stop the runner first, then the server. The local runner pins the certificate
    # authority as any runner does (the gateway proves it knows the token).
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    base = f"{'https' if tls else 'http'}://{local}:{config.port}"
    runner_proc: subprocess.Popen[bytes] | None = None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    server_task = asyncio.create_task(server.serve())
    while not server.started and not server_task.done():
        await asyncio.sleep(0.05)
    if server_task.done():
        server_task.result()
        return
    runner_proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchard",
            "runner",
            "--gateway",
            base,
            "--model",
            model,
            "--name",
            f"{socket.gethostname()}-local",
            "--max-concurrent",
            str(max_concurrent),
            "--log-level",
            log_level,
        ],
        env={**os.environ, "ORCHARD_RUNNER_TOKEN": config.runner_token or ""},
    )
    print(_banner(base, model, _trust(tls), config.tls_fingerprint), flush=True)
    runner_exit = asyncio.create_task(asyncio.to_thread(runner_proc.wait))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({server_task, runner_exit, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if runner_proc.poll() is None:
        runner_proc.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(runner_exit), 10)
        except TimeoutError:
            runner_proc.kill()
            await runner_exit
    server.should_exit = True
    await server_task
    stopper.cancel()


def _trust(tls: tuple[Path, Path] | None) -> Path | None:
    """The file clients trust for the certificate served, if any."""
    if tls is None:
        return None
    from gateway.tls import trust_file

    return trust_file(tls[0])


def _banner(base: str, model: str, cert: Path | None = None, fingerprint: str | None = None) -> str:
    trust = (
        f"""
Its certificate is issued by this gateway's own certificate authority unless you gave one
(SHA-256 fingerprint {fingerprint}): clients trust it with
    export SSL_CERT_FILE={cert}
(`orchard status` prints the fingerprint, and how to fetch the authority from another machine.)
"""
        if cert is not None
        else ""
    )
    return f"""
Orchard is up at {base}/v1  (model: {model}; runners: {base}/v1/runners)
{trust}
    from openai import OpenAI
    client = OpenAI(base_url="{base}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="{model}",
        messages=[{{"role": "user", "content": "Hello!"}}],
        stream=True,
    )
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)

Press Ctrl-C to stop.
"""


@main.command()
@click.option(
    "--gateway",
    "gateway_url",
    default=f"http://{GatewayConfig().host}:{GatewayConfig().port}",
    show_default=True,
    envvar="ORCHARD_GATEWAY",
    help="Gateway base URL (env ORCHARD_GATEWAY).",
)
@click.option(
    "--api-key",
    envvar="ORCHARD_API_KEY",
    help="Client API key, sent as 'Authorization: Bearer' (env ORCHARD_API_KEY).",
)
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    is_flag=False,
    flag_value=2.0,
    default=None,
    metavar="[SECONDS]",
    help="Redraw every SECONDS (2 when given alone) until Ctrl-C.",
)
def status(gateway_url: str, api_key: str | None, watch: float | None) -> None:
    """Print the pool as a table: each runner's models, hardware, load and tokens."""
    import time

    from orchard.status import StatusError, fetch, render

    def draw() -> str:
        try:
            runners = fetch(gateway_url, "/v1/runners", api_key)
            models = fetch(gateway_url, "/v1/models", api_key)
        except StatusError as exc:
            raise click.ClickException(str(exc)) from None
        return render(runners, models, time.time())

    if watch is None:
        click.echo(draw(), nl=False)
        return
    try:
        while True:
            table = draw()
            click.clear()
            click.echo(f"{gateway_url}  every {watch:g} s  {time.strftime('%H:%M:%S')}\n")
            click.echo(table, nl=False)
            time.sleep(watch)
    except KeyboardInterrupt:
        pass


@main.command("demo-model")
@click.option(
    "--family",
    type=click.Choice(sorted(FAMILIES)),
    default=None,
    help="Write instead the tiny random-weight model of a model family, served as "
    "orchard-demo-FAMILY: the family's architecture, special tokens and chat template, so that "
    "mlx-lm reads its tool calls and think markers as the real model's. Families: "
    + ", ".join(f"{name} ({FAMILIES[name].stands_for})" for name in sorted(FAMILIES))
    + ".",
)
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def demo_model(directory: Path, family: str | None) -> None:
    """Write the built-in tiny random-weight model, or a model family's (--family), to
    DIRECTORY (loadable by mlx_lm)."""
    import shutil

    from runner.demo_model import resolve_model

    name = DEMO_MODEL_ID if family is None else FAMILIES[family].model_id
    # A copy of the cache's build (made first if missing): building the built-in model takes
    # 15-50 s of CPU.
    shutil.copytree(resolve_model(name), directory, dirs_exist_ok=True)
    click.echo(f"wrote {name} to {directory}")
    click.echo(f"try: mlx_lm.generate --model {directory} --prompt hello")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
