"""A kept prompt cache, as both tiers of the prefix cache know it.

`Entry` is one prompt cache the prefix cache (`runner.engine.prefix_cache`) keeps, in memory,
on disk or both; `StoredEntry` is its files, as the disk store (`runner.engine.kv_store`)
writes and finds them. Plain records: the memory tier and the store both read and write them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs


@attrs.define(eq=False)
class StoredEntry:
    """An entry's files."""

    path: Path
    """The data file (`<digest>.safetensors`); its checksum is beside it."""
    tokens: tuple[int, ...]
    chain: tuple[str, ...]
    nbytes: int
    used: float
    """Its last use (seconds since the epoch, the file's modification time at start)."""


@attrs.define(eq=False)
class Entry:
    """One kept prompt cache: the tokens it holds and where it is (memory, disk or both)."""

    tokens: list[int]
    cache: list[Any] | None
    """The per-layer caches; None while it is on disk only."""
    nbytes: int
    """Bytes its caches take in memory (when there); what a file of it takes on disk is the
    store's business."""
    chain: tuple[str, ...] = ()
    """The gateway's prefix hashes of the request that made it."""
    used: int = 0
    """When it was last kept or reused, on the cache's clock."""
    hits: int = 0
    reused: int = 0
    """The longest prefix of it a later request reused (tokens)."""
    reused_chain: tuple[str, ...] = ()
    """The prefix hashes that part holds (those the reusing request shared with `chain`)."""
    head: bool = False
    """Cut back to what was reused of it: evicted only once no tail is left to cut."""
    stored: StoredEntry | None = None
    """Its file, once written."""
    storing: bool = False
    """A write of it is under way."""
    loading: bool = False
    """A read of it is under way."""
    blocks: list[int] = attrs.field(factory=list)
    """The chained hashes of its whole blocks (its index keys)."""

    @property
    def in_memory(self) -> bool:
        return self.cache is not None
