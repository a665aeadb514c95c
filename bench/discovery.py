"""Scenario "discovery": a runner's start to its first served token, finding the gateway by
mDNS against being given its URL.

One gateway listens on every interface (so it announces itself) with a runner token. Per
repetition, alternating, a fresh runner process starts with `--gateway URL` or with no
`--gateway` (mDNS); the bench polls `/v1/runners` until the runner is listed, then streams one
request through it. Figures from the runner's spawn: registered, and first token. The runner
loads the same model either way, so the difference between the two rows is what discovery
costs (target: under 2 s plus the model load).
"""

from __future__ import annotations

import os
import tempfile
import time

import httpx

from bench.harness import (
    MEMORY,
    env_note,
    free_port,
    median,
    spawn_process,
    sse_run,
    stop_process,
    table,
    wait_until,
)

TOKEN = "bench-discovery-token"
MODEL = "orchard-demo"


def _once(base: str, name: str, gateway: list[str]) -> tuple[float, float]:
    """Seconds from spawning a runner to it being listed, and to its first served token."""
    started = time.perf_counter()
    runner = spawn_process(
        ["runner", "--name", name, "--model", MODEL, "--log-level", "warning", *gateway]
    )
    try:
        with httpx.Client(timeout=30, verify=False) as client:  # timing, not trust
            wait_until(
                lambda: any(
                    r["name"] == name for r in client.get(f"{base}/v1/runners").json()["data"]
                ),
                60,
            )
            listed = time.perf_counter() - started
            body = {"model": MODEL, "messages": [{"role": "user", "content": name}]}
            ttft, _, _ = sse_run(client, base, {**body, "max_tokens": 2})
            return listed, listed + ttft
    finally:
        stop_process(runner)


def main(runs: int, tokens: int) -> None:
    os.environ["ORCHARD_RUNNER_TOKEN"] = TOKEN  # inherited by the gateway and the runners
    os.environ["ORCHARD_TLS_DIR"] = tempfile.mkdtemp(prefix="bench-tls-")
    port = free_port()
    gateway = spawn_process(
        ["gateway", "--host", "0.0.0.0", "--port", str(port), "--name", "bench-discovery", *MEMORY]
    )
    base = f"https://127.0.0.1:{port}"  # off loopback the gateway serves TLS
    rows: dict[str, list[tuple[float, float]]] = {"--gateway URL": [], "mDNS (no --gateway)": []}
    try:
        wait_until(lambda: httpx.get(f"{base}/health", timeout=1, verify=False).is_success, 30)
        for run in range(runs):
            for path in list(rows) if run % 2 == 0 else list(rows)[::-1]:
                args = ["--gateway", base] if path.startswith("--gateway") else []
                rows[path].append(_once(base, f"bench-{run}-{len(args)}", args))
    finally:
        stop_process(gateway)
    print(
        table(
            f"runner start to first served token, {MODEL}, median of {runs} runs ({env_note()})",
            ["how it finds the gateway", "registered s", "first token s"],
            [
                [path, round(median([r[0] for r in got]), 2), round(median([r[1] for r in got]), 2)]
                for path, got in rows.items()
            ],
        )
    )
    url, mdns = (median([r[1] for r in got]) for got in rows.values())
    print(f"\ndiscovery adds {mdns - url:.2f} s (target: under 2 s)")
