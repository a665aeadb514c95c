"""The disk tier of the prefix cache: prompt caches as files, kept across restarts and unloads.

One `KvStore` per runner, under `~/.cache/orchard/kv/` (or `$ORCHARD_CACHE_DIR/kv/`), bounded
by `--kv-disk` bytes across every model, least recently used out. Each model's files are in a
directory named by its identity (`model_identity`: its id and a hash of its weights' and
tokenizer's files), so files of a model whose weights changed under the same id are never
read, and age out.

An entry is two files: `<digest>.safetensors`, mlx-lm's `save_prompt_cache` format (the
caches' arrays, with the tokens it holds, the model's identity and the gateway's prefix hashes
in its metadata), and `<digest>.sha256`, the first file's SHA-256, written last: an entry
without it (a write cut short) or whose data does not hash to it (corrupt, truncated) is
deleted, never loaded; so is one whose metadata names another model or other tokens.

Writes, reads and deletions run on the store's own threads (a writer, a reader), never on
the generation thread: what they find comes back through each model's `completions`, which
its engine drains between steps (`PrefixCache.stored`, `loaded`, `forget_file`). A disk that
is full or that cannot be written logs one warning, and the store goes on memory-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from runner.budget import parse_bytes
from runner.engine.cache_entry import Entry, StoredEntry

log = logging.getLogger("runner.engine.kv_store")

FORMAT = "orchard-kv-1"
DATA, SUM = ".safetensors", ".sha256"
_CHUNK = 8 * 1024 * 1024
_HEADER_MAX = 64 * 1024 * 1024
"""A safetensors header bigger than this is not one of ours."""
_CACHE_CLASSES = frozenset({"KVCache", "QuantizedKVCache"})
"""The cache classes a file may name (what `prefix_cache` keeps and can view)."""
STALE_STAGING = 3600.0
"""Seconds after which a file being written is taken for a write cut short."""
DEFAULT_SHARE = 0.10
DEFAULT_CAP = 64 * 2**30
"""`--kv-disk` by default: this share of the free disk space, at most DEFAULT_CAP bytes."""


def default_budget(root: Path) -> int:
    """`--kv-disk`'s default for a store under `root`: 10 % of its disk's free space, at most
    64 GiB."""
    return int(min(_free_bytes(root) * DEFAULT_SHARE, DEFAULT_CAP))


def parse_disk_size(text: str, root: Path) -> int:
    """`--kv-disk`: a size (24GB, 20GiB, bytes), a share of the free disk under `root` (10%),
    or 0 (off). Raises ValueError with what is wrong."""
    return parse_bytes(text, _free_bytes(root), zero=True)


def _free_bytes(root: Path) -> int:
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 0


def model_identity(model_id: str, directory: str | os.PathLike[str]) -> str:
    """A name for `model_id`'s files as they are in `directory`: the id made safe for a path,
    and a hash of the configuration and tokenizer files' contents and of each weight file's
    name, size, modification time and (in a Hub snapshot) the blob it links to."""
    digest = hashlib.sha256(model_id.encode())
    root = Path(directory)
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"\0{path.name}\0{stat.st_size}".encode())
        if path.suffix in (".json", ".txt", ".model", ".jinja", ".tiktoken"):
            digest.update(path.read_bytes())
        else:
            target = os.path.realpath(path)
            digest.update(f"\0{stat.st_mtime_ns}\0{Path(target).name}".encode())
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id).strip("._")[-64:] or "model"
    return f"{safe}-{digest.hexdigest()[:16]}"


@attrs.define
class Saved:
    """A write ended: `stored` is the file, or None when it failed."""

    entry: Entry
    stored: StoredEntry | None


@attrs.define
class Loaded:
    """A read ended: the caches, or None when the file was bad (it is deleted)."""

    entry: Entry
    cache: list[Any] | None


@attrs.define
class Deleted:
    """The store deleted a file to stay within its budget."""

    stored: StoredEntry


Completion = Saved | Loaded | Deleted


class KvStore:
    """Prompt caches on disk (see the module docstring), shared by a runner's models."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.enabled = max_bytes > 0
        self._lock = threading.Lock()
        self._models: dict[str, ModelStore] = {}
        self._files: dict[Path, StoredEntry | int] = {}
        """Every data file under the root and its size (ours: the StoredEntry), for the
        budget."""
        self._writes: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._reads: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._warned = False
        self.bytes_written = 0
        self.bytes_read = 0
        if self.enabled:
            try:
                root.mkdir(parents=True, exist_ok=True)
                self._scan_sizes()
            except OSError as exc:
                self._disable(f"cannot use {root}: {exc}")

    @property
    def nbytes(self) -> int:
        """Bytes of the files under the root."""
        with self._lock:
            return sum(_size(f) for f in self._files.values())

    def for_model(self, identity: str, wake: Callable[[], None] | None = None) -> ModelStore:
        """The files of the model named `identity` (`model_identity`), for one engine (a
        model loaded again gets a new one: what the last one wrote is found on disk);
        `wake` is called from the store's threads when a completion waits for it."""
        store = ModelStore(self, identity, wake)
        self._models[identity] = store  # the latest: told when the budget deletes a file
        if self.enabled:
            store.scan()
        return store

    def close(self) -> None:
        """Finish the writes queued, then stop the threads."""
        for q in (self._writes, self._reads):
            q.put(None)
        for thread in self._threads:
            thread.join(60)
        self._threads.clear()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every write queued so far is done (tests, and before an unload)."""
        done = threading.Event()
        self._submit(self._writes, done.set)
        if self._threads:
            done.wait(timeout)

    # --- for ModelStore ---------------------------------------------------------------

    def _submit(self, q: queue.Queue[Callable[[], None] | None], work: Callable[[], None]) -> None:
        if not self._threads:
            for name, source in (("kv-writer", self._writes), ("kv-reader", self._reads)):
                thread = threading.Thread(target=self._work, args=(source,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        q.put(work)

    def _work(self, source: queue.Queue[Callable[[], None] | None]) -> None:
        # MLX runs a thread's work on a stream of that thread's: this one's own.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        try:
            while (work := source.get()) is not None:
                try:
                    work()
                except Exception:
                    log.exception("disk cache: unexpected failure")
        finally:
            # MLX 0.32 aborts at exit unless a thread that used MLX destroys its streams.
            mx.clear_streams()

    def _disable(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("disk KV cache off, going on in memory only: %s", why)
        self.enabled = False

    def _scan_sizes(self) -> None:
        for path in self.root.glob(f"*/*{DATA}"):
            with contextlib.suppress(OSError):
                self._files[path] = path.stat().st_size

    def _track(self, stored: StoredEntry) -> None:
        with self._lock:
            self._files[stored.path] = stored

    def _untrack(self, path: Path) -> None:
        with self._lock:
            self._files.pop(path, None)

    def _fit(self) -> None:
        """Delete the least recently used files until the budget holds (writer thread)."""
        while True:
            with self._lock:
                total = sum(_size(f) for f in self._files.values())
                if total <= self.max_bytes or not self._files:
                    return
                path, found = min(self._files.items(), key=lambda item: _used(*item))
                del self._files[path]
            _remove(path)
            if isinstance(found, StoredEntry):
                owner = self._models.get(path.parent.name)
                if owner is not None:
                    owner.complete(Deleted(found))


class ModelStore:
    """One model's files in a `KvStore`; every method but `completions` is for the
    generation thread, and returns at once."""

    def __init__(self, store: KvStore, identity: str, wake: Callable[[], None] | None) -> None:
        self.store = store
        self.identity = identity
        self.directory = store.root / identity
        self.wake = wake
        self._found: list[StoredEntry] = []
        self._done: list[Completion] = []
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    def scan(self) -> None:
        """Find this model's entries on disk; incomplete or foreign files are deleted."""
        directory = self.directory
        if not directory.is_dir():
            return
        now = time.time()
        for path in directory.iterdir():
            if path.name.startswith("."):
                # A write under way (another runner's, sharing this directory) or one cut
                # short long ago.
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > STALE_STAGING:
                        _remove(path)
                continue
            if path.suffix not in (DATA, SUM):
                _remove(path)  # nothing of ours
                continue
            if path.suffix == SUM:
                if not path.with_suffix(DATA).exists():
                    _remove(path)
                continue
            stored = self._read_header(path)
            if stored is None:
                log.info("disk cache: discarding %s (incomplete or not this model's)", path.name)
                _remove(path)
                _remove(path.with_suffix(SUM))
                self.store._untrack(path)
                continue
            self.store._track(stored)
            self._found.append(stored)

    def entries(self) -> list[StoredEntry]:
        """The entries found on disk when the model was loaded."""
        found, self._found = self._found, []
        return found

    def save(self, entry: Entry) -> None:
        """Write `entry` (its tokens, caches and prefix hashes as they are now) to disk; a
        `Saved` completion follows."""
        if not self.enabled or entry.cache is None:
            self.complete(Saved(entry, None))
            return
        tokens, cache, chain = tuple(entry.tokens), list(entry.cache), entry.chain
        # The writer reads these arrays: they must be computed here, on their own thread.
        mx.eval([c.state for c in cache])
        self.store._submit(self.store._writes, lambda: self._write(entry, tokens, cache, chain))

    def load(self, entry: Entry) -> None:
        """Read `entry`'s caches back from its file; a `Loaded` completion follows."""
        stored = entry.stored
        if stored is None:
            self.complete(Loaded(entry, None))
            return
        self.store._submit(self.store._reads, lambda: self._read(entry, stored))

    def delete(self, stored: StoredEntry) -> None:
        """Delete an entry's files."""
        self.store._untrack(stored.path)
        self.store._submit(self.store._writes, lambda: _remove_entry(stored.path))

    def completions(self) -> list[Completion]:
        """What the store's threads finished for this model since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def complete(self, done: Completion) -> None:
        with self._lock:
            self._done.append(done)
        wake = self.wake
        if wake is not None:
            wake()

    # --- the store's threads ----------------------------------------------------------

    def _write(
        self, entry: Entry, tokens: tuple[int, ...], cache: list[Any], chain: tuple[str, ...]
    ) -> None:
        if not self.enabled:
            self.complete(Saved(entry, None))
            return
        save_prompt_cache: Any = mlx_cache.save_prompt_cache  # unannotated in mlx-lm
        digest = hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:32]
        path = self.directory / f"{digest}{DATA}"
        staging = self.directory / f".{digest}.{os.getpid()}.{threading.get_ident()}{DATA}"
        metadata = {
            "orchard_format": FORMAT,
            "orchard_model": self.identity,
            "orchard_tokens": json.dumps(tokens, separators=(",", ":")),
            "orchard_chain": json.dumps(chain),
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            save_prompt_cache(str(staging), cache, metadata)
            checksum = _file_sha256(staging)
            os.replace(staging, path)
            sum_staging = staging.with_suffix(SUM)
            sum_staging.write_text(checksum + "\n")
            os.replace(sum_staging, path.with_suffix(SUM))
        except OSError as exc:
            _remove(staging)
            _remove(staging.with_suffix(SUM))
            self.store._disable(f"writing {path}: {exc}")
            self.complete(Saved(entry, None))
            return
        except Exception:
            _remove(staging)
            log.exception("disk cache: writing %s failed", path.name)
            self.complete(Saved(entry, None))
            return
        size = path.stat().st_size
        self.store.bytes_written += size
        stored = StoredEntry(path, tokens, chain, size, time.time())
        self.store._track(stored)
        self.complete(Saved(entry, stored))
        self.store._fit()

    def _read(self, entry: Entry, stored: StoredEntry) -> None:
        cache = self._verified(stored)
        if cache is None:
            log.warning("disk cache: %s is corrupt or not this model's: deleted", stored.path.name)
            self.store._untrack(stored.path)
            _remove_entry(stored.path)
        else:
            stored.used = time.time()
            with contextlib.suppress(OSError):
                os.utime(stored.path)
            self.store.bytes_read += stored.nbytes
        self.complete(Loaded(entry, cache))

    def _verified(self, stored: StoredEntry) -> list[Any] | None:
        """The caches in `stored`'s file, if it is whole, ours and what it says it is."""
        load_prompt_cache: Any = mlx_cache.load_prompt_cache  # unannotated in mlx-lm
        path = stored.path
        try:
            expected = path.with_suffix(SUM).read_text().strip()
            if _file_sha256(path) != expected:
                return None
            header = _header(path)
            if header is None or not set(_classes(header)) <= _CACHE_CLASSES:
                return None
            cache, metadata = load_prompt_cache(str(path), return_metadata=True)
        except Exception:
            return None
        if (
            metadata.get("orchard_format") != FORMAT
            or metadata.get("orchard_model") != self.identity
            or tuple(json.loads(metadata.get("orchard_tokens", "[]"))) != stored.tokens
        ):
            return None
        held = getattr(cache[0], "offset", None) if cache else None
        if held != len(stored.tokens):
            return None
        mx.eval([c.state for c in cache])
        return list(cache)

    def _read_header(self, path: Path) -> StoredEntry | None:
        """What `path`'s header says, if it is one of this model's whole entries."""
        if not path.with_suffix(SUM).exists():
            return None
        header = _header(path)
        if header is None:
            return None
        meta = header.get("__metadata__", {})
        found = {key.split(".", 1)[-1]: value for key, value in meta.items()}
        if found.get("orchard_format") != FORMAT or found.get("orchard_model") != self.identity:
            return None
        try:
            tokens = tuple(int(t) for t in json.loads(found["orchard_tokens"]))
            chain = tuple(str(h) for h in json.loads(found.get("orchard_chain", "[]")))
            stat = path.stat()
        except (KeyError, ValueError, TypeError, OSError):
            return None
        if not tokens:
            return None
        return StoredEntry(path, tokens, chain, stat.st_size, stat.st_mtime)


def _header(path: Path) -> dict[str, Any] | None:
    """A safetensors file's header, or None when it has none that parses."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if not 0 < length <= _HEADER_MAX:
                return None
            header = json.loads(file.read(length))
    except (OSError, struct.error, ValueError):
        return None
    return header if isinstance(header, dict) else None


def _classes(header: dict[str, Any]) -> Sequence[str]:
    """The cache classes a header's metadata names (mlx-lm's `1.<i>` keys)."""
    meta = header.get("__metadata__", {})
    return [v for k, v in meta.items() if re.fullmatch(r"1\.\d+", k)]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _size(found: StoredEntry | int) -> int:
    return found.nbytes if isinstance(found, StoredEntry) else found


def _used(path: Path, found: StoredEntry | int) -> float:
    if isinstance(found, StoredEntry):
        return found.used
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _remove_entry(path: Path) -> None:
    _remove(path.with_suffix(SUM))
    _remove(path)
