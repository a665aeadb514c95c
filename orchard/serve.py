"""`orchard serve`: the gateway and one local runner, a separate process it supervises.

Signals stop the runner first, then the server; either one ending stops the other. Nothing
is restarted: a gateway that cannot start (its `--store` file in use, damaged) is one error
and exit status 2 before the runner is started, as for `orchard gateway`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from gateway.config import GatewayConfig
from orchard.gateway_start import (
    check_exposure,
    close,
    log_tls,
    refusing_to_start,
    server,
    with_tls,
)
from orchard.running import run


def start(
    config: GatewayConfig,
    model: str,
    max_concurrent: int,
    log_level: str,
    *,
    tls: bool | None,
    tls_cert: Path | None,
    tls_key: Path | None,
) -> None:
    """Check the exposure, settle TLS, then serve the gateway and its runner until stopped."""
    check_exposure(config)
    config, files = with_tls(config, tls, tls_cert, tls_key)
    refusing_to_start(lambda: run(supervise(config, model, max_concurrent, log_level, files)))


async def supervise(
    config: GatewayConfig,
    model: str,
    max_concurrent: int,
    log_level: str,
    tls: tuple[Path, Path] | None = None,
) -> None:
    served = server(config, log_level, tls)
    log_tls(config, tls)
    # Signals stop the runner first, then the server. The local runner pins the certificate
    # authority as any runner does (the gateway proves it knows the token).
    # (0.0.0.0 is checked for here, not bound.)
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host  # noqa: S104
    base = f"{'https' if tls else 'http'}://{local}:{config.port}"
    runner_proc: subprocess.Popen[bytes] | None = None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    server_task = asyncio.create_task(served.serve())
    # Polling uvicorn's `started` flag, which has no event to wait for.
    while not served.started and not server_task.done():  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    if server_task.done():
        close(served)
        server_task.result()
        return
    runner_proc = subprocess.Popen(  # noqa: S603, ASYNC220  # our own interpreter, our own runner
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
    print(_banner(base, model, _trust(tls), config.tls_fingerprint), flush=True)  # noqa: T201
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
    served.should_exit = True
    try:
        await server_task
    finally:
        close(served)
    stopper.cancel()


def _trust(tls: tuple[Path, Path] | None) -> Path | None:
    """The file clients trust for the certificate served, if any."""
    if tls is None:
        return None
    from gateway.tls import trust_file  # noqa: PLC0415  # cryptography: only when serving TLS

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
