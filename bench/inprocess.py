"""A worker process timing in-process mlx-lm `stream_generate`, driven over stdin/stdout.

Runs in its own process so that a benchmark can give it the same CPUs as a runner, and so
that its MLX threads are not shared with the benchmark's clients. Each stdin line is a JSON
`{"messages": [...], "max_tokens": n}`; each stdout line is `[ttft_s, decode_tok_s, tokens]`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import orjson


def main() -> None:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from runner.demo_model import resolve_model

    loaded: Any = load(resolve_model(sys.argv[1]))
    model, tokenizer = loaded[0], loaded[1]
    sampler = make_sampler(0.0)
    print("ready", flush=True)
    for line in sys.stdin:
        job = orjson.loads(line)
        start = time.perf_counter()
        prompt = tokenizer.apply_chat_template(job["messages"], add_generation_prompt=True)
        first = last = 0.0
        n = 0
        for response in stream_generate(
            model, tokenizer, prompt, max_tokens=job["max_tokens"], sampler=sampler
        ):
            last = time.perf_counter()
            first = first or last
            n = response.generation_tokens
        rate = (n - 1) / (last - first) if last > first else 0.0
        print(orjson.dumps([first - start, rate, n]).decode(), flush=True)


if __name__ == "__main__":
    main()
