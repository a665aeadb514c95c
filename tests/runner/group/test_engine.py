"""A runner group across two real processes on MLX's ring backend over loopback (started as
`--local-group` starts them): rank 0's bytes reach every rank, a gather collects every
rank's; a member that hangs mid-request ends rank 0 within the group timeout, with a
message, and the supervisor leaves no process behind; a model split by tensor answers with
one process's greedy tokens, its logprobs within float32 rounding."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner.group import launch
from runner.group.watchdog import EXIT_GROUP_LOST
from tests.runner import group_script
from tests.support import REPO, UNIT

pytestmark = pytest.mark.timeout(int(120 * UNIT))


def _run(
    mode: str, tmp_path: Path, grace: float, env: dict[str, str] | None = None
) -> tuple[launch.Supervisor, list[dict[str, Any]]]:
    base = tmp_path / "out"
    command = [sys.executable, "-m", "tests.runner.group_script", mode, str(base)]
    members = launch.local_members(command, 2, tmp_path / "ring.json")
    extra = {"PYTHONPATH": str(REPO), **(env or {})}
    members = [launch.Child(m.argv, {**m.env, **extra}) for m in members]
    supervisor = launch.Supervisor(members, grace=grace, launcher=False)
    supervisor.run()
    outs = []
    for rank in range(2):
        path = Path(f"{base}.rank{rank}")
        outs.append(json.loads(path.read_text()) if path.exists() else {})
    return supervisor, outs


def test_share_step_and_gather_reach_every_rank(tmp_path: Path) -> None:
    supervisor, outs = _run("exchange", tmp_path, grace=30)
    assert [p.returncode for p in supervisor._procs] == [0, 0]
    for rank, out in enumerate(outs):
        assert out == {
            "rank": rank,
            "size": 2,
            "shared": "from rank 0",
            "empty": "",
            "big": True,
            "step": ["r1", ["r0"], False],
            "gathered": ["rank 0 says hi", "rank 1 says hirank 1 says hi"],
            # share, empty share, step: 1 chunk each; big: 3; gather: 2 (lengths, table)
            "collectives": 8,
        }


@pytest.mark.usefixtures("demo_model_path")  # in the session's cache: the members build none
def test_a_hung_member_ends_rank_0_within_the_timeout_and_nothing_is_left(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    supervisor, outs = _run("hang", tmp_path, grace=1.0 * UNIT)
    leader, follower = supervisor._procs
    assert leader.returncode == EXIT_GROUP_LOST
    assert follower.returncode == -signal.SIGKILL  # stopped: only SIGKILL ends it
    assert "still_alive" not in outs[0]
    stopped_at = outs[0]["stopped_at"]
    assert supervisor._failed_at is not None
    # The watchdog's timeout, plus its check interval and the supervisor's poll.
    assert supervisor._failed_at - stopped_at < group_script.TIMEOUT + 1.0 * UNIT
    assert time.monotonic() - started < 60 * UNIT
    err = capfd.readouterr().err
    assert "leaving the runner group: rank 0: one step has waited" in err, err


def _tensor_model(path: Path, demo: Path) -> None:
    """A random 2-layer Llama whose heads, KV heads and MLP split in two (the demo model's 3
    KV heads do not), with the demo model's tokenizer; logits peaked as the demo's are."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = json.loads((demo / "config.json").read_text())
    config.update(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    mx.random.seed(1)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    model.model.norm.weight = model.model.norm.weight * 10.0
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((demo / name).read_bytes())


def test_tensor_split_answers_as_one_process_within_float_rounding(
    tmp_path: Path, demo_model_path: Path
) -> None:
    from runner.engine.batched import batched_engine

    model = tmp_path / "tensor-model"
    _tensor_model(model, demo_model_path)
    supervisor, outs = _run("tensor", tmp_path, grace=5, env={"GROUP_TENSOR_MODEL": str(model)})
    assert [p.returncode for p in supervisor._procs] == [0, 0]
    assert outs[0]["split"] == "tensor"

    relay = group_script.Relay()
    engine = batched_engine(str(model), max_concurrent=2)
    engine.start(relay)
    try:
        expected = group_script.answer(group_script.Submitter(engine, relay), str(model))
    finally:
        engine.close()
    for got, want in zip(outs[0]["answers"], expected, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]  # the same greedy tokens
        # Each layer's partial sums add up in another order: float32 rounding (6e-6 at most
        # when measured), no more.
        worst = max(abs(g - w) for (_, g), (_, w) in zip(got, want, strict=True))
        assert worst < 1e-4
