"""`just bench kv-quant`: what `--kv-bits` saves in KV memory and costs in decode speed
(docs/benchmarks.md, "Quantized KV cache").

One stream on the batched engine in this process (a lone request: mlx-lm's `generate_step`,
which quantizes its cache), a long prompt of `PROMPT_TOKENS` and `tokens` completion tokens,
with the cache at full width and with `--kv-bits 8` (and 4), `--quantized-kv-start 0` so that
all of it is quantized. Figures: the bytes the prefix cache keeps for the request (its
prompt and answer) and their ratio to full width; decode tok/s (first token to last) and its
ratio; time to the first token. Medians of `runs` repetitions, each on a fresh prompt.

The built-in models' heads are 16 wide, too narrow for `mx.quantize`'s groups of 32 or more:
by default a random-weight Llama shaped like a small real model (bfloat16, 4 layers, 2 KV
heads of 64) with the built-in model's tokenizer is built in a temporary directory;
BENCH_KV_MODEL names another (a local MLX directory or a Hugging Face id).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.engine_common import engine_env, say
from protocol.frames import Generate, Message, SamplingParams
from runner.demo_model import DEMO_MODEL_ID, resolve_model
from runner.engine.base import EngineEvent, Output
from runner.engine.batched import batched_engine
from runner.engine.mlx_engine import MlxEngine
from runner.model_options import ModelOptions

PROMPT_TOKENS = 1024
"""About this many prompt tokens per request."""
SETTINGS: dict[str, ModelOptions] = {
    "full width": ModelOptions(),
    "--kv-bits 8": ModelOptions(kv_bits=8, quantized_kv_start=0),
    "--kv-bits 4": ModelOptions(kv_bits=4, quantized_kv_start=0),
}
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def build_model(target: Path) -> Path:
    """A random-weight bfloat16 Llama (CONFIG) with the built-in model's tokenizer, in
    `target`; it never picks its end-of-sequence token, so each run decodes all its tokens."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    demo = Path(resolve_model(DEMO_MODEL_ID))
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, target / name)
    config = {**CONFIG, "vocab_size": json.loads((demo / "config.json").read_text())["vocab_size"]}
    mx.random.seed(0)
    from_dict: Any = llama.ModelArgs.from_dict  # unannotated in mlx-lm
    args = from_dict(config)
    model = llama.Model(args)
    model.model.norm.weight = model.model.norm.weight * 20
    eos = mx.arange(config["vocab_size"])[:, None] == config["eos_token_id"]
    model.lm_head.weight = mx.where(eos, 0, model.lm_head.weight)
    model.set_dtype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    (target / "config.json").write_text(json.dumps(config))
    return target


class _Sink:
    """Times one request's outputs."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.times: list[float] = []
        self.last: Output | None = None

    def __call__(self, event: EngineEvent) -> None:
        if not isinstance(event, Output):
            self.done.set()
            return
        self.times.append(time.perf_counter())
        if event.finish_reason is not None:
            self.last = event
            self.done.set()


def _prompt(i: int) -> str:
    # Words of the built-in tokenizer's corpus: about a token each.
    words = " ".join(f"tree{(i * 7919 + k) % 997} apple" for k in range(PROMPT_TOKENS // 4))
    return f"Request {i}. {words}"


def _one(engine: MlxEngine, sink: _Sink, model: str, i: int, tokens: int) -> dict[str, float]:
    sink.done.clear()
    sink.times.clear()
    sink.last = None
    request = Generate(
        f"kvq-{i}",
        model,
        (Message("user", _prompt(i)),),
        max_tokens=tokens,
        sampling=SamplingParams(temperature=0.0),
    )
    start = time.perf_counter()
    engine.submit(request)
    if not sink.done.wait(600) or sink.last is None:
        raise RuntimeError(f"{request.request_id} failed or hung")
    assert engine._generation is not None
    prefix = engine._generation.prefix_cache
    entry = max(prefix.entries(), key=lambda e: e.used)
    first, last = sink.times[0], sink.times[-1]
    n = sink.last.usage.completion_tokens
    return {
        "prompt": float(sink.last.usage.prompt_tokens),
        "tokens": float(n),
        "kept": float(entry.nbytes),
        "ttft": first - start,
        "rate": (n - 1) / (last - first) if last > first else 0.0,
    }


def _measure(model: str, path: str | None, options: ModelOptions, runs: int, tokens: int) -> Any:
    sink = _Sink()
    engine = batched_engine(model, 4, path=path, options=options)
    engine.start(sink)
    try:
        _one(engine, sink, model, 10_000, 8)  # warm up
        rows = []
        for i in range(runs):
            rows.append(_one(engine, sink, model, i, tokens))
            say(f"{options.kv_bits or 'full width'}: run {i + 1}/{runs}: {rows[-1]}")
    finally:
        engine.close()
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main(runs: int, tokens: int) -> None:
    name = os.environ.get("BENCH_KV_MODEL")
    scratch = None
    if name is None:
        scratch = Path(tempfile.mkdtemp(prefix="bench-kv-"))
        built = str(build_model(scratch / "kv-bench-llama"))
        path: str | None = built
        model = built
        shown = "a random-weight bfloat16 Llama (4 layers, 2 KV heads of 64)"
    else:
        path, model, shown = None, name, name
    try:
        figures = {label: _measure(model, path, o, runs, tokens) for label, o in SETTINGS.items()}
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    base = figures["full width"]
    print(f"\n### Quantized KV cache: {shown}, {engine_env()}")
    print(
        f"One stream on the batched engine, {int(base['prompt'])} prompt + "
        f"{int(base['tokens'])} completion tokens, medians of {runs}\n"
    )
    print("| KV cache | kept KV bytes | ÷ full width | decode tok/s | ÷ full width | TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, f in figures.items():
        print(
            f"| {label} | {int(f['kept']):,} | {f['kept'] / base['kept']:.2f} | "
            f"{f['rate']:.1f} | {f['rate'] / base['rate']:.2f} | {f['ttft'] * 1000:.0f} |"
        )
