"""The memory budget of a runner that loads models on demand (`--max-memory`)."""

from __future__ import annotations

import re

from protocol.frames import Hardware

DEFAULT_SHARE = 0.7
"""Of the GPU's working set (a Mac's recommended working set size) or, without one, of the
machine's memory: what loaded models' weights may take by default. The rest is for their
KV caches, the activations and everything else the machine runs."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*|%)\s*$", re.IGNORECASE)


PREFIX_SHARE = 0.1
"""Of the same base: what kept prompt caches may take in memory without `--max-kv-bytes`."""


def default_prefix_bytes(hardware: Hardware) -> int:
    """`PREFIX_SHARE` of what the models can live in."""
    return int(PREFIX_SHARE * (hardware.accelerator_limit_bytes or hardware.memory_bytes))


def default_budget(hardware: Hardware) -> int:
    """`DEFAULT_SHARE` of what the models can live in."""
    return int(DEFAULT_SHARE * (hardware.accelerator_limit_bytes or hardware.memory_bytes))


def parse_size(text: str, hardware: Hardware) -> int:
    """ "24GB", "20 GiB", "512MB", "80%" (of the default's base), or bytes. Raises ValueError
    with what is wrong."""
    return parse_bytes(text, hardware.accelerator_limit_bytes or hardware.memory_bytes)


def parse_bytes(text: str, whole: int, *, zero: bool = False) -> int:
    """ "24GB", "20 GiB", "512MB", "80%" (of `whole`), or bytes; with `zero`, 0 is allowed.
    Raises ValueError with what is wrong."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size: say e.g. 24GB, 20GiB, 70% or a byte count")
    number, unit = float(match[1]), match[2].lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"{text!r}: a share is more than 0% and at most 100%")
        return int(number / 100 * whole)
    if unit not in _UNITS:
        raise ValueError(f"{text!r}: unknown unit {match[2]!r} (B, KB, MB, GB, TB, KiB ... TiB)")
    size = int(number * _UNITS[unit])
    if size <= 0 and not (zero and number == 0):
        raise ValueError(f"{text!r}: the budget must be more than 0 bytes")
    return size
