"""Where a runner's models come from: the built-in models, local MLX directories, and the
Hugging Face Hub (downloaded with progress by `runner.download`). The `ModelSource` that
`runner.engine.shelf.ModelShelf` loads on demand from."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from runner import download
from runner.demo_model import is_builtin, resolve_model
from runner.engine.shelf import Progress


class HubSource:
    """The demo model (built on first use), a directory on disk, or a Hub id (its snapshot
    in the Hub's cache, downloaded when missing). `bases` names the model of each served id
    that is not a model's own name (`MODEL:ADAPTER`, runner.model_options); its adapter is
    found (or downloaded) as the model loads (runner.adapter)."""

    def __init__(self, bases: Mapping[str, str] | None = None) -> None:
        self.bases = dict(bases or {})

    def on_disk(self, name: str) -> str | None:
        name = self.bases.get(name, name)
        if _local(name):
            return resolve_model(name)
        path = download.cached(name)
        return None if path is None else str(path)

    def fetch(self, name: str, progress: Progress) -> str:
        name = self.bases.get(name, name)
        if _local(name):
            return resolve_model(name)
        return str(download.fetch(name, lambda p: progress(p.done_bytes, p.total_bytes)))

    def size(self, path: str) -> int:
        return download.local_size(path)


def _local(name: str) -> bool:
    return is_builtin(name) or Path(name).is_dir()
