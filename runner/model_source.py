"""Where a runner's models come from: the built-in models, local MLX directories, and the
Hugging Face Hub (downloaded with progress by `runner.download`). The `ModelSource` that
`runner.engine.shelf.ModelShelf` loads on demand from."""

from __future__ import annotations

from pathlib import Path

from runner import download
from runner.demo_model import is_builtin, resolve_model
from runner.engine.shelf import Progress


class HubSource:
    """The demo model (built on first use), a directory on disk, or a Hub id (its snapshot
    in the Hub's cache, downloaded when missing)."""

    def on_disk(self, name: str) -> str | None:
        if _local(name):
            return resolve_model(name)
        path = download.cached(name)
        return None if path is None else str(path)

    def fetch(self, name: str, progress: Progress) -> str:
        if _local(name):
            return resolve_model(name)
        return str(download.fetch(name, lambda p: progress(p.done_bytes, p.total_bytes)))

    def size(self, path: str) -> int:
        return download.local_size(path)


def _local(name: str) -> bool:
    return is_builtin(name) or Path(name).is_dir()
