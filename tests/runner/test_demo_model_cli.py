"""`orchard demo-model DIR` writes a model other mlx-lm tools load as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.runner.demo import FILES
from tests.support import REPO, UNIT


def test_demo_model_command_writes_a_loadable_model(tmp_path: Path, demo_model_path: Path) -> None:
    # The session's cache holds the built model: the command copies it (a build is
    # deterministic, test_demo_model.py), so what it writes is that model, byte for byte.
    target = tmp_path / "demo"
    out = subprocess.run(
        [sys.executable, "-m", "orchard", "demo-model", str(target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300 * UNIT,
        check=True,
    )
    assert f"wrote orchard-demo to {target}" in out.stdout
    assert sorted(p.name for p in target.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (target / name).read_bytes() == (demo_model_path / name).read_bytes(), name
    # mlx-lm's own command line generates from it.
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            str(target),
            "--prompt",
            "hello",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300 * UNIT,
        check=False,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "Generation:" in gen.stdout
