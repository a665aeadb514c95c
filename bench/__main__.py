"""`python -m bench [scenario ...]`: run benchmark scenarios (all by default)."""

from __future__ import annotations

import argparse
import sys

from bench import single_stream

SCENARIOS = {
    "single": single_stream.main,
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="just bench", description=__doc__)
    parser.add_argument("scenarios", nargs="*", help=f"any of {', '.join(SCENARIOS)}; default: all")
    parser.add_argument("--runs", type=int, default=5, help="repetitions per figure (median)")
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per run")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    for name in args.scenarios or list(SCENARIOS):
        SCENARIOS[name](runs=args.runs, tokens=args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
