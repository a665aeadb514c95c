"""How a model family's demo model is described (`Family`) and built (`build`).

`runner.demo_families` holds one `Family` per model family (read that module first); this one
writes a family's files: its tokenizer (the demo corpus's byte-level BPE plus the family's
tokens), its config and its random weights, and reads its chat template, a package data file
(`runner/demo_templates/<family>.jinja`).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from runner.demo_corpus import CONTEXT_LENGTH, CORPUS, silent_token_ids

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# mlx, mlx-lm and tokenizers are imported where a model is built (PLC0415): `orchard
# demo-model --help` lists the families and must start fast.

VOCAB_SIZE = 1024
LOGIT_SCALE = 10.0
SEED = 0


@attrs.frozen
class Family:
    """One model family's demo model: what it is and what mlx-lm makes of it."""

    model_id: str
    """The served id, `orchard-demo-<family>`."""
    stands_for: str
    """The real model whose format it has."""
    architecture: str
    """The mlx-lm module that runs it (`mlx_lm.models.<architecture>`)."""
    model_type: str
    """Its config's `model_type` (mlx-lm maps some onto another architecture)."""
    tool_parser: str | None
    """The parser mlx-lm picks (`mlx_lm.tool_parsers.<name>`); None where it has none."""
    think: tuple[str, str] | None
    """The think markers mlx-lm detects, or None."""
    notes: str
    """How it differs from the real family, and why."""
    special_tokens: tuple[str, ...]
    """Single tokens, special (decoding with `skip_special_tokens` drops them)."""
    added_tokens: tuple[str, ...]
    """Single tokens that decode as text, as in the real tokenizer."""
    bos: str | None
    """The tokenizer's `bos_token`."""
    eos: str
    """The tokenizer's `eos_token`."""
    stops: tuple[str, ...]
    """The tokens that end a generation: `eos_token_id` in config.json and
    generation_config.json (mlx-lm stops at these and at `eos`)."""
    pad: str | None
    config: Mapping[str, Any]
    """config.json, less the ids the tokenizer decides (vocab size, bos, eos)."""
    chat_template: str
    head: str
    """The weight whose rows are the logits: the output head or, tied, the embeddings."""
    final_norm: str
    branch_outputs: tuple[str, ...] = ()
    """Weights (by name suffix) that end each layer's residual branches, scaled by
    `branch_gain`: with tied embeddings a random model repeats its last token, unless the
    layers outweigh the embedding in the residual stream."""
    branch_gain: float = 1.0


def chat_template(family: str) -> str:
    """The chat template of `family` (`runner/demo_templates/<family>.jinja`)."""
    text = resources.files("runner").joinpath("demo_templates", f"{family}.jinja").read_text()
    return text.strip()


def base_config(**fields: Any) -> dict[str, Any]:
    """A family's config.json: the demo models' context, untied, float32, then `fields`."""
    return {
        "max_position_embeddings": CONTEXT_LENGTH,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **fields,
    }


def build(spec: Family, path: Path) -> None:
    """Write the demo model of `spec` (config, weights, tokenizer) into `path`, created if missing.

    It depends only on this module, `spec`, `runner.demo_corpus` and the installed mlx and
    mlx-lm; it takes well under a second. It reseeds the calling thread's MLX generator (off
    the main thread, see `runner.demo_model.build_demo_model`).
    """
    import mlx.core as mx  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(spec, path)
    config = _config(spec, tokenizer)
    for name in ("config.json", "generation_config.json"):
        content = config if name == "config.json" else {"eos_token_id": config["eos_token_id"]}
        (path / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    markers = set(spec.special_tokens + spec.added_tokens)
    weights = _weights(spec, config, silent_token_ids(tokenizer, markers))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


def _config(spec: Family, tokenizer: Tokenizer) -> dict[str, Any]:
    ids = {
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "eos_token_id": [tokenizer.token_to_id(token) for token in spec.stops],
    }
    if spec.bos is not None:
        ids["bos_token_id"] = tokenizer.token_to_id(spec.bos)
    config = {**spec.config, **ids}
    if "text_config" in config:  # Mistral 3's layout: the language model's own config
        config["text_config"] = {**config["text_config"], "vocab_size": ids["vocab_size"]}
    return config


@functools.cache
def _trained_bpe(vocab_size: int) -> str:
    """The corpus's byte-level BPE with `vocab_size` tokens, as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(CORPUS), trainer=trainer)
    return str(tokenizer.to_str())


def _build_tokenizer(spec: Family, path: Path) -> Tokenizer:
    """Train the BPE, add the family's tokens, write tokenizer.json and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer  # noqa: PLC0415

    markers = spec.special_tokens + spec.added_tokens
    tokenizer = Tokenizer.from_str(_trained_bpe(VOCAB_SIZE - len(markers)))
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in spec.special_tokens]
    )
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in spec.added_tokens]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": spec.chat_template,
    }
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    )
    return tokenizer


def _weights(spec: Family, config: dict[str, Any], silent_ids: list[int]) -> dict[str, Any]:
    """The random model, by weight name, with its markers silenced and its logits peaked."""
    import mlx.core as mx  # noqa: PLC0415
    from mlx.utils import tree_flatten  # noqa: PLC0415

    module = importlib.import_module(f"mlx_lm.models.{spec.architecture}")
    args = module.ModelArgs.from_dict(config)
    # Module init draws from MLX's generator, which is per thread: this reseeds the caller's.
    mx.random.seed(SEED)
    weights = dict(tree_flatten(module.Model(args).parameters()))
    keep = mx.ones((config["vocab_size"], 1), dtype=mx.float32)
    keep[mx.array(silent_ids)] = 0.0
    weights[spec.head] = weights[spec.head] * keep
    weights[spec.final_norm] = weights[spec.final_norm] * LOGIT_SCALE
    for name, weight in weights.items():
        if name.endswith(spec.branch_outputs):
            weights[name] = weight * spec.branch_gain
    mx.eval(weights)
    return weights
