"""LoRA adapters for the built-in model, in mlx-lm's format, made here for the tests: the
layers mlx-lm's `linear_to_lora_layers` would adapt, with seeded random `lora_a` and `lora_b`
(mlx-lm starts `lora_b` at zero; here it is not, so the adapted model answers otherwise)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RANK = 4
NUM_LAYERS = 2
"""The last layers adapted."""


def make_adapter(
    directory: Path, model_dir: Path, *, seed: int = 1, rank: int = RANK, strength: float = 0.5
) -> Path:
    """Write an adapter for the model in `model_dir` to `directory`: adapter_config.json and
    adapters.safetensors (lora_a, lora_b of each adapted layer, shaped as mlx-lm's
    LoRALinear's). `strength` scales lora_b. Returns `directory`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    parameters: dict[str, Any] = {"rank": rank, "scale": 10.0, "dropout": 0.0}
    model, _ = load_model(model_dir, lazy=True)
    linear_to_lora_layers(model, NUM_LAYERS, parameters)
    mx.random.seed(seed)
    weights = {}
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, array in flat:
        if name.endswith(".lora_a"):
            weights[name] = array  # mlx-lm's own start: uniform in ±1/sqrt(input dims)
        elif name.endswith(".lora_b"):
            weights[name] = strength * mx.random.normal(array.shape)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": NUM_LAYERS, "lora_parameters": parameters}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
