"""`orchard status`: the table from recorded `/v1/runners` JSON, exactly; a real gateway with a
fake runner shows it; an unreachable gateway and a refused API key are one line and exit 1."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from gateway.tls import certificate_fingerprint
from orchard import cli
from orchard.status import human_bytes, human_duration, render
from tests.support import UNIT, FakeRunner, Gateway, TlsGateway, free_port

# As the gateway answers it (gateway/admin.py: runner_info), three runners in three states.
RUNNERS: dict[str, Any] = {
    "object": "list",
    "queue_depth": 3,
    "data": [
        {
            "id": "runner-7",
            "name": "studio",
            "models": [
                {
                    "id": "mlx-community/Qwen3-4B-4bit",
                    "context_length": 40960,
                    "engine": "mlx-lm 0.32.2, mlx 0.32.4, gpu",
                }
            ],
            "max_concurrent": 8,
            "active": 2,
            "draining": False,
            "hardware": {
                "chip": "Apple M2 Ultra",
                "cpu_count": 24,
                "memory_bytes": 206158430208,
                "backend": "gpu",
                "platform": "Darwin arm64",
                "accelerator": "Apple M2 Ultra",
                "gpu_cores": 76,
                "accelerator_memory_bytes": 206158430208,
                "accelerator_limit_bytes": 154618822656,
            },
            "connected_since": 1764460000.5,
            "tokens_generated": 48210,
            "requests_served": 311,
            "tokens_after_cancel": 3,
            "kv_cache": {"bytes": 1610612736, "limit_bytes": 8589934592},
        },
        {
            "id": "runner-9",
            "name": "air",
            "models": [  # several, loaded on demand: one loaded, one downloading, one failed
                {"id": "orchard-demo", "context_length": 4096, "engine": None, "state": "loaded"},
                {
                    "id": "mlx-community/Qwen3-4B-4bit",
                    "context_length": None,
                    "engine": None,
                    "state": "loading",
                    "size_bytes": None,
                    "download": {"done_bytes": 1 << 30, "total_bytes": 3 << 30},
                    "error": None,
                },
                {
                    "id": "mlx-community/gone",
                    "context_length": None,
                    "engine": None,
                    "state": "loadable",
                    "size_bytes": None,
                    "download": None,
                    "error": "mlx-community/gone was not found on https://huggingface.co",
                },
            ],
            "memory_budget_bytes": 12 << 30,
            "max_concurrent": 4,
            "active": 0,
            "draining": True,
            "hardware": {
                "chip": "Apple M3",
                "cpu_count": 8,
                "memory_bytes": 17179869184,
                "backend": "gpu",
                "platform": "Darwin arm64",
            },
            "connected_since": 1764463590.0,
            "tokens_generated": 7,
            "requests_served": 1,
            "tokens_after_cancel": 0,
            "kv_cache": {"bytes": None, "limit_bytes": None},
        },
        {
            "id": "runner-12",
            "name": "linux-box",
            "models": [{"id": "orchard-demo", "context_length": 4096, "engine": None}],
            "max_concurrent": 16,
            "active": 16,
            "draining": False,
            "hardware": {
                "chip": "x86_64",
                "cpu_count": 2,
                "memory_bytes": 536870912,
                "backend": "cpu",
                "platform": "Linux x86_64",
                "accelerator": None,
                "gpu_cores": None,
                "accelerator_memory_bytes": None,
                "accelerator_limit_bytes": None,
            },
            "connected_since": 1764270000.0,
            "tokens_generated": 1234567,
            "requests_served": 9000,
            "tokens_after_cancel": 0,
            "kv_cache": {"bytes": 524288, "limit_bytes": None},
        },
    ],
}
MODELS: dict[str, Any] = {
    "object": "list",
    "data": [
        {
            "id": "mlx-community/Qwen3-4B-4bit",
            "object": "model",
            "created": 1,
            "owned_by": "orchard",
        },
        {"id": "orchard-demo", "object": "model", "created": 1, "owned_by": "orchard"},
    ],
}
NOW = 1764463600.0

TABLE = """\
NAME       MODELS                                                                                         HARDWARE                                                                   ACTIVE  DRAINING  TOKENS     CONNECTED    KV CACHE
studio     mlx-community/Qwen3-4B-4bit                                                                    Apple M2 Ultra, 24 cpu, 192.0 GiB, gpu, 76 gpu cores, gpu limit 144.0 GiB  2/8     no        48,210     59m 59s ago  1.5 GiB / 8.0 GiB
air        orchard-demo, mlx-community/Qwen3-4B-4bit (downloading 33%), mlx-community/gone (load failed)  Apple M3, 8 cpu, 16.0 GiB, gpu                                             0/4     yes       7          10s ago      -
linux-box  orchard-demo                                                                                   x86_64, 2 cpu, 512.0 MiB, cpu                                              16/16   no        1,234,567  2d 05h ago   512.0 KiB / unbounded

3 runners; models: mlx-community/Qwen3-4B-4bit, orchard-demo; queue depth: 3
"""  # noqa: E501 -- the table as printed


def test_the_table_from_recorded_runners() -> None:
    assert render(RUNNERS, MODELS, NOW) == TABLE


def test_an_empty_pool() -> None:
    empty = {"object": "list", "data": [], "queue_depth": 0}
    assert render(empty, {"object": "list", "data": []}, NOW) == (
        "no runners connected\n\n0 runners; models: none; queue depth: 0\n"
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 << 30, "5.0 GiB"), (3 << 40, "3.0 TiB")],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-3, "0s"),
        (45.9, "45s"),
        (725, "12m 05s"),
        (3 * 3600 + 420, "3h 07m"),
        (2 * 86400 + 4 * 3600, "2d 04h"),
    ],
)
def test_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def status(*args: str) -> Result:
    return CliRunner().invoke(
        cli.main, ["status", *args], env={"ORCHARD_GATEWAY": None, "ORCHARD_API_KEY": None}
    )


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway("--api-key", "status-key")
    yield gw
    gw.stop()


async def test_a_live_gateway_shows_its_runner_and_model(gateway: Gateway) -> None:
    fake = await FakeRunner.connect(gateway, models=("status-model",), name="status-runner")
    try:
        result = await asyncio.to_thread(
            status, "--gateway", gateway.base, "--api-key", "status-key"
        )
    finally:
        await fake.close()
    assert result.exit_code == 0, result.output
    header, line = result.output.splitlines()[:2]
    assert header.startswith("NAME ")
    assert line.startswith("status-runner ")
    assert "status-model" in line
    assert "test chip, 1 cpu, 1.0 GiB, none" in line
    assert "0/4" in line
    assert result.output.endswith("1 runner; models: status-model; queue depth: 0\n")


def test_a_missing_api_key_is_one_line_and_exit_1(gateway: Gateway) -> None:
    result = status("--gateway", gateway.base)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: the gateway at {gateway.base} refused the API key (HTTP 401): "
        "pass --api-key or set ORCHARD_API_KEY\n"
    )


def test_an_unreachable_gateway_is_one_line_and_exit_1() -> None:
    base = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = status("--gateway", base)
    assert result.exit_code == 1
    [line] = result.output.splitlines()
    assert line.startswith(f"Error: cannot reach the gateway at {base}: ")
    assert "Traceback" not in result.output


def test_a_url_that_is_not_http_is_refused() -> None:
    result = status("--gateway", "file:///etc/passwd")
    assert result.exit_code == 1
    assert result.output == (
        "Error: the gateway URL must start with http:// or https://, not 'file:///etc/passwd'\n"
    )


@pytest.mark.parametrize(("args", "seconds"), [(["--watch"], 2.0), (["--watch", "0.5"], 0.5)])
def test_watch_redraws_every_n_seconds_until_ctrl_c(
    monkeypatch: pytest.MonkeyPatch, args: list[str], seconds: float
) -> None:
    import time

    from orchard import status as status_module

    def fetch(base: str, path: str, api_key: str | None) -> dict[str, Any]:
        return {"/v1/runners": RUNNERS, "/v1/models": MODELS}[path]

    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_module, "fetch", fetch)
    monkeypatch.setattr(time, "sleep", sleep)
    result = status(*args)
    assert result.exit_code == 0, result.output
    assert slept == [seconds, seconds]
    assert result.output.count(f"http://127.0.0.1:8000  every {seconds:g} s  ") == 2
    assert result.output.count("\nstudio ") == 2


def test_a_gateway_certificate_not_trusted_yet_gets_its_authority_and_the_line_to_trust_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    gateway = TlsGateway(tmp_path / "tls")
    try:
        result = status("--gateway", gateway.base)
        assert result.exit_code == 1
        shown = certificate_fingerprint(gateway.ca)
        assert f"own certificate authority, SHA-256 fingerprint {shown}." in result.output
        line = result.output.split("trust the authority: ", 1)[1].strip()
        # The line works: it saves the authority, and status then trusts it.
        subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True, timeout=30 * UNIT)
        assert (tmp_path / "orchard-ca.pem").read_text().strip() == gateway.ca.read_text().strip()
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "orchard-ca.pem"))
        trusted = status("--gateway", gateway.base)
        assert trusted.exit_code == 0, trusted.output
        assert trusted.output.endswith("0 runners; models: none; queue depth: 0\n")
    finally:
        gateway.process.stop()
