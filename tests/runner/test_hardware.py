"""The hardware report: the machine, and on a GPU what MLX (and on a Mac the IORegistry) says
of the accelerator."""

from __future__ import annotations

import platform
import subprocess
from typing import Any

import pytest

from protocol.codec import decode_runner_frame, encode
from protocol.frames import PROTOCOL_VERSION, Hardware, Hello
from runner import hardware
from runner.hardware import detect, with_accelerator

# mx.device_info() on an M2 Pro (MLX 0.32, Metal backend).
METAL_INFO = {
    "architecture": "applegpu_g14s",
    "device_name": "Apple M2 Pro",
    "max_buffer_length": 17179869184,
    "max_recommended_working_set_size": 22906503168,
    "memory_size": 34359738368,
    "resource_limit": 499000,
}
IOREG = """+-o AGXAcceleratorG14X  <class AGXAcceleratorG14X, id 0x100000263>
    {
      "IOClass" = "AGXAcceleratorG14X"
      "gpu-core-count" = 19
      "model" = "Apple M2 Pro"
    }
"""


def test_the_cpu_backend_reports_the_machine_only() -> None:
    found = detect("cpu")
    assert found.cpu_count >= 1
    assert found.memory_bytes > 0
    assert found.backend == "cpu"
    assert (found.accelerator, found.gpu_cores) == (None, None)
    assert (found.accelerator_memory_bytes, found.accelerator_limit_bytes) == (None, None)


def test_a_metal_gpu_is_reported_from_mlx_device_info() -> None:
    base = Hardware("Apple M2 Pro", 12, 34359738368, "gpu", "Darwin arm64")
    found = with_accelerator(base, METAL_INFO, 19)
    assert found == Hardware(
        "Apple M2 Pro",
        12,
        34359738368,
        "gpu",
        "Darwin arm64",
        accelerator="Apple M2 Pro",
        gpu_cores=19,
        accelerator_memory_bytes=34359738368,
        accelerator_limit_bytes=22906503168,
    )


def test_a_device_without_a_name_or_sizes_reports_what_it_has() -> None:
    base = Hardware("AMD EPYC", 16, 1 << 37, "gpu", "Linux x86_64")
    found = with_accelerator(base, {"architecture": "sm_90", "memory_size": 0}, None)
    assert (found.accelerator, found.accelerator_memory_bytes) == ("sm_90", None)
    assert with_accelerator(base, {}, None) == base  # every accelerator field stays None


def test_gpu_cores_come_from_ioreg_on_a_mac(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def run(args: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, IOREG, "")

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(subprocess, "run", run)
    assert hardware.gpu_core_count() == 19
    assert calls == [["/usr/sbin/ioreg", "-rc", "AGXAccelerator", "-d", "1"]]

    monkeypatch.setattr(
        subprocess, "run", lambda args, **_: subprocess.CompletedProcess(args, 0, "", "")
    )
    assert hardware.gpu_core_count() is None
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert hardware.gpu_core_count() is None


def test_the_accelerator_travels_in_the_hello_and_is_left_off_when_unknown() -> None:
    gpu = with_accelerator(
        Hardware("Apple M2 Pro", 12, 1 << 35, "gpu", "Darwin arm64"), METAL_INFO, 19
    )
    hello = Hello(PROTOCOL_VERSION, "studio", (), 4, gpu)
    assert decode_runner_frame(encode(hello)) == hello
    plain = Hello(PROTOCOL_VERSION, "box", (), 4, detect("cpu"))
    assert b"accelerator" not in encode(plain)
    assert b"gpu_cores" not in encode(plain)
