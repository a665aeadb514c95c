"""Make a Hugging Face model available locally, as mlx-lm would, with byte progress.

`fetch` returns a local directory unchanged; for a Hub id it calls
`huggingface_hub.snapshot_download` with mlx-lm's `DEFAULT_ALLOW_PATTERNS`, so the snapshot is
the one `mlx_lm.load` would have made, in the same cache. It first asks the cache alone
(`local_files_only`): a complete snapshot is returned with no network call (the hub client
checks completeness against the file listing it cached with the snapshot). `cached` is that
first step alone.

Progress: snapshot_download creates its byte bars with the `tqdm_class` it is given (named
"huggingface_hub.snapshot_download", the bytes written, and "....transfer", the bytes
received), and one bar that counts files. `_Bars` is that class: it counts, and never prints.
The total is the size of every file the snapshot holds, read from the file listing the client
caches before it downloads; files already cached count as done from the start.

The download runs on a worker thread while the caller's thread watches it: it reports
`Progress` to `on_progress` (at most every `REPORT_INTERVAL`, and once at the end, on the
caller's thread), logs a line to "runner.download" every `LOG_INTERVAL`, and gives up with
`DownloadError` when no byte arrived for `stall_timeout` seconds. The hub client's own timeouts
do not bound everything: the model info request has none (`HfApi.model_info` passes
`timeout=None`; against a server that accepts and never answers, snapshot_download waited
past 25 s, until the socket closed), and file bodies time out after HF_HUB_DOWNLOAD_TIMEOUT
(10 s) per read but are retried 5 times, resuming. A worker given up on stops at its next
byte; one blocked in a read ends with the client's timeouts, or never on the info request
against a silent server (it is a daemon thread).

Every failure is a `DownloadError` whose message says what to do; the client's error is its
__cause__.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import httpx2
from huggingface_hub import constants, get_cached_repo_tree, snapshot_download
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from runner.errors import DownloadError

log = logging.getLogger("runner.download")

REPORT_INTERVAL = 0.5
"""Seconds between two `on_progress` calls (the final one aside)."""

LOG_INTERVAL = 5.0
"""Seconds between two progress lines in the log."""

STALL_TIMEOUT = 60.0
"""Default seconds without a byte after which `fetch` gives up."""

CHUNK_SIZE = 1024 * 1024
"""The hub client reads bodies in chunks of this size (its own is 10 MiB), and reports each
one: at the default stall timeout, a link slower than 17 kB/s counts as stalled."""

WEIGHT_PATTERN = "model*.safetensors"
"""The weight files, as `mlx_lm.utils.load_model` globs them."""


@attrs.frozen
class Progress:
    """Where a download stands. `total_bytes` is the size of every file of the snapshot
    (0 until known); `done_bytes` counts those on disk, cached ones included."""

    model: str
    done_bytes: int
    total_bytes: int
    files_done: int
    files_total: int
    bytes_per_second: float
    """Received this run, averaged since the first byte (0.0 before it)."""
    finished: bool = False


def fetch(
    model_id: str,
    on_progress: Callable[[Progress], None] | None = None,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    stall_timeout: float = STALL_TIMEOUT,
    allow_patterns: list[str] | None = None,
) -> Path:
    """The local directory of `model_id`: a directory as is, else its Hub snapshot, downloaded
    when not complete in the cache (`cache_dir`, default HF_HUB_CACHE) from `endpoint`
    (default HF_ENDPOINT), with `token` (default HF_TOKEN). Raises `DownloadError`.

    `on_progress` is called on this thread, at most every `REPORT_INTERVAL` and once more
    with `finished=True`; never when the cache already had it all. `allow_patterns`: the
    files to fetch, mlx-lm's for a model by default (`runner.adapter.FILES` for an adapter).
    """
    local = Path(model_id)
    if local.exists():
        return local
    options: dict[str, Any] = {
        "revision": revision,
        "cache_dir": cache_dir,
        "endpoint": endpoint,
        "token": token,
        "allow_patterns": allow_patterns or _allow_patterns(),
    }
    try:
        path = snapshot_download(model_id, local_files_only=True, **options)
    except LocalEntryNotFoundError:
        pass  # not cached, or partly: download
    except Exception as exc:
        raise _translate(exc, model_id, revision, endpoint, cache_dir) from exc
    else:
        log.debug("%s: the cached snapshot %s", model_id, path)
        return Path(path)
    # Process-wide, read by the client on each file: a smaller chunk only means more updates.
    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, CHUNK_SIZE)
    watch = _Watch(model_id, revision, cache_dir, options["allow_patterns"], on_progress)
    worker = threading.Thread(
        target=watch.run,
        args=(lambda: snapshot_download(model_id, tqdm_class=watch.bars, **options),),
        name=f"runner.download {model_id}",
        daemon=True,
    )
    worker.start()
    watch.wait(stall_timeout)
    if watch.error is not None:
        error = watch.error
        raise _translate(error, model_id, revision, endpoint, cache_dir) from error
    if watch.stalled:
        raise DownloadError(
            f"downloading {model_id} stalled: no data from {_endpoint(endpoint)} for"
            f" {stall_timeout:g} s. Check the network connection and try again (files"
            " already complete are kept)."
        )
    assert watch.path is not None
    return Path(watch.path)


def cached(
    model_id: str,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    allow_patterns: list[str] | None = None,
) -> Path | None:
    """What `fetch` would return with no network call: a directory as is, a complete cached
    snapshot; else None (not cached, partly cached, or not a valid Hub id)."""
    if Path(model_id).exists():
        return Path(model_id)
    try:
        path = snapshot_download(
            model_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=True,
            allow_patterns=allow_patterns or _allow_patterns(),
        )
    except (LocalEntryNotFoundError, ValueError):  # ValueError: not a Hub id
        return None
    return Path(path)


def local_size(path: str | Path) -> int:
    """Bytes of the model's weight files (`model*.safetensors`) under `path`; 0 when none."""
    return sum(file.stat().st_size for file in Path(path).glob(WEIGHT_PATTERN))


def _allow_patterns() -> list[str]:
    """mlx-lm's: the files `mlx_lm.load` downloads."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS  # noqa: PLC0415  # mlx: slow, load if needed

    return list(DEFAULT_ALLOW_PATTERNS)


class _Bars(hf_tqdm):
    """snapshot_download's progress bars: they count for `_Watch` and never print.

    A subclass of huggingface_hub's tqdm, so that the client passes each bar's `name`.
    """

    watch: ClassVar[_Watch]
    monitor_interval = 0  # no tqdm monitor thread for bars that never print

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.bar_name: str | None = kwargs.get("name")
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # tqdm: no types
        self.watch.created(self)

    def update(self, n: float | None = 1) -> bool | None:
        self.watch.check()
        with self.watch.lock:
            self.n += n or 0
            self.watch.updated(self, int(n or 0))
        return None

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        self.watch.check()

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"rate": None}


class _Cancelled(Exception):
    """Raised on the worker thread at its next byte once `fetch` gave up on it."""


_BYTES_BAR = "huggingface_hub.snapshot_download"
_TRANSFER_BAR = _BYTES_BAR + ".transfer"


class _Watch:
    """One download's state, written by the worker's bars, read by the caller's thread."""

    def __init__(
        self,
        model: str,
        revision: str | None,
        cache_dir: str | Path | None,
        patterns: Sequence[str],
        on_progress: Callable[[Progress], None] | None,
    ) -> None:
        self.model = model
        self.revision = revision
        self.cache_dir = cache_dir
        self.patterns = patterns
        self.on_progress = on_progress
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.cancelled = False
        self.stalled = False
        self.path: str | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.last_byte = self.started
        self.first_byte: float | None = None
        self.received = 0
        self.cached_bytes = 0
        self.listed_total: int | None = None
        self.files_total = 0
        self.files_done = 0
        self.written: _Bars | None = None
        watch = self

        class Bars(_Bars):
            pass

        Bars.watch = watch
        self.bars = Bars

    # The worker's side.

    def run(self, download: Callable[[], str]) -> None:
        try:
            self.path = download()
        except BaseException as exc:  # handed to the caller's thread
            self.error = exc
        finally:
            self.done.set()

    def check(self) -> None:
        if self.cancelled:
            raise _Cancelled(self.model)

    def created(self, bar: _Bars) -> None:
        with self.lock:
            if bar.bar_name == _BYTES_BAR:
                self.written = bar
                self._read_listing()
            elif bar.bar_name is None:  # hf_thread_map's bar: files
                self.files_total = int(bar.total or 0)

    def updated(self, bar: _Bars, n: int) -> None:
        now = time.monotonic()
        if bar.bar_name == _TRANSFER_BAR:
            self.received += n
            if n > 0:
                self.last_byte = now
                if self.first_byte is None:
                    self.first_byte = now
        elif bar.bar_name is None:
            self.files_done += n
            self.last_byte = now

    def _read_listing(self) -> None:
        """Total and cached bytes from the listing snapshot_download has just cached."""
        try:
            files = get_cached_repo_tree(
                self.model, revision=self.revision, cache_dir=self.cache_dir
            )
        except (CachedRepoTreeNotFoundError, OSError, ValueError):
            return  # the bars' own total grows as files start
        # As snapshot_download's filter_repo_objects does with these patterns.
        wanted = {f.path for f in files if any(fnmatch.fnmatch(f.path, p) for p in self.patterns)}
        snapshot = _snapshot_dir(self.model, self.revision, self.cache_dir)
        self.listed_total = sum(f.size for f in files if f.path in wanted)
        if snapshot is not None:
            self.cached_bytes = sum(
                f.size for f in files if f.path in wanted and (snapshot / f.path).is_file()
            )

    # The caller's side.

    def progress(self, *, finished: bool = False) -> Progress:
        with self.lock:
            written = self.written
            done = self.cached_bytes + int(written.n if written is not None else 0)
            total = self.listed_total
            if total is None:
                total = int(written.total or 0) if written is not None else 0
            elapsed = time.monotonic() - (self.first_byte or time.monotonic())
            rate = self.received / elapsed if elapsed > 0 else 0.0
            files_done, files_total = self.files_done, self.files_total
        if finished:
            done, files_done = total, files_total
        return Progress(
            self.model, min(done, total), total, files_done, files_total, rate, finished
        )

    def wait(self, stall_timeout: float) -> None:
        """Until the worker ends or stalls, reporting and logging on the way. If this raises
        (`on_progress` did, or an interrupt), the worker stops at its next byte."""
        try:
            self._watch(stall_timeout)
        except BaseException:
            self.cancelled = True
            raise

    def _watch(self, stall_timeout: float) -> None:
        last_report: Progress | None = None
        last_log = 0.0
        while not self.done.wait(REPORT_INTERVAL):
            now = time.monotonic()
            progress = self.progress()
            if self.on_progress is not None and progress.total_bytes and progress != last_report:
                self.on_progress(progress)
                last_report = progress
            if progress.total_bytes and now - last_log >= LOG_INTERVAL:
                log.info("downloading %s: %s", self.model, _describe(progress))
                last_log = now
            if now - self.last_byte > stall_timeout:
                self.cancelled = self.stalled = True
                log.warning("downloading %s stalled at %s", self.model, _describe(progress))
                return
        if self.error is None:
            final = self.progress(finished=True)
            if self.on_progress is not None:
                self.on_progress(final)
            log.info(
                "downloaded %s: %s in %.1f s to %s",
                self.model,
                _size(final.total_bytes, final.total_bytes),
                time.monotonic() - self.started,
                self.path,
            )


def _describe(progress: Progress) -> str:
    """ "1.2 of 4.5 GB (27 %), 35 MB/s" """
    done, total = progress.done_bytes, progress.total_bytes
    if not total:
        return "no file listing yet"
    rate = _size(progress.bytes_per_second, progress.bytes_per_second)
    of = f"{_size(done, total, unit=False)} of {_size(total, total)}"
    return f"{of} ({100 * done // total} %), {rate}/s"


def _size(value: float, scale: float, *, unit: bool = True) -> str:
    """`value` in the unit that suits `scale`: GB, MB or kB, one decimal."""
    factor, name = next(
        ((factor, name) for factor, name in ((1e9, "GB"), (1e6, "MB")) if scale >= factor),
        (1e3, "kB"),
    )
    return f"{value / factor:.1f}" + (f" {name}" if unit else "")


def _snapshot_dir(model: str, revision: str | None, cache_dir: str | Path | None) -> Path | None:
    """The snapshot folder of `revision` (by the cached ref), if the ref is cached."""
    storage = Path(cache_dir or constants.HF_HUB_CACHE) / ("models--" + model.replace("/", "--"))
    ref = revision or constants.DEFAULT_REVISION
    ref_file = storage / "refs" / ref
    commit = ref_file.read_text().strip() if ref_file.is_file() else ref
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _endpoint(endpoint: str | None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


def _translate(
    exc: BaseException,
    model: str,
    revision: str | None,
    endpoint: str | None,
    cache_dir: str | Path | None,
) -> DownloadError:
    """The `DownloadError` a user can act on, for the hub client's error `exc`."""
    hub = _endpoint(endpoint)
    if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__  # "not cached, and the Hub could not say": why not
    if isinstance(exc, GatedRepoError):
        return DownloadError(
            f"{model} is a gated model: accept its license at {hub}/{model} while logged in,"
            " then set HF_TOKEN to an access token of that account"
            + (" (the token given has no access yet)." if _status(exc) == 403 else ".")
        )
    if isinstance(exc, RepositoryNotFoundError):
        return DownloadError(
            f"{model} was not found on {hub}: check the name (organization/model). If it is"
            " private or gated, set HF_TOKEN to an access token that can read it (and accept"
            " its license on the model's page)."
        )
    if isinstance(exc, RevisionNotFoundError):
        return DownloadError(
            f"{model} has no revision {revision or constants.DEFAULT_REVISION!r} on {hub}:"
            " name an existing branch, tag or commit."
        )
    if isinstance(exc, OfflineModeIsEnabled):
        return DownloadError(
            f"{model} is not in the cache ({cache_dir or constants.HF_HUB_CACHE}) and offline"
            " mode is on (HF_HUB_OFFLINE): unset HF_HUB_OFFLINE to download it, or copy its"
            " snapshot into the cache."
        )
    if isinstance(exc, httpx2.TransportError):
        return DownloadError(
            f"cannot reach the Hugging Face Hub at {hub} to download {model} ({exc}). Check"
            " the network connection, set HF_ENDPOINT to a reachable mirror, or set"
            " HF_HUB_OFFLINE=1 to use only models already in the cache."
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return DownloadError(
            f"no space left on the disk of the cache ({cache_dir or constants.HF_HUB_CACHE})"
            f" while downloading {model}: free some space, or set HF_HUB_CACHE to a directory"
            " on a larger disk."
        )
    if isinstance(exc, HFValidationError):
        return DownloadError(
            f"{model} is neither a directory here nor a Hugging Face model id"
            " (organization/model): check the path or the name."
        )
    if isinstance(exc, HfHubHTTPError):
        return DownloadError(f"the Hub at {hub} refused to serve {model}: {_first_line(exc)}")
    return DownloadError(f"downloading {model} failed: {type(exc).__name__}: {_first_line(exc)}")


def _status(exc: HfHubHTTPError) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
