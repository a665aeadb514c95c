"""What machine the runner is on, reported in its hello: the CPU, the memory, the MLX backend
and, computing on a GPU, the accelerator (its name, cores, memory and the working-set limit
MLX recommends), from MLX's device information and, on a Mac, the IORegistry."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import attrs
import psutil

from protocol.frames import Hardware


def chip_name() -> str:
    """Apple chip or CPU model name, e.g. "Apple M2 Pro"."""
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["/usr/sbin/sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=2,
                check=True,
            )
            return out.stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            return platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mlx_backend() -> str:
    """The device MLX computes on here: "gpu" (Metal, CUDA) or "cpu"."""
    import mlx.core as mx  # here, not at the top: the scripted engine runs without MLX

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def accelerator_info() -> dict[str, Any]:
    """MLX's information on the device it computes on (`mx.device_info()`): on Metal its
    name, architecture, memory size and recommended working set; on CUDA what MLX reports;
    on the CPU backend the CPU's name only."""
    import mlx.core as mx

    try:
        return dict(mx.device_info())
    except Exception:  # an MLX without it, or no device: report what psutil knows
        return {}


def gpu_core_count() -> int | None:
    """Apple silicon's GPU cores, from the IORegistry (`ioreg`, fast; `system_profiler`
    takes seconds); None elsewhere or when it cannot be read."""
    if platform.system() != "Darwin":
        return None
    try:
        out = subprocess.run(
            ["/usr/sbin/ioreg", "-rc", "AGXAccelerator", "-d", "1"],
            capture_output=True,
            text=True,
            timeout=2,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'"gpu-core-count"\s*=\s*(\d+)', out)
    return int(found.group(1)) if found else None


def detect(backend: str) -> Hardware:
    """This machine; with backend "gpu", the accelerator as MLX sees it."""
    hardware = Hardware(
        chip=chip_name(),
        cpu_count=os.cpu_count() or 1,
        memory_bytes=psutil.virtual_memory().total,
        backend=backend,
        platform=f"{platform.system()} {platform.machine()}",
    )
    if backend != "gpu":
        return hardware
    return with_accelerator(hardware, accelerator_info(), gpu_core_count())


def with_accelerator(hardware: Hardware, info: dict[str, Any], cores: int | None) -> Hardware:
    """`hardware` with the accelerator's fields from MLX's device information `info`."""

    def size(key: str) -> int | None:
        value = info.get(key)
        return int(value) if isinstance(value, int) and value > 0 else None

    name = info.get("device_name") or info.get("architecture")
    return attrs.evolve(
        hardware,
        accelerator=str(name) if name else None,
        gpu_cores=cores,
        accelerator_memory_bytes=size("memory_size"),
        accelerator_limit_bytes=size("max_recommended_working_set_size"),
    )
