"""The stores' SQLite database (`--store PATH`): what the bounded stores write through to, so
that stored chat completions and responses outlive a restart of the gateway.

One file (by default `store.sqlite3` in the state directory, gateway.config.state_directory),
in WAL mode with `synchronous=NORMAL`: a commit appends to the log and does not wait for the
disk, so a write costs tens of microseconds (docs/operations.md has the figure). A process
that dies loses nothing; a machine that loses power may lose its last commits, never the
file's consistency. One table holds every store's entries, told apart by `store`, in the
order they were put (its rowid): the key, the value (gateway.stores.codec), its size as the
store counted it, and when it expires, on the wall clock.

Everything runs on the gateway's event-loop thread, one short statement at a time (each its
own transaction), so concurrent requests never interleave inside one; no statement waits
on another process, as no other process may open the file: an advisory lock
(`fcntl.flock` on `PATH.lock`, with the holder's pid in it) is taken first. The kernel
releases it when its process ends, however it ends, so a gateway killed with SIGKILL never
leaves a stale lock behind; and unlike SQLite's `locking_mode=EXCLUSIVE` it says who holds
the file, at open rather than at the first write, and leaves the file readable by the
`sqlite3` shell for a look or a backup while the gateway runs.

Opening checks everything once (the directory, the lock, the file is SQLite and whole, a
schema this gateway knows, every row read) and raises `StoreUnavailable` naming the file and
what to do. Afterwards a write that fails (a full disk) is logged, the entry stays in memory,
and the gateway goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any, Generic, TypeVar

from gateway.config import STORE_FILE
from gateway.errors import StoreUnavailable
from gateway.stores.bounded import Row
from gateway.stores.codec import Codec

log = logging.getLogger("gateway.stores")

V = TypeVar("V")

SCHEMA_VERSION = 1
"""`PRAGMA user_version` of the files this gateway writes; a larger one is refused."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    store TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    nbytes INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (store, key)
)
"""


def lock_path(path: Path) -> Path:
    """The advisory lock next to a database."""
    return path.with_name(path.name + ".lock")


class Database:
    """One open `--store` file, locked for this gateway (see the module docstring)."""

    def __init__(self, path: Path, connection: sqlite3.Connection, lock: int) -> None:
        self.path = path
        self._connection = connection
        self._lock = lock
        self._failing = False
        """A write failed and no write has succeeded since (logged once)."""

    @classmethod
    def open(cls, path: Path) -> Database:
        """Open (made if need be) and check `path`; `StoreUnavailable` says why it cannot."""
        path = path.expanduser().absolute()
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            problem = f"cannot be made (its directory {path.parent}: {_reason(exc)})"
            raise StoreUnavailable(path, problem) from exc
        if path.is_dir():
            raise StoreUnavailable(path, f"is a directory (a file is meant: {path / STORE_FILE}?)")
        lock = _lock(path)
        try:
            return cls(path, _connect(path), lock)
        except BaseException:
            os.close(lock)
            raise

    def table(self, store: str, cls: type[V]) -> Table[V]:
        """The backing of the store named `store`, whose entries are `cls`."""
        return Table(self, store, Codec(cls))

    def close(self) -> None:
        """Close the file (checkpointing the log into it) and release the lock; again: nothing."""
        if self._lock < 0:
            return
        with contextlib.suppress(sqlite3.Error):
            self._connection.close()
        os.close(self._lock)
        self._lock = -1

    def read(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        """Rows of a query made at open; `StoreUnavailable` when the file cannot give them."""
        try:
            return self._connection.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreUnavailable(self.path, _problem(exc)) from exc

    def write(self, sql: str, *params: object) -> None:
        """One statement, committed; a failure is logged (once until a write succeeds again)
        and the caller goes on: the entry stays in memory."""
        try:
            self._connection.execute(sql, params)
        except sqlite3.Error as exc:
            if not self._failing:
                log.error(
                    "could not write to the store %s (%s): entries are kept in memory only "
                    "until writes succeed again",
                    self.path,
                    exc,
                )
            self._failing = True
            return
        if self._failing:
            log.warning("writing to the store %s again", self.path)
            self._failing = False


class Table(Generic[V]):
    """One store's rows in a `Database`: a `gateway.stores.bounded.Backing`."""

    def __init__(self, database: Database, store: str, codec: Codec[V]) -> None:
        self.database = database
        self.store = store
        self.codec = codec

    def load(self) -> list[Row[str, V]]:
        """The store's rows, oldest put first. A row whose value does not decode (written by
        an incompatible version) is dropped, with a warning."""
        rows: list[Row[str, V]] = []
        undecodable: list[str] = []
        query = "SELECT key, value, nbytes, expires_at FROM entries WHERE store = ? ORDER BY rowid"
        for key, value, nbytes, expires_at in self.database.read(query, self.store):
            try:
                decoded = self.codec.decode(value)
            except Exception:  # cattrs, orjson or base64: whatever the reason, it is unreadable
                undecodable.append(key)
                continue
            rows.append(Row(key, decoded, nbytes, float(expires_at)))
        if undecodable:
            log.warning(
                "store %s: %d %s entries could not be read back and were dropped",
                self.database.path,
                len(undecodable),
                self.store,
            )
            for key in undecodable:
                self.delete(key)
        return rows

    def put(self, key: str, value: V, nbytes: int, expires_at: float) -> None:
        # REPLACE deletes the old row and inserts a new one: a new rowid, the newest.
        self.database.write(
            "INSERT OR REPLACE INTO entries (store, key, value, nbytes, expires_at) "
            "VALUES (?, ?, ?, ?, ?)",
            *(self.store, key, self.codec.encode(value), nbytes, expires_at),
        )

    def update(self, key: str, value: V, nbytes: int) -> None:
        self.database.write(
            "UPDATE entries SET value = ?, nbytes = ? WHERE store = ? AND key = ?",
            *(self.codec.encode(value), nbytes, self.store, key),
        )

    def delete(self, key: str) -> None:
        self.database.write("DELETE FROM entries WHERE store = ? AND key = ?", self.store, key)


def _lock(path: Path) -> int:
    """Take the advisory lock next to `path` (its file descriptor), or say who holds it."""
    held = lock_path(path)
    try:
        fd = os.open(held, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StoreUnavailable(path, f"cannot be locked ({held}: {_reason(exc)})") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreUnavailable(
            path, f"is in use by another gateway (pid {holder}; its lock is {held})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _connect(path: Path) -> sqlite3.Connection:
    """The file opened, checked, in WAL mode, with the schema made."""
    try:
        # Made by us first, readable by its owner only: it holds prompts and answers.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    except OSError as exc:
        raise StoreUnavailable(path, f"cannot be opened: {_reason(exc)}") from exc
    # The event loop's thread uses it, one statement at a time; autocommit.
    try:
        connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise StoreUnavailable(path, _problem(exc)) from exc
    try:
        _prepare(connection, path)
    except BaseException:
        connection.close()
        raise
    return connection


def _prepare(connection: sqlite3.Connection, path: Path) -> None:
    try:
        [(mode,)] = connection.execute("PRAGMA journal_mode = WAL").fetchall()
        connection.execute("PRAGMA synchronous = NORMAL")
        [(version,)] = connection.execute("PRAGMA user_version").fetchall()
        [(check,)] = connection.execute("PRAGMA quick_check(1)").fetchall()
    except sqlite3.Error as exc:
        raise StoreUnavailable(path, _problem(exc)) from exc
    if check != "ok":
        raise StoreUnavailable(path, f"is damaged ({check}); move it aside to start afresh")
    if version > SCHEMA_VERSION:
        raise StoreUnavailable(
            path,
            f"was written by a newer Orchard (schema {version}; this one knows {SCHEMA_VERSION})",
        )
    if mode != "wal":  # a file system without shared memory: still correct, slower
        log.warning("store %s: journal mode %s, not WAL", path, mode)
    try:
        connection.execute(_SCHEMA)
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except sqlite3.Error as exc:
        raise StoreUnavailable(path, _problem(exc)) from exc


def _problem(exc: sqlite3.Error) -> str:
    """What is wrong with the file, in the words of the error."""
    name = getattr(exc, "sqlite_errorname", "")
    if name == "SQLITE_NOTADB":
        return "is not a SQLite database (another kind of file, or damaged)"
    if name == "SQLITE_CORRUPT" or "malformed" in str(exc):
        return f"is damaged ({exc}); move it aside to start afresh"
    if name in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return f"is locked by another program ({exc})"
    return f"cannot be used ({exc})"


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)
