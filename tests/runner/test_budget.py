"""The memory budget of a runner loading models on demand (`--max-memory`)."""

from __future__ import annotations

import re

import attrs
import pytest

from protocol.frames import Hardware
from runner.budget import DEFAULT_SHARE, default_budget, parse_size

MAC = Hardware("Apple M2 Pro", 12, 32 * 2**30, "gpu", "macOS", accelerator_limit_bytes=24 * 2**30)
LINUX = Hardware("x86_64", 2, 24 * 2**30, "cpu", "Linux")


def test_the_default_is_a_share_of_the_gpus_working_set_or_of_the_memory() -> None:
    assert DEFAULT_SHARE == 0.7
    assert default_budget(MAC) == int(0.7 * 24 * 2**30)
    assert default_budget(LINUX) == int(0.7 * 24 * 2**30)
    assert default_budget(attrs.evolve(LINUX, memory_bytes=10**9)) == 7 * 10**8


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GB", 24 * 10**9),
        ("20GiB", 20 * 2**30),
        ("20 gib", 20 * 2**30),
        ("1.5TB", 15 * 10**11),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("64k", 64_000),
        ("123456", 123_456),
        ("100B", 100),
        ("50%", 12 * 2**30),  # of the Mac's working set
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text, MAC) == size


def test_a_share_is_of_the_memory_without_a_gpu_working_set() -> None:
    assert parse_size("25%", LINUX) == 6 * 2**30


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "'' is not a size: say e.g. 24GB, 20GiB, 70% or a byte count"),
        ("lots", "'lots' is not a size: say e.g. 24GB, 20GiB, 70% or a byte count"),
        ("-1GB", "'-1GB' is not a size: say e.g. 24GB, 20GiB, 70% or a byte count"),
        ("12 parsecs", "'12 parsecs': unknown unit 'parsecs' (B, KB, MB, GB, TB, KiB ... TiB)"),
        ("0%", "'0%': a share is more than 0% and at most 100%"),
        ("101%", "'101%': a share is more than 0% and at most 100%"),
        ("0", "'0': the budget must be more than 0 bytes"),
        ("0.1B", "'0.1B': the budget must be more than 0 bytes"),
    ],
)
def test_what_is_not_a_size_is_said_clearly(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_size(text, MAC)
