"""How a group splits its model: mlx-lm's pipeline stages or tensor shards (`sharded_load`).

- **pipeline**: each rank holds a run of consecutive layers (mlx-lm gives rank 0 the last
  ones) and hands its activations to the next rank once per forward pass. One small message
  per stage per step, so it suits a LAN's ring backend. Each rank holds 1/N of the layers.
- **tensor**: every layer's attention heads and MLP columns are split across the ranks, which
  add up their partial results with two `all_sum`s per layer. All ranks compute at once,
  but a step costs 2 x layers collectives: worth it over Thunderbolt (JACCL's RDMA), not TCP.
  The sums run in a different order than on one machine, so logits differ by float rounding.

`auto` (the default) is tensor on JACCL where the model can be split so, otherwise pipeline
where mlx-lm's model class supports it (Qwen2/3, DeepSeek, GLM-4 MoE, Ministral 3, ...;
not its Llama), otherwise tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from mlx_lm.utils import _download, load_model, sharded_load

from runner.demo_model import resolve_model
from runner.group import GroupError

Split = Literal["auto", "pipeline", "tensor"]
SPLITS: tuple[Split, ...] = ("auto", "pipeline", "tensor")


def model_path(name: str) -> Path:
    """The model's directory, with its config (a Hub model's small files downloaded first)."""
    resolved = resolve_model(name)
    # What sharded_load itself calls for the config and code before the weights.
    return Path(_download(resolved, allow_patterns=["*.json", "*.py", "*.jinja", "*.txt"]))


def supported(path: Path, size: int) -> dict[str, str | None]:
    """For each split, None if the model at `path` can be split so across `size` ranks, or
    why not."""
    model: Any
    model, config = load_model(path, lazy=True, strict=False)
    text = config.get("text_config") or config
    why: dict[str, str | None] = {}
    inner = getattr(model, "model", None)
    layers = len(inner.layers) if inner is not None and hasattr(inner, "layers") else 0
    if inner is None or not hasattr(inner, "pipeline"):
        why["pipeline"] = f"mlx-lm's {config.get('model_type')} model has no pipeline stages"
    elif layers < size:
        why["pipeline"] = f"{layers} layers cannot make {size} stages"
    elif not (path / "model.safetensors.index.json").exists():
        why["pipeline"] = "its directory has no model.safetensors.index.json"
    else:
        why["pipeline"] = None
    if not hasattr(model, "shard"):
        why["tensor"] = f"mlx-lm's {config.get('model_type')} model has no tensor sharding"
    else:
        uneven = [
            key
            for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
            if isinstance(text.get(key), int) and text[key] % size
        ]
        why["tensor"] = (
            f"{', '.join(f'{k} ({text[k]})' for k in uneven)} not divisible by {size}"
            if uneven
            else None
        )
    return why


def choose(split: Split, why: dict[str, str | None], backend: str) -> Literal["pipeline", "tensor"]:
    """The split to use: `split` if the model allows it, else `GroupError` saying why."""
    if split != "auto":
        reason = why[split]
        if reason is not None:
            raise GroupError(f"cannot split the model by {split}: {reason}")
        return split
    order: tuple[Literal["pipeline", "tensor"], ...] = (
        ("tensor", "pipeline") if backend == "jaccl" else ("pipeline", "tensor")
    )
    for candidate in order:
        if why[candidate] is None:
            return candidate
    raise GroupError(
        "this model cannot be split across the group: "
        + "; ".join(f"{k}: {v}" for k, v in why.items())
    )


def load(
    name: str, group: Any, split: Split, backend: str
) -> tuple[Any, Any, dict[str, Any], Literal["pipeline", "tensor"]]:
    """Load `name` split across `group`: (model, tokenizer, config, the split used). Every
    rank must call it at the same point: it ends on a collective."""
    path = model_path(name)
    chosen = choose(split, supported(path, group.size()), backend)
    loaded: Any = sharded_load(
        str(path),
        pipeline_group=group if chosen == "pipeline" else None,
        tensor_group=group if chosen == "tensor" else None,
        return_config=True,
    )
    model, tokenizer, config = loaded
    return model, tokenizer, config, chosen
