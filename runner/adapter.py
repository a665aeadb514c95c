"""A model's LoRA adapter (`orchard runner --adapter-path`), in mlx-lm's format: a directory
holding adapter_config.json (`fine_tune_type`, `num_layers`, `lora_parameters` with `rank`,
`scale` and `dropout`) and adapters.safetensors, as `mlx_lm.lora` writes them.

`locate` finds it: a directory as is, a Hugging Face id in the Hub's cache, downloaded when
missing (`runner.download`, with the adapter's files in place of a model's). `check_files`
reads both files without MLX; `apply` puts the adapter on a loaded model (mlx-lm's
`load_adapters`, which checks each weight's shape against the layer it adapts). Each raises
`AdapterError` with a message of one line.

At start the runner checks every adapter that is a directory, and its fit to its model when
the model is on disk (`check_at_start`); a Hub id is checked when it is downloaded, as its
model loads.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from runner.errors import AdapterError

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"
FILES = (CONFIG, WEIGHTS)
"""What an adapter's snapshot downloads."""
FINE_TUNE_TYPES = ("lora", "dora", "full")
_MAX_HEADER = 100 * 2**20
"""A safetensors header larger than this is no header (the format caps it at 100 MB)."""


def is_hub_id(value: str) -> bool:
    """Whether `value` reads as a Hugging Face id (organization/name), not a path."""
    return re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", value) is not None


def locate(adapter: str, *, download: bool = True) -> Path | None:
    """The adapter's directory: `adapter` itself if it is one; else, for a Hub id, its
    snapshot (downloaded when missing; with `download` False, None when not cached).
    Raises `AdapterError` for a missing directory, `DownloadError` for a failed download."""
    from runner import download as hub  # noqa: PLC0415  # the hub client: load if needed

    if Path(adapter).exists() or not is_hub_id(adapter):
        path = Path(adapter)
        if not path.is_dir():
            raise AdapterError(f"no adapter directory at {adapter}")
        return path
    if not download:
        return hub.cached(adapter, allow_patterns=list(FILES))
    return hub.fetch(adapter, allow_patterns=list(FILES))


def check_files(directory: Path) -> dict[str, Any]:
    """The adapter's configuration, once its files are found well formed."""
    config_path = directory / CONFIG
    if not config_path.is_file():
        raise AdapterError(
            f"no {CONFIG} in {directory}: an mlx-lm adapter directory holds {CONFIG} and "
            f"{WEIGHTS}, as mlx_lm.lora writes them"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{config_path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} is not a JSON object")
    _check_config(config, config_path)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"no {WEIGHTS} in {directory}: the adapter has no weights")
    if not _tensor_names(weights):
        raise AdapterError(f"{weights} holds no tensors")
    return config


def _check_config(config: dict[str, Any], path: Path) -> None:
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise AdapterError(
            f"{path}: fine_tune_type is {kind!r}, not one of {', '.join(FINE_TUNE_TYPES)}"
        )
    if kind == "full":
        return
    layers = config.get("num_layers")
    if type(layers) is not int:
        raise AdapterError(f"{path}: num_layers must be a whole number, not {layers!r}")
    lora = config.get("lora_parameters")
    if not isinstance(lora, dict):
        raise AdapterError(f"{path}: lora_parameters must be an object (rank, scale, dropout)")
    for key in ("rank", "scale", "dropout"):
        if key not in lora:
            hint = " (mlx-lm's scale, not alpha)" if key == "scale" and "alpha" in lora else ""
            raise AdapterError(f"{path}: lora_parameters has no {key}{hint}")
    if type(lora["rank"]) is not int or lora["rank"] < 1:
        raise AdapterError(f"{path}: lora_parameters' rank must be at least 1")


def _tensor_names(path: Path) -> list[str]:
    """The tensors a safetensors file names (its header, read without MLX)."""
    try:
        with path.open("rb") as file:
            head = file.read(8)
            (size,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            if not 0 < size <= _MAX_HEADER:
                raise ValueError("no safetensors header")
            header = json.loads(file.read(size))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path} is not a safetensors file: {exc}") from exc
    return [name for name in header if name != "__metadata__"]


def apply(model: Any, directory: Path, name: str) -> None:
    """Put the adapter in `directory` on `model` (an mlx-lm model named `name`) and set it
    to inference (no dropout)."""
    from mlx_lm.tuner.utils import load_adapters  # noqa: PLC0415  # MLX: load if needed

    try:
        load_adapters(model, str(directory))
    except (ValueError, KeyError, TypeError) as exc:
        lines = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        detail = f"{lines[0]}{more}" if lines else str(exc)
        raise AdapterError(f"the adapter at {directory} does not fit {name}: {detail}") from exc
    model.eval()


def check_fit(directory: Path, model_dir: str, name: str, *, trust_remote_code: bool) -> None:
    """That the adapter fits the model at `model_dir`: the model built without reading its
    weights (lazily), the adapter put on it."""
    from mlx_lm.utils import load_model  # noqa: PLC0415  # MLX: load if needed

    try:
        model, _ = load_model(Path(model_dir), lazy=True, trust_remote_code=trust_remote_code)
    except Exception:  # the model's own load says what is wrong with it
        return
    apply(model, directory, name)
