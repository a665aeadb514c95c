"""runner.download against a real local HTTP server, spoken to by the real huggingface_hub."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub.file_download
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

import runner.download
from runner.download import Progress, cached, fetch, local_size
from runner.errors import DownloadError
from tests.fakehub import FakeHub, Repo
from tests.support import REPO, UNIT, free_port, wait_until

MODEL = "org/demo"
GATED = "org/gated"
WEIGHTS = "model.safetensors"


@pytest.fixture
def hub(demo_model_path: Path) -> Iterator[FakeHub]:
    """The built-in model served as `MODEL`, and as the gated `GATED`."""
    with FakeHub() as hub:
        hub.add(MODEL, demo_model_path)
        hub.add(GATED, demo_model_path, gated=True)
        yield hub


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A hub cache of this test's own, never the user's."""
    return tmp_path / "hub"


def snapshot(cache: Path, repo: Repo) -> Path:
    return cache / "models--org--demo" / "snapshots" / repo.sha


def test_a_download_reports_byte_progress_logs_it_and_loads(
    hub: FakeHub,
    cache: Path,
    demo_model_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlx_lm

    caplog.set_level(logging.INFO, logger="runner.download")
    monkeypatch.setattr(runner.download, "LOG_INTERVAL", 0.2)  # a line per report or so
    repo = hub.repos[MODEL]
    hub.bytes_per_second = repo.size / (1.5 * UNIT)
    reports: list[Progress] = []
    path = fetch(MODEL, reports.append, cache_dir=cache, endpoint=hub.url)

    assert path == snapshot(cache, repo)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == repo.files
    assert sorted(hub.body_requests()) == sorted(
        f"/{MODEL}/resolve/{repo.sha}/{name}" for name in repo.files
    )
    assert len(reports) >= 2, reports
    assert {r.total_bytes for r in reports} == {repo.size}
    done = [r.done_bytes for r in reports]
    assert done == sorted(done)
    assert any(0 < d < repo.size for d in done), done
    assert reports[-1] == Progress(
        MODEL, repo.size, repo.size, 4, 4, reports[-1].bytes_per_second, finished=True
    )
    assert not any(r.finished for r in reports[:-1])
    assert 0 < reports[-1].bytes_per_second < 2 * hub.bytes_per_second

    lines = [r.getMessage() for r in caplog.records if r.name == "runner.download"]
    progress_line = re.compile(
        r"downloading org/demo: \d\.\d of 1\.9 MB \(\d{1,3} %\), \d+\.\d (kB|MB)/s"
    )
    assert lines[:-1], lines
    assert all(progress_line.fullmatch(line) for line in lines[:-1]), lines
    assert re.fullmatch(rf"downloaded org/demo: 1\.9 MB in \d\.\d s to {path}", lines[-1])

    assert local_size(path) == len(repo.files[WEIGHTS]) == local_size(demo_model_path)
    loaded: Any = mlx_lm.load(str(path))
    assert loaded[1].encode("hello") == mlx_lm.load(str(demo_model_path))[1].encode("hello")


def test_a_complete_snapshot_is_served_from_the_cache_with_no_request(
    hub: FakeHub, cache: Path
) -> None:
    path = fetch(MODEL, cache_dir=cache, endpoint=hub.url)
    hub.requests.clear()
    reports: list[Progress] = []
    started = time.monotonic()
    assert fetch(MODEL, reports.append, cache_dir=cache, endpoint=hub.url) == path
    assert time.monotonic() - started < 0.5 * UNIT
    assert (hub.requests, reports) == ([], [])


def test_a_partial_snapshot_downloads_only_what_is_missing(hub: FakeHub, cache: Path) -> None:
    repo = hub.repos[MODEL]
    path = fetch(MODEL, cache_dir=cache, endpoint=hub.url)
    (path / WEIGHTS).resolve().unlink()
    (path / WEIGHTS).unlink()
    hub.requests.clear()
    hub.bytes_per_second = len(repo.files[WEIGHTS]) / (0.8 * UNIT)
    reports: list[Progress] = []

    assert fetch(MODEL, reports.append, cache_dir=cache, endpoint=hub.url) == path

    assert hub.body_requests() == [f"/{MODEL}/resolve/{repo.sha}/{WEIGHTS}"]
    assert (path / WEIGHTS).read_bytes() == repo.files[WEIGHTS]
    # The files already there count as done from the first report on.
    assert reports[0].done_bytes >= repo.size - len(repo.files[WEIGHTS])
    assert reports[-1].done_bytes == reports[-1].total_bytes == repo.size


def test_cached_makes_no_request(hub: FakeHub, cache: Path, demo_model_path: Path) -> None:
    assert cached(MODEL, cache_dir=cache) is None
    path = fetch(MODEL, cache_dir=cache, endpoint=hub.url)
    hub.requests.clear()
    assert cached(MODEL, cache_dir=cache) == path
    assert cached(str(demo_model_path)) == demo_model_path
    assert cached("not/a/hub id", cache_dir=cache) is None
    (path / WEIGHTS).unlink()
    assert cached(MODEL, cache_dir=cache) is None  # partial
    assert hub.requests == []


def test_a_dropped_connection_resumes_with_a_range_and_counts_each_byte_once(
    hub: FakeHub, cache: Path
) -> None:
    repo = hub.repos[MODEL]
    hub.drop_after = 1536 * 1024  # into the weights, the only file that long
    reports: list[Progress] = []
    path = fetch(MODEL, reports.append, cache_dir=cache, endpoint=hub.url)
    # The client keeps what it wrote: whole chunks, the half chunk it held is read again.
    assert hub.ranges == [f"bytes={runner.download.CHUNK_SIZE}-"]
    assert (path / WEIGHTS).read_bytes() == repo.files[WEIGHTS]
    done = [r.done_bytes for r in reports]
    assert done == sorted(done)
    assert {r.total_bytes for r in reports} == {repo.size}
    assert done[-1] == repo.size


def test_a_revision_by_commit(hub: FakeHub, cache: Path) -> None:
    repo = hub.repos[MODEL]
    path = fetch(MODEL, revision=repo.sha, cache_dir=cache, endpoint=hub.url)
    assert path == snapshot(cache, repo)
    hub.requests.clear()
    assert fetch(MODEL, revision=repo.sha, cache_dir=cache, endpoint=hub.url) == path
    assert hub.requests == []


def test_a_local_directory_is_returned_as_is(hub: FakeHub, demo_model_path: Path) -> None:
    assert fetch(str(demo_model_path), endpoint=hub.url) == demo_model_path
    assert hub.requests == []


def test_an_unknown_model(hub: FakeHub, cache: Path) -> None:
    with pytest.raises(DownloadError) as raised:
        fetch("org/nope", cache_dir=cache, endpoint=hub.url)
    assert str(raised.value) == (
        f"org/nope was not found on {hub.url}: check the name (organization/model). If it is"
        " private or gated, set HF_TOKEN to an access token that can read it (and accept its"
        " license on the model's page)."
    )
    assert isinstance(raised.value.__cause__, RepositoryNotFoundError)


def test_an_unknown_revision(hub: FakeHub, cache: Path) -> None:
    with pytest.raises(DownloadError) as raised:
        fetch(MODEL, revision="v9", cache_dir=cache, endpoint=hub.url)
    assert str(raised.value) == (
        f"org/demo has no revision 'v9' on {hub.url}: name an existing branch, tag or commit."
    )


@pytest.mark.parametrize(
    ("token", "status", "tail"),
    [(False, 401, "."), ("hf_no_access", 403, " (the token given has no access yet).")],
)
def test_a_gated_model(
    hub: FakeHub, cache: Path, token: str | bool, status: int, tail: str
) -> None:
    with pytest.raises(DownloadError) as raised:
        fetch(GATED, cache_dir=cache, endpoint=hub.url, token=token)
    assert str(raised.value) == (
        f"org/gated is a gated model: accept its license at {hub.url}/org/gated while logged in,"
        f" then set HF_TOKEN to an access token of that account{tail}"
    )
    cause = raised.value.__cause__
    assert isinstance(cause, GatedRepoError)
    assert cause.response.status_code == status
    assert hub.body_requests() == []


def test_an_unreachable_hub(cache: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # closed
    started = time.monotonic()
    with pytest.raises(DownloadError) as raised:
        fetch(MODEL, cache_dir=cache, endpoint=endpoint)
    assert time.monotonic() - started < 2 * UNIT
    assert str(raised.value) == (
        f"cannot reach the Hugging Face Hub at {endpoint} to download org/demo ([Errno 111]"
        " Connection refused). Check the network connection, set HF_ENDPOINT to a reachable"
        " mirror, or set HF_HUB_OFFLINE=1 to use only models already in the cache."
    )


def test_offline_mode(hub: FakeHub, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DownloadError) as raised:
        fetch(MODEL, cache_dir=cache, endpoint=hub.url)
    assert str(raised.value) == (
        f"org/demo is not in the cache ({cache}) and offline mode is on (HF_HUB_OFFLINE): unset"
        " HF_HUB_OFFLINE to download it, or copy its snapshot into the cache."
    )
    assert hub.requests == []

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    path = fetch(MODEL, cache_dir=cache, endpoint=hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert fetch(MODEL, cache_dir=cache, endpoint=hub.url) == path


def test_a_stalled_download_gives_up_and_its_worker_ends(hub: FakeHub, cache: Path) -> None:
    hub.stall_after = 256 * 1024  # into the weights, the only file that long
    reports: list[Progress] = []
    started = time.monotonic()
    with pytest.raises(DownloadError) as raised:
        fetch(MODEL, reports.append, cache_dir=cache, endpoint=hub.url, stall_timeout=1 * UNIT)
    assert 1 * UNIT <= time.monotonic() - started < 3 * UNIT
    assert str(raised.value) == (
        f"downloading org/demo stalled: no data from {hub.url} for {1 * UNIT:g} s. Check the"
        " network connection and try again (files already complete are kept)."
    )
    assert reports
    assert reports[-1].done_bytes < reports[-1].total_bytes

    assert worker_alive()
    hub.release()  # the next bytes reach the worker, which stops there
    wait_until(lambda: not worker_alive(), 2, "the download's worker to end")
    assert not (snapshot(cache, hub.repos[MODEL]) / WEIGHTS).exists()


def worker_alive() -> bool:
    return any(t.name == f"runner.download {MODEL}" for t in threading.enumerate())


def test_a_silent_hub_is_given_up_on(cache: Path) -> None:
    """huggingface_hub asks for the model info with no timeout at all: a server that accepts
    the connection and never answers would hold snapshot_download forever."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts; nobody reads or answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(DownloadError) as raised:
            fetch(MODEL, cache_dir=cache, endpoint=endpoint, stall_timeout=1 * UNIT)
        assert 1 * UNIT <= time.monotonic() - started < 3 * UNIT
        assert str(raised.value).startswith(
            f"downloading org/demo stalled: no data from {endpoint} for {1 * UNIT:g} s."
        )
        assert worker_alive()
    wait_until(lambda: not worker_alive(), 2, "the download's worker to end")


def test_an_error_in_on_progress_stops_the_download(hub: FakeHub, cache: Path) -> None:
    hub.bytes_per_second = hub.repos[MODEL].size / (3 * UNIT)

    def on_progress(progress: Progress) -> None:
        raise RuntimeError("the caller's own")

    with pytest.raises(RuntimeError, match="the caller's own"):
        fetch(MODEL, on_progress, cache_dir=cache, endpoint=hub.url)
    wait_until(lambda: not worker_alive(), 2, "the download's worker to end")
    assert not (snapshot(cache, hub.repos[MODEL]) / WEIGHTS).exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk(hub: FakeHub, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The client writes each file to blobs/<etag>.<uuid4 prefix>.incomplete: fix the uuid and
    # make that file /dev/full, where every write fails with ENOSPC.
    fixed = uuid.UUID(int=0)
    monkeypatch.setattr(huggingface_hub.file_download, "uuid", SimpleNamespace(uuid4=lambda: fixed))
    blobs = cache / "models--org--demo" / "blobs"
    blobs.mkdir(parents=True)
    etag = hub.repos[MODEL].oid(WEIGHTS)
    (blobs / f"{etag}.{fixed.hex[:8]}.incomplete").symlink_to("/dev/full")
    with pytest.raises(DownloadError) as raised:
        fetch(MODEL, cache_dir=cache, endpoint=hub.url)
    assert str(raised.value) == (
        f"no space left on the disk of the cache ({cache}) while downloading org/demo: free some"
        " space, or set HF_HUB_CACHE to a directory on a larger disk."
    )


def test_hf_endpoint_and_hf_hub_cache_in_a_subprocess(hub: FakeHub, cache: Path) -> None:
    """The client reads HF_ENDPOINT at import: a runner started with it downloads from there."""
    code = "from runner.download import fetch; print(fetch('org/demo'))"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot(cache, hub.repos[MODEL]))


def test_local_size_counts_the_weights_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert local_size(tmp_path) == 0
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 3)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 4)
    (tmp_path / "adapters.safetensors").write_bytes(b"x" * 5)
    assert local_size(tmp_path) == 7
