"""A fake Hugging Face Hub: a real local HTTP server that serves directories as model repos.

The real `huggingface_hub` client (2.x) downloads from it when pointed at its `url` with
`endpoint=` (or the HF_ENDPOINT environment variable, which the client reads at import, so only
a subprocess gets it that way). It answers exactly what `snapshot_download` and `hf_hub_download`
ask, as the Hub does for plain (non-xet) files:

    GET  /api/models/{repo}/revision/{rev}     model info: {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}         the file listing (`?recursive=`), one page
    HEAD /{repo}/resolve/{rev}/{path}          X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{path}          the body; `Range: bytes=N-` answers 206

`rev` is "main" or the commit hash. Errors carry the Hub's `X-Error-Code` header, which the
client turns into its exceptions: `RepoNotFound` (404), `RevisionNotFound` (404),
`EntryNotFound` (404), and `GatedRepo` on a gated repo's files (401 without a token, 403 with
one), while its metadata stays public, as on the Hub.

Knobs: `bytes_per_second` throttles file bodies (so progress can be watched), `stall_after`
stops sending every body after that many bytes until `release()` (or `close`), which then sends
the rest, and `drop_after` closes the connection after that many bytes of the next body that
long (once; the client resumes with a Range request). `requests` records every request as
(method, path), `ranges` the Range header of every ranged GET.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

import attrs

_CHUNK = 16 * 1024


@attrs.frozen
class Repo:
    """One served repo: its files (path in the repo -> bytes) at one commit on "main"."""

    repo_id: str
    files: dict[str, bytes]
    gated: bool
    sha: str

    @classmethod
    def from_directory(cls, repo_id: str, directory: Path, *, gated: bool = False) -> Repo:
        files = {
            path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*"))
            if path.is_file()
        }
        digest = hashlib.sha1(repo_id.encode())
        for name, data in files.items():
            digest.update(name.encode() + b"\0" + hashlib.sha1(data).digest())
        return cls(repo_id, files, gated, digest.hexdigest())

    def oid(self, path: str) -> str:
        """The file's git blob id, which the Hub also sends as its ETag."""
        data = self.files[path]
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    @property
    def size(self) -> int:
        return sum(len(data) for data in self.files.values())


class FakeHub:
    """The server; a context manager that starts it on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.bytes_per_second: float | None = None
        self.stall_after: int | None = None
        self.drop_after: int | None = None
        self.ranges: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._connections: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add(self, repo_id: str, directory: Path, *, gated: bool = False) -> Repo:
        """Serve `directory` as the model repo `repo_id` ("org/name")."""
        repo = Repo.from_directory(repo_id, directory, gated=gated)
        self.repos[repo_id] = repo
        return repo

    @property
    def url(self) -> str:
        assert self._server is not None, "the fake hub is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def body_requests(self) -> list[str]:
        """The paths of the file bodies asked for (GET .../resolve/...)."""
        with self._lock:
            return [
                path for method, path in self.requests if method == "GET" and "/resolve/" in path
            ]

    def release(self) -> None:
        """Let stalled bodies go on (and bodies from now on never stall)."""
        self._released.set()

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fakehub", kwargs={"poll_interval": 0.05}
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
        assert self._server is not None
        assert self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        with self._lock:  # the client keeps connections alive: end their handler threads
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    # The handler's side.

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def _pace(self, sent: int, started: float) -> None:
        """Sleep so that `sent` bytes took at least the throttle's time."""
        if self.bytes_per_second:
            delay = started + sent / self.bytes_per_second - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def _drop(self, sent: int) -> bool:
        """Whether to drop the connection now (once)."""
        with self._lock:
            if self.drop_after is not None and sent >= self.drop_after:
                self.drop_after = None
                return True
            return False

    def _stall(self, sent: int) -> None:
        if self.stall_after is not None and sent >= self.stall_after:
            self._released.wait()


def runner_against(hub: FakeHub, home: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`orchard runner FLAGS` (no gateway listening) downloading from `hub` into `home`, run
    to its end: for what it prints when a download fails at start."""
    from tests.support import UNIT

    return subprocess.run(
        [
            *(sys.executable, "-m", "orchard", "runner", "--gateway", "http://127.0.0.1:9"),
            *flags,
            *("--log-level", "warning"),
        ],
        capture_output=True,
        text=True,
        timeout=120 * UNIT,
        check=False,
        env={**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home)},
    )


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.fake._lock:
            self.fake._connections.add(self.connection)

    def finish(self) -> None:
        with self.fake._lock:
            self.fake._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: `FakeHub.requests` records the requests."""

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def _route(self, method: str) -> None:
        path = unquote(urlsplit(self.path).path)
        self.fake._record(method, path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and method == "GET" and len(parts) in (4, 6):
            self._api(parts[2:])
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo("/".join(parts[:2]))
            if repo is not None and self._revision(repo, parts[3]):
                self._resolve(method, repo, "/".join(parts[4:]))
        else:
            self._error(404, "", "Not Found")

    def _api(self, parts: list[str]) -> None:
        """org/name, or org/name/{revision,tree}/rev."""
        repo = self._repo("/".join(parts[:2]))
        if repo is None:
            return
        if len(parts) == 2:
            self._json(200, self._info(repo))
        elif parts[2] not in ("revision", "tree"):
            self._error(404, "", "Not Found")
        elif self._revision(repo, parts[3]):
            self._json(200, self._info(repo) if parts[2] == "revision" else self._tree(repo))

    # Answers.

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        return repo

    def _revision(self, repo: Repo, revision: str) -> bool:
        if revision in ("main", repo.sha):
            return True
        self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
        return False

    def _info(self, repo: Repo) -> dict[str, Any]:
        return {
            "_id": repo.sha[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": repo.sha,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "siblings": [{"rfilename": name} for name in repo.files],
        }

    def _tree(self, repo: Repo) -> list[dict[str, Any]]:
        return [
            {"type": "file", "oid": repo.oid(name), "size": len(data), "path": name}
            for name, data in repo.files.items()
        ]

    def _resolve(self, method: str, repo: Repo, name: str) -> None:
        if repo.gated:
            if self.headers.get("Authorization"):
                status, message = (
                    403,
                    (
                        f"Access to model {repo.repo_id} is restricted and you are not in the"
                        " authorized list. Visit https://huggingface.co/"
                        f"{repo.repo_id} to ask for access."
                    ),
                )
            else:
                status, message = (
                    401,
                    (
                        f"Access to model {repo.repo_id} is restricted. You must have access to it"
                        " and be authenticated to access it. Please log in."
                    ),
                )
            self._error(status, "GatedRepo", message, repo)
            return
        data = repo.files.get(name)
        if data is None:
            self._error(404, "EntryNotFound", "Entry not found", repo)
            return
        start = 0
        status = 200
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes=") and ranged.endswith("-"):
            start = int(ranged[len("bytes=") : -1])
            status = 206
            if method == "GET":
                with self.fake._lock:
                    self.fake.ranges.append(ranged)
        self.send_response(status)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("ETag", f'"{repo.oid(name)}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if method == "GET":
            self._send_body(data[start:])

    def _send_body(self, body: bytes) -> None:
        started = time.monotonic()
        for offset in _chunks(len(body)):
            if self.fake._drop(offset):
                self.close_connection = True
                return
            self.fake._stall(offset)
            self.fake._pace(offset, started)
            try:
                self.wfile.write(body[offset : offset + _CHUNK])
                self.wfile.flush()
            except OSError:  # the client went away
                self.close_connection = True
                return

    def _json(self, status: int, payload: object) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, repo: Repo | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if repo is not None:
            self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _chunks(size: int) -> Iterator[int]:
    return iter(range(0, size, _CHUNK))
