"""The bounds the gateway's in-memory stores share (gateway.stores.chat, gateway.stores.responses).

`BoundedStore` keeps values by key, oldest stored first, bounded three ways: at most
`max_entries` of them and `max_bytes` together (past either, the oldest stored is dropped
first, the one just stored or resized last of all), each for `ttl` seconds from when it was
stored. The caller says what a value weighs; the store only counts. Every read first drops
what has expired.

A store may write through to a `Backing` (gateway.stores.sqlite's table): every value put,
changed or dropped is written there too, and a store made over it again starts with what it
holds, oldest first, the expired dropped, then within its bounds (which may have shrunk since).
Reads never touch it. A persisted expiry is on the wall clock (`time.time`, the default clock
of a store with a backing), as it must outlive the process; the others keep `time.monotonic`.

The store takes its clock as an argument, so that tests drive expiry without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

import attrs

from gateway.config import GatewayConfig

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@attrs.frozen
class Row(Generic[K, V]):
    """One value as a backing holds it."""

    key: K
    value: V
    nbytes: int
    expires_at: float
    """When it goes, on the wall clock."""


class Backing(Protocol[K, V]):
    """Where a store writes through to (see the module docstring). It keeps its keys in the
    order they were put; a write it cannot make it logs, and the store goes on in memory."""

    def load(self) -> Iterable[Row[K, V]]:
        """What it holds, oldest put first."""
        ...

    def put(self, key: K, value: V, nbytes: int, expires_at: float) -> None:
        """Keep `value` under `key` as the newest, replacing what `key` held."""
        ...

    def update(self, key: K, value: V, nbytes: int) -> None:
        """`key`'s value changed: keep the new one, in the old one's place and expiry."""
        ...

    def delete(self, key: K) -> None: ...


class Tables(Protocol):
    """A database of backings, one per store (gateway.stores.sqlite's `Database`)."""

    def table(self, store: str, cls: type[V]) -> Backing[str, V]: ...


@attrs.define
class _Slot(Generic[V]):
    value: V
    nbytes: int
    expires: float
    """When it goes, on the store's clock."""


class BoundedStore(Generic[K, V]):
    """Values by key within a count, a byte budget and a TTL (see the module docstring)."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] | None = None,
        *,
        backing: Backing[K, V] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock or (time.monotonic if backing is None else time.time)
        self._slots: dict[K, _Slot[V]] = {}
        """Oldest stored first: the order of eviction and of expiry."""
        self.nbytes = 0
        """What everything stored weighs, as its callers measured it."""
        self._backing = backing
        if backing is not None:
            self._load(backing, backing.load())

    @property
    def enabled(self) -> bool:
        """False when the limits leave no room: nothing can be stored."""
        return self.max_entries > 0 and self.max_bytes > 0 and self.ttl > 0

    def __len__(self) -> int:
        self.expire()
        return len(self._slots)

    def put(self, key: K, value: V, nbytes: int) -> bool:
        """Store `value` as the newest (replacing what `key` held); False, storing nothing,
        when it alone is over the byte budget."""
        self.expire()
        if nbytes > self.max_bytes:
            return False
        self._drop(key)  # the backing's put replaces it there
        expires = self._clock() + self.ttl
        self._slots[key] = _Slot(value, nbytes, expires)
        self.nbytes += nbytes
        if self._backing is not None:
            self._backing.put(key, value, nbytes, expires)
        self._shrink(key)
        return True

    def get(self, key: K) -> V | None:
        """The value stored under `key`, unless it is not there (or has expired)."""
        self.expire()
        slot = self._slots.get(key)
        return None if slot is None else slot.value

    def resize(self, key: K, nbytes: int) -> None:
        """`key`'s value (changed in place) now weighs `nbytes`: it keeps its place and its
        expiry, and the others make room for it, oldest first."""
        slot = self._slots[key]
        self.nbytes += nbytes - slot.nbytes
        slot.nbytes = nbytes
        if self._backing is not None:
            self._backing.update(key, slot.value, nbytes)
        self._shrink(key)

    def pop(self, key: K) -> V | None:
        """Drop `key`'s value; it, or None when there was none."""
        slot = self._drop(key)
        if slot is None:
            return None
        if self._backing is not None:
            self._backing.delete(key)
        return slot.value

    def _drop(self, key: K) -> _Slot[V] | None:
        """Drop `key`'s value from memory only."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self.nbytes -= slot.nbytes
        return slot

    def values(self) -> list[V]:
        """Every value not expired, oldest stored first."""
        self.expire()
        return [slot.value for slot in self._slots.values()]

    def expire(self) -> None:
        """Drop what has expired."""
        now = self._clock()
        slots = self._slots
        # The TTL is the same for all, so the oldest stored is the first to expire.
        while slots:
            key, oldest = next(iter(slots.items()))
            if oldest.expires > now:
                return
            self.pop(key)

    def _load(self, backing: Backing[K, V], rows: Iterable[Row[K, V]]) -> None:
        """Start with what `backing` holds (see the module docstring). Each row expires when
        it was to, but no later than the TTL from now (a TTL that shrank applies to what is
        kept) nor than any row stored after it: the oldest stays the first to go."""
        now = self._clock()
        latest = now + self.ttl
        kept: list[tuple[Row[K, V], float]] = []
        for row in reversed(list(rows)):
            latest = min(latest, row.expires_at)
            if latest <= now:
                backing.delete(row.key)
            else:
                kept.append((row, latest))
        for row, expires in reversed(kept):
            self._slots[row.key] = _Slot(row.value, row.nbytes, expires)
            self.nbytes += row.nbytes
        self._shrink(None)

    def _shrink(self, spare: K | None) -> None:
        """Drop the oldest until the store is within its bounds, `spare` last of all."""
        slots = self._slots
        while len(slots) > self.max_entries or self.nbytes > self.max_bytes:
            victim = next((key for key in slots if key != spare), None)
            if victim is None:
                return
            self.pop(victim)


class BoundedAnswers(Generic[V]):
    """What the stores of finished answers (chat completions, responses) share: their entries
    in one `BoundedStore` keyed by id, within the gateway's `--store-*` limits, and what they
    say of those limits and of their size."""

    STORE: ClassVar[str]
    """Its name in a database of stores (`Tables`)."""
    VALUE: ClassVar[type[Any]]
    """The class of its entries, `V` (what a database encodes)."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] | None = None,
        *,
        backing: Backing[str, V] | None = None,
    ) -> None:
        self._entries: BoundedStore[str, V] = BoundedStore(
            max_entries, max_bytes, ttl, clock, backing=backing
        )

    @classmethod
    def from_config(cls, config: GatewayConfig, tables: Tables | None = None) -> Self:
        """The store within `config`'s limits; written through to its table in `tables`
        (the `--store` database) when given, else in memory only."""
        backing = None if tables is None else tables.table(cls.STORE, cls.VALUE)
        return cls(
            config.store_max_completions,
            config.store_max_bytes,
            config.store_ttl,
            backing=backing,
        )

    @property
    def max_entries(self) -> int:
        return self._entries.max_entries

    @property
    def max_bytes(self) -> int:
        return self._entries.max_bytes

    @property
    def ttl(self) -> float:
        return self._entries.ttl

    @property
    def nbytes(self) -> int:
        """The size of everything stored, as counted when it was stored."""
        return self._entries.nbytes

    @property
    def enabled(self) -> bool:
        """False when the limits leave no room: nothing is stored, and what needs a store
        (`store: true`, `previous_response_id`) is refused."""
        return self._entries.enabled

    def __len__(self) -> int:
        return len(self._entries)
