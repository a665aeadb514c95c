"""`python -m bench [scenario ...]`: run benchmark scenarios (all by default)."""

from __future__ import annotations

import argparse
import sys

from bench import (
    agent,
    concurrency,
    discovery,
    distributed,
    engine,
    kv_quant,
    metrics,
    paced,
    prefix_cache,
    relay,
    single_stream,
    speculative,
    structured,
)

SCENARIOS = {
    "single": single_stream.main,  # 1: one stream, gateway vs in-process
    "concurrency": concurrency.main,  # 2, 3: 1/8/32 streams and late join vs mlx_lm.server
    "relay": relay.main,  # 4: relay capacity on scripted runners, idle sockets
    "paced": paced.main,  # 5: paced streams until the p99 gap passes 40 ms
    "structured": structured.main,  # 6: json_schema vs free text tok/s, schema compile time
    "structured-families": structured.families,  # 6: the same, and forced calls, per family
    # 7: decode at 1-64 streams, stream_generate → engine stepped / threaded → end to end; the
    # step's build / launch / wait split; bursts, arrivals, cold start (BENCH_ENGINE_PARTS)
    "engine": engine.main,
    "discovery": discovery.main,  # a runner's start to its first token: mDNS vs --gateway URL
    "metrics": metrics.main,  # relay tok/s at 256 streams with and without scraping /metrics
    "distributed": distributed.main,  # a 2-process runner group vs one process, step overhead
    "prefix-cache": prefix_cache.main,  # 9: the prefix cache's lookup and sharing vs mlx-lm's
    "agent": agent.main,  # 11: prompt reuse in agent sessions, 1 and 3 runners vs mlx_lm.server
    "speculative": speculative.main,  # 12: one stream with a draft model ÷ without
    "kv-quant": kv_quant.main,  # 13: --kv-bits, kept KV bytes and decode tok/s vs full width
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="just bench", description=__doc__)
    parser.add_argument("scenarios", nargs="*", help=f"any of {', '.join(SCENARIOS)}; default: all")
    parser.add_argument("--runs", type=int, default=5, help="repetitions per figure (median)")
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per run")
    parser.add_argument("--turns", type=int, default=agent.TURNS, help="agent: turns per replay")
    args = parser.parse_args()
    agent.TURNS = args.turns
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    for name in args.scenarios or list(SCENARIOS):
        SCENARIOS[name](runs=args.runs, tokens=args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
