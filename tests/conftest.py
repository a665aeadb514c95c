"""Session-wide fixtures: one copy of the built-in model for every test and subprocess."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def orchard_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ORCHARD_CACHE_DIR (inherited by runner subprocesses) at a session directory.

    ORCHARD_TEST_CACHE_DIR reuses a directory across runs to skip rebuilding the model.
    """
    reuse = os.environ.get("ORCHARD_TEST_CACHE_DIR")
    path = Path(reuse) if reuse else tmp_path_factory.mktemp("orchard-cache")
    old = os.environ.get("ORCHARD_CACHE_DIR")
    os.environ["ORCHARD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("ORCHARD_CACHE_DIR", None)
    else:
        os.environ["ORCHARD_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def demo_model_path(orchard_cache: Path) -> Path:
    """The built-in model, built once per session."""
    from runner.demo_model import DEMO_MODEL_ID, resolve_model

    return Path(resolve_model(DEMO_MODEL_ID))
