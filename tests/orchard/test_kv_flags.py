"""`orchard runner`'s KV-cache flags: bad sizes are usage errors (exit 2) before anything
loads, and a cache directory that cannot be written leaves a runner that serves from memory
after one warning."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from orchard import cli
from runner.engine import kv_store
from tests.support import Gateway, start_runner, wait_until


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ("--kv-disk", "lots"),
            "Invalid value for --kv-disk: 'lots' is not a size: say e.g. 24GB, 20GiB, 70% or "
            "a byte count",
        ),
        (
            ("--kv-disk", "5 parsecs"),
            "Invalid value for --kv-disk: '5 parsecs': unknown unit 'parsecs' "
            "(B, KB, MB, GB, TB, KiB ... TiB)",
        ),
        (
            ("--kv-disk", "120%"),
            "Invalid value for --kv-disk: '120%': a share is more than 0% and at most 100%",
        ),
        (("--max-kv-bytes", "0"), "Invalid value for --max-kv-bytes: must be more than 0 bytes"),
    ],
)
def test_bad_kv_flags_are_usage_errors(flags: tuple[str, ...], error: str) -> None:
    result = CliRunner().invoke(cli.main, ["runner", "--gateway", "http://127.0.0.1:9", *flags])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == f"Error: {error}"


def test_disk_sizes_read_as_sizes_shares_or_off(tmp_path: Path) -> None:
    assert kv_store.parse_disk_size("0", tmp_path) == 0
    assert kv_store.parse_disk_size("2GiB", tmp_path) == 2 * 2**30
    assert kv_store.parse_disk_size("1500", tmp_path) == 1500
    free = kv_store._free_bytes(tmp_path)
    assert kv_store.parse_disk_size("10%", tmp_path) == int(free * 0.1)


def test_an_unwritable_cache_directory_leaves_a_runner_that_serves(
    demo_model_path: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / demo_model_path.name).symlink_to(demo_model_path)
    (cache / "kv").write_text("a file where the disk cache's directory should be")
    gateway = Gateway()
    runner = start_runner(
        gateway,
        "--model",
        "orchard-demo",
        "--log-level",
        "info",
        env={"ORCHARD_CACHE_DIR": str(cache)},
    )
    try:
        gateway.wait_for_runners(1)
        body = {
            "model": "orchard-demo",
            "messages": [{"role": "user", "content": "Hello there, twice"}],
            "max_tokens": 3,
        }
        usages = []
        for _ in range(2):
            resp = httpx.post(f"{gateway.base}/v1/chat/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            usages.append(resp.json()["usage"])
        # Served, and the second from the memory tier.
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[1]["prompt_tokens"] - 1
        wait_until(
            lambda: (gateway.runners()[0]["kv_cache"]["prefix_bytes"] or 0) > 0, 10, "a heartbeat"
        )
        (info,) = gateway.runners()
        assert info["kv_cache"]["prefix_bytes"] > 0
        assert info["kv_cache"]["disk_bytes"] is None  # no disk tier
    finally:
        printed = runner.stop()
        gateway.stop()
    warnings = [line for line in printed.splitlines() if "disk KV cache off" in line]
    assert len(warnings) == 1, printed
    assert str(cache / "kv") in warnings[0]
