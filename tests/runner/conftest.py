"""Fixtures of the runner tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runner.engines import Reference


@pytest.fixture(scope="session")
def reference(demo_model_path: Path) -> Reference:
    """Plain mlx-lm on the built-in model, loaded once."""
    return Reference(demo_model_path)
