"""The `orchard` command: gateway, runner, serve (both), status, demo-model."""

from __future__ import annotations

import secrets
import socket
import sys
from pathlib import Path
from typing import Any

import click

from gateway.config import GatewayConfig
from orchard import gateway_start
from orchard.model_flags import model_flags, options_of
from orchard.options import config_option, log_level_option, store_options, tls_options
from orchard.runner_start import run_runner
from orchard.running import run, setup_logging
from orchard.serve import start as serve_start
from runner import startup
from runner.client import (
    DRAIN_TIMEOUT,
    GATHER_MIN_REQUESTS,
    GATHER_S,
    LIVENESS_TIMEOUT,
    MAX_CONCURRENT,
)
from runner.demo_families import FAMILIES
from runner.demo_model import DEMO_MODEL_ID
from runner.startup import StartupError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="orchard")
def main() -> None:
    """Orchard: the Macs on a LAN as one OpenAI-compatible LLM endpoint."""


@main.command()
@config_option("host", "Address to listen on.")
@config_option("port", "Port to listen on.")
@config_option("queue_size", "Waiting requests per model.")
@config_option("queue_timeout", "Seconds a request may wait.")
@config_option("liveness_timeout", "Seconds of runner silence before it is dropped.")
@config_option(
    "model_grace",
    "Seconds after a model's last runner left during which it answers 503, not 404.",
)
@config_option(
    "start_grace",
    "Seconds after start during which a model no runner has registered yet answers 503, "
    "not 404 (runners reconnecting to a restarted gateway).",
)
@config_option(
    "stream_timeout", "Seconds without a runner frame before a request is ended with an error."
)
@config_option("drain_timeout", "On SIGTERM, seconds to let requests in flight finish.")
@config_option(
    "first_token_wait",
    "Seconds a stream waits for its first token before committing to HTTP 200.",
)
@config_option("keepalive_interval", "Seconds of SSE silence before a ': keep-alive' comment.")
@config_option(
    "header_timeout", "Seconds a client has to send a request's headers (slowloris guard)."
)
@config_option("handshake_timeout", "Seconds a runner has to say hello after connecting.")
@config_option("max_body_bytes", "Largest HTTP body.")
@config_option("max_tokens_limit", "Largest max_tokens a request may ask for.")
@config_option("max_choices", "Largest n (choices per request) a request may ask for.")
@config_option("max_client_sockets", "Browser WebSocket connections open at once.")
@config_option("max_background", "Background responses (background: true) running at once.")
@store_options
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
@tls_options
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
    setup_logging(log_level)
    config = GatewayConfig(
        runner_token=runner_token or None,
        api_keys=gateway_start.client_keys(api_key, api_key_file),
        allowed_origins=frozenset(allow_origin),
        insecure=insecure,
        metrics_open=metrics_open,
        **settings,
    )
    gateway_start.start(
        config,
        log_level,
        tls=tls,
        tls_cert=tls_cert,
        tls_key=tls_key,
        name=gateway_name,
        advertise=advertise,
    )


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
@model_flags
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
    **flags: Any,
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
    setup_logging(log_level)
    options = options_of(models, flags)
    if max_kv_bytes is not None and max_kv_bytes <= 0:
        raise click.BadParameter("must be more than 0 bytes", param_hint="--max-kv-bytes")
    try:
        disk = startup.kv_disk(kv_disk)
    except StartupError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from exc
    member = None
    if hostfile is not None or local_group is not None or group_member:
        ctx = click.get_current_context()
        member = startup.runner_group(
            models,
            engine,
            max_kv_bytes,
            liveness_timeout,
            split=split,
            member=group_member,
            params=ctx.command.params,
            values=ctx.params,
            options=options,
        )
    try:
        run(
            run_runner(
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
                options=options,
            )
        )
    except StartupError as exc:  # from the model shelf, made once the runner starts
        raise click.BadParameter(str(exc), param_hint=exc.option) from exc


@main.command()
@config_option("host", "Address to listen on.")
@config_option("port", "Port to listen on.")
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
@tls_options
@store_options
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
    setup_logging(log_level)
    # Always a token: the local runner gets it through its environment, never argv.
    token = runner_token or secrets.token_urlsafe(24)
    config = GatewayConfig(host=host, port=port, runner_token=token, **store)
    serve_start(
        config, model, max_concurrent, log_level, tls=tls, tls_cert=tls_cert, tls_key=tls_key
    )


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
