"""What machine the runner is on, reported in its hello."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

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


def detect(backend: str) -> Hardware:
    return Hardware(
        chip=chip_name(),
        cpu_count=os.cpu_count() or 1,
        memory_bytes=psutil.virtual_memory().total,
        backend=backend,
        platform=f"{platform.system()} {platform.machine()}",
    )
