"""`orchard serve`: gateway plus a local runner process, banner, clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.support import REPO, UNIT, free_port, wait_until


def ask_once(client: openai.OpenAI) -> None:
    """One short chat completion, through serve's own runner (greedy: the built-in model
    never ends an ordinary answer by itself)."""
    with client:
        done = client.chat.completions.create(
            model="orchard-demo",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
        )
    assert done.choices[0].finish_reason == "length"
    assert done.choices[0].message.content
    assert done.usage is not None
    assert done.usage.completion_tokens == 4


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_runs_both_and_stops_cleanly(demo_model_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchard",
                "serve",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:

            def runner_up() -> bool:
                try:
                    return len(httpx.get(f"{base}/v1/runners", timeout=1).json()["data"]) == 1
                except httpx.HTTPError:
                    return False

            wait_until(runner_up, 60, "serve's local runner")
            children = psutil.Process(proc.pid).children()
            assert len(children) == 1  # the runner is its own process
            assert "runner" in children[0].cmdline()
            ask_once(openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0))

            proc.send_signal(sig)
            assert proc.wait(15 * UNIT) == 0
            assert not children[0].is_running() or children[0].status() == psutil.STATUS_ZOMBIE
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        out = log.read().decode()
    assert f"Orchard is up at {base}/v1" in out
    assert f'OpenAI(base_url="{base}/v1"' in out


def test_serve_off_loopback_serves_https_to_clients_and_its_own_runner(
    demo_model_path: Path, tmp_path: Path
) -> None:
    port = free_port()
    base = f"https://127.0.0.1:{port}"
    cert = tmp_path / "ca.pem"  # the authority: what clients trust, and the banner names
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchard", "serve", "--host", "0.0.0.0", "--port", str(port)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "ORCHARD_TLS_DIR": str(tmp_path)},
        )
        try:

            def runner_up() -> bool:
                try:
                    trusted = ssl.create_default_context(cafile=cert)
                    got = httpx.get(f"{base}/v1/runners", timeout=1, verify=trusted)
                except (httpx.HTTPError, OSError):
                    return False  # not up yet (or the certificate not written yet)
                return len(got.json()["data"]) == 1

            wait_until(runner_up, 60, "serve's local runner, over TLS")
            # The local runner pinned the authority as any runner does (the gateway proved
            # it knows the token) and serves over WSS.
            trusted = ssl.create_default_context(cafile=cert)
            http_client = openai.DefaultHttpxClient(verify=trusted)
            ask_once(
                openai.OpenAI(
                    base_url=f"{base}/v1", api_key="unused", max_retries=0, http_client=http_client
                )
            )
            with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15 * UNIT) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        out = log.read().decode()
    assert f"Orchard is up at {base}/v1" in out
    assert f"    export SSL_CERT_FILE={cert}\n" in out
