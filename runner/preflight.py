"""What `orchard runner` checks of its models' options before it connects, from their files.

- `check_drafts`: a draft must tokenize as its model does. Speculative decoding hands the
  draft's token ids to the model (runner.engine.speculative), so a draft with another
  vocabulary would propose nonsense that the model rejects every time, or worse, ids past its
  vocabulary.
- `check_kv_groups`: `--kv-bits` quantizes each attention head's keys and values in groups of
  `--kv-group-size` values, which must divide the head's width (the built-in models' heads are
  16 wide: they cannot be quantized at all).

Either stops the runner with a usage error (exit 2). The files must be on this machine for
that: built-in models, local directories, and Hub ids already in the Hugging Face cache are
checked here; a Hub id still to download is checked when its model loads (the load fails with
the same message, shown as the model's error in `/v1/runners`).
"""

# mlx-lm is imported where a tokenizer is loaded: `orchard --help` imports this module's caller.
# ruff: noqa: PLC0415

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.model_options import fitting_groups, head_width, kv_group_problem
from runner.startup import StartupError

if TYPE_CHECKING:
    from runner.model_options import ModelOptions


def check_drafts(options: Mapping[str, ModelOptions]) -> None:
    """`StartupError` (option `--draft-model`) for a draft whose tokenizer differs from its
    model's, or a draft that is a local path with no model in it."""
    from runner.engine.speculative import vocabulary_mismatch

    for model, option in options.items():
        draft = option.draft_model
        if draft is None:
            continue
        draft_tokenizer = _local_tokenizer(draft, option.trust_remote_code, must_exist=True)
        base = option.model or model  # a served MODEL:ADAPTER id's model
        model_tokenizer = _local_tokenizer(base, option.trust_remote_code, must_exist=False)
        if draft_tokenizer is None or model_tokenizer is None:
            continue  # to download first: checked when the model loads
        mismatch = vocabulary_mismatch(model_tokenizer, draft_tokenizer)
        if mismatch is not None:
            raise StartupError(
                f"{draft} does not tokenize as {base}: {mismatch}; a draft model must share "
                "its model's tokenizer",
                "--draft-model",
            )


def check_kv_groups(options: Mapping[str, ModelOptions]) -> None:
    """`StartupError` (option `--kv-group-size`, or `--kv-bits` when no group size fits) for a
    model whose heads `--kv-group-size` does not divide."""
    for served, option in options.items():
        if option.kv_bits is None:
            continue
        name = option.model or served
        source = _local_files(name)
        if source is None:
            continue  # to download first: checked when the model loads
        try:
            config = json.loads((source / "config.json").read_text())
        except (OSError, ValueError):
            continue  # mlx-lm's load says what is wrong with it
        width = head_width(config)
        if width is not None and (problem := kv_group_problem(name, width, option)):
            option_name = "--kv-group-size" if fitting_groups(width) else "--kv-bits"
            raise StartupError(problem, option_name)


def _local_files(name: str) -> Path | None:
    """Where `name`'s files are on this machine (None: a Hub id not yet downloaded)."""
    from runner.adapter import is_hub_id
    from runner.demo_model import is_builtin, resolve_model

    source = Path(resolve_model(name))
    if source.exists() or is_builtin(name) or not is_hub_id(name):
        return source  # a path that is not there: the caller says so
    return _hub_cache(name)


def _local_tokenizer(name: str, trust_remote_code: bool, *, must_exist: bool) -> Any:
    """The tokenizer of `name` if its files are on this machine (None: a Hub id not yet
    downloaded). A name that is no Hub id (`must_exist`) but holds no model is an error."""
    from runner.adapter import is_hub_id

    source = _local_files(name)
    if source is None or not source.exists():
        if must_exist and not is_hub_id(name):
            raise StartupError(f"no model at {name}", "--draft-model")
        return None  # to download first, or a model path its load will report
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(  # type: ignore[no-untyped-call]  # mlx-lm is unannotated
            source,
            tokenizer_config_extra={"trust_remote_code": trust_remote_code},
        )
    except Exception as exc:  # a directory without a usable tokenizer
        raise StartupError(f"cannot read the tokenizer of {name}: {exc}", "--draft-model") from exc


def _hub_cache(name: str) -> Path | None:
    """`name`'s snapshot in the Hugging Face cache, if it was downloaded before."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not in the cache (or not a valid id): nothing to check here
        return None
