"""A tiny random-weight Llama whose KV cache mlx-lm can quantize, for the `--kv-bits` tests.

The built-in models' heads are 16 wide, and `mx.quantize` takes groups of 32, 64 or 128 along
the head: their caches cannot be quantized. This one has the built-in model's tokenizer and
chat template and 64-wide heads (`--kv-group-size` 64, the default, fits), built from
`ModelArgs` as mlx-lm's tests build theirs; its final norm is scaled up so that greedy
decoding does not hinge on rounding, and it never picks its end-of-sequence token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def build_kv_model(demo: Path, target: Path) -> Path:
    """Write the model into `target` (made if missing), with `demo`'s (the built-in
    model's directory) tokenizer files; `target`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, target / name)
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    config = {**CONFIG, "vocab_size": vocab}
    mx.random.seed(0)
    from_dict: Any = llama.ModelArgs.from_dict  # unannotated in mlx-lm
    args = from_dict(config)
    model = llama.Model(args)
    model.model.norm.weight = model.model.norm.weight * 20
    # No end of sequence by itself: requests run to max_tokens (exact counts in tests).
    head = model.lm_head.weight
    model.lm_head.weight = mx.where(mx.arange(vocab)[:, None] == config["eos_token_id"], 0, head)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
