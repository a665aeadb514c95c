"""Session-wide fixtures: one copy of the built-in model for every test and subprocess, and the
hypothesis profile of the whole suite."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support import REPO

# No per-example deadline: on a busy machine an example may take a second and that is no bug
# (a hang still ends at pytest-timeout's bound). Example counts stay as each test sets them.
settings.register_profile("orchard", deadline=None)
settings.load_profile("orchard")

MODEL_SOURCES = ("runner/demo_model.py", "runner/demo_shaping.py")
"""What the built-in model is built from; with the MLX version, its key in the test cache."""


@pytest.fixture(scope="session", autouse=True)
def orchard_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ORCHARD_CACHE_DIR (inherited by runner subprocesses) at a session directory.

    ORCHARD_TEST_CACHE_DIR reuses a directory across runs instead.
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


@pytest.fixture(scope="session", autouse=True)
def orchard_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ORCHARD_STATE_DIR (the gateway's stores' file, inherited by every gateway a test
    starts) at a session directory, so that no test writes ~/.orchard/state. A gateway
    started through tests.support.Process gets a directory of its own besides."""
    path = tmp_path_factory.mktemp("orchard-state")
    old = os.environ.get("ORCHARD_STATE_DIR")
    os.environ["ORCHARD_STATE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("ORCHARD_STATE_DIR", None)
    else:
        os.environ["ORCHARD_STATE_DIR"] = old


def built_model_key() -> str:
    """A hash of what the built-in model is built from: its sources and the MLX version."""
    digest = hashlib.sha256(importlib.metadata.version("mlx").encode())
    for name in MODEL_SOURCES:
        digest.update((REPO / name).read_bytes())
    return digest.hexdigest()[:16]


def built_models_dir() -> Path:
    """Where test runs keep the built-in model between runs (`$ORCHARD_TEST_MODELS_DIR`, or
    ~/.cache/orchard-tests), one directory per `built_model_key`."""
    configured = os.environ.get("ORCHARD_TEST_MODELS_DIR")
    root = Path(configured) if configured else Path.home() / ".cache" / "orchard-tests"
    return root / built_model_key()


@pytest.fixture(scope="session")
def demo_model_path(orchard_cache: Path) -> Path:
    """The built-in model in the session's cache directory.

    Building it takes 15-50 s of CPU; it depends only on its sources and the MLX version
    (tests/runner/test_demo_model.py checks that a build is deterministic), so a build is kept
    under `built_models_dir()` and copied into each session's cache. A file lock makes the
    processes of a parallel run (pytest-xdist) build it once between them.
    """
    from runner.demo_model import DEMO_MODEL_ID, resolve_model

    session_copy = orchard_cache / "models"
    kept = built_models_dir()
    kept.mkdir(parents=True, exist_ok=True)
    with (kept / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        os.environ["ORCHARD_CACHE_DIR"] = str(kept)
        try:
            built = Path(resolve_model(DEMO_MODEL_ID))
        finally:
            os.environ["ORCHARD_CACHE_DIR"] = str(orchard_cache)
    target = session_copy / built.name
    if not target.is_dir():
        session_copy.mkdir(parents=True, exist_ok=True)
        staging = session_copy / f".{built.name}.copy"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(built, staging)
        staging.rename(target)
    return Path(resolve_model(DEMO_MODEL_ID))


FIRST = ("e2e", "runner", "gateway")
"""The packages whose modules take longest (real processes and engines), in that order."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first, so that `just test`'s processes (xdist hands out modules in
    this order, each to the first process free) end together instead of one waiting on the
    other's last long module. Each module's tests keep their order."""

    def rank(item: pytest.Item) -> int:
        parts = item.path.relative_to(REPO / "tests").parts
        return FIRST.index(parts[0]) if parts[0] in FIRST else len(FIRST)

    items.sort(key=rank)
