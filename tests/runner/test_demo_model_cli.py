"""`orchard demo-model DIR` writes a model other mlx-lm tools load as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def test_demo_model_command_writes_a_loadable_model(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    out = subprocess.run(
        [sys.executable, "-m", "orchard", "demo-model", str(target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert f"wrote orchard-demo to {target}" in out.stdout
    assert {p.name for p in target.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
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
        timeout=300,
        check=False,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "Generation:" in gen.stdout
