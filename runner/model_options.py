"""What `orchard runner` is told about each model beyond its name, as mlx_lm.server's options
give it: a draft model for speculative decoding, a quantized KV cache, a LoRA adapter, the
chat template and its arguments, and sampling defaults for requests that set none.

Options that belong to one model (`--draft-model`, `--adapter-path`, `--chat-template`,
`--chat-template-args`) take `VALUE` for every model, or `MODEL=VALUE` for the `--model` of
that name (or for one served id, `MODEL:ADAPTER=VALUE`); the others hold for every model.

A model with an adapter is served as `MODEL:ADAPTER` (`served_id`: the adapter's directory
name, or a Hub id's last part), so that clients choose it by name. `--adapter-path` given more
than once for a model serves it once per adapter, and `MODEL=` (no value) serves it without
one as well: `--adapter-path orchard-demo= --adapter-path orchard-demo=./my-lora` serves
`orchard-demo` and `orchard-demo:my-lora` (each loads its own copy of the weights).
`model_options` is keyed by served id. No MLX here: `orchard --help` imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from protocol.frames import SamplingDefaults

KV_BITS = (4, 8)
"""What `--kv-bits` takes (mlx-lm's quantized KV cache)."""
DEFAULT_NUM_DRAFT_TOKENS = 3
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
"""mlx-lm's default: the first 5000 tokens stay unquantized."""


NO_DEFAULTS = SamplingDefaults()
"""Sampling as each dialect defaults it."""


class OptionError(ValueError):
    """A value an option cannot take; `option` names it (`--kv-bits`)."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


@attrs.frozen
class ModelOptions:
    """One served model's options (every field's default: as without the option)."""

    model: str | None = None
    """The `--model` this serves, when its served id is another name (`MODEL:ADAPTER`)."""
    draft_model: str | None = None
    """A smaller model with the same tokenizer, for speculative decoding."""
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    draft_always: bool = False
    """Draft every request the draft can serve; by default (False) a model drafts only while
    that measures faster than decoding alone (runner.engine.speculative). For tests and
    `just bench speculative`."""
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    adapter_path: str | None = None
    """A LoRA adapter (mlx-lm's format: adapter_config.json + adapters.safetensors), a
    directory or a Hugging Face id."""
    chat_template: str | None = None
    """A Jinja chat template in place of the tokenizer's (the text, not a path)."""
    chat_template_args: Mapping[str, Any] = attrs.field(factory=dict)
    """Defaults for the template's arguments; a request's chat_template_kwargs win."""
    trust_remote_code: bool = False
    sampling: SamplingDefaults = NO_DEFAULTS

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None and self.num_draft_tokens > 0

    def base(self, served: str) -> str:
        """The model (its `--model` value) that the id `served` serves."""
        return self.model if self.model is not None else served


def served_id(model: str, adapter: str | None) -> str:
    """The id `model` is served as with `adapter`: `MODEL:ADAPTER`, ADAPTER the adapter's
    directory name (a Hub id's last part); `model` itself without one."""
    if adapter is None:
        return model
    return f"{model}:{Path(adapter.rstrip('/')).name}"


def per_model(option: str, values: Iterable[str], models: tuple[str, ...]) -> dict[str, str]:
    """`[MODEL=]VALUE` entries of `option`, by model: `VALUE` alone is for every model, and
    `MODEL=VALUE` (MODEL one of `models`) for one; an entry later overrides an earlier one."""
    return per_served(option, values, {model: model for model in models})


def per_served(option: str, values: Iterable[str], served: Mapping[str, str]) -> dict[str, str]:
    """As `per_model`, by served id (`served`: each id's model): `MODEL=VALUE` is for every
    id of the model, `MODEL:ADAPTER=VALUE` for that id alone."""
    found: dict[str, str] = {}
    names = tuple(dict.fromkeys((*served.values(), *served)))
    for entry in values:
        name, value = _split(option, entry, names)
        for key, model in served.items():
            if name is None or name in (key, model):
                found[key] = value
    return found


def _split(option: str, entry: str, names: tuple[str, ...]) -> tuple[str | None, str]:
    """(MODEL, VALUE) of `MODEL=VALUE`, (None, VALUE) of a `VALUE` for every model."""
    name, sep, value = entry.partition("=")
    if sep and name in names:
        return name, value
    if sep and name and not _looks_like_value(entry):
        models = ", ".join(n for n in names if ":" not in n)
        raise OptionError(
            f"{name!r} is not one of the --model values ({models}); "
            "give VALUE for every model or MODEL=VALUE",
            option,
        )
    return None, entry


def served_models(models: tuple[str, ...], adapter_path: Iterable[str]) -> dict[str, str | None]:
    """Each served id's adapter (None: the model itself), in `models`' order: a model's
    `MODEL=DIR` entries, or else the `DIR` entries for every model; `MODEL=` is the model
    without an adapter. Two ids alike are an `OptionError`."""
    if len(set(models)) != len(models):
        raise OptionError("a model is named twice", "--model")
    common: list[str | None] = []
    own: dict[str, list[str | None]] = {}
    for entry in adapter_path:
        name, value = _split("--adapter-path", entry, models)
        adapter = value or None
        (common if name is None else own.setdefault(name, [])).append(adapter)
    served: dict[str, str | None] = {}
    for model in models:
        for adapter in own.get(model, common) or [None]:
            key = served_id(model, adapter)
            if key in served:
                raise OptionError(
                    f"{key} is served twice: two adapters of one model need different "
                    "directory names",
                    "--adapter-path",
                )
            served[key] = adapter
    return served


def _looks_like_value(entry: str) -> bool:
    """A value with a `=` of its own (a template, JSON, a path), not MODEL=VALUE."""
    name = entry.partition("=")[0]
    return any(c in name for c in "{}[]<>%\"' \n") or Path(entry).exists()


def model_options(  # the runner command's options, by name
    models: tuple[str, ...],
    *,
    draft_model: Iterable[str] = (),
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    kv_bits: int | None = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    adapter_path: Iterable[str] = (),
    chat_template: Iterable[str] = (),
    chat_template_args: Iterable[str] = (),
    trust_remote_code: bool = False,
    sampling: SamplingDefaults = NO_DEFAULTS,
) -> dict[str, ModelOptions]:
    """Each model's options from the command's; `OptionError` for a value that cannot be."""
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise OptionError(f"must be 4 or 8, not {kv_bits}", "--kv-bits")
    if kv_group_size not in (32, 64, 128):
        raise OptionError(f"must be 32, 64 or 128, not {kv_group_size}", "--kv-group-size")
    if quantized_kv_start < 0:
        raise OptionError("must be at least 0", "--quantized-kv-start")
    if num_draft_tokens < 1:
        raise OptionError("must be at least 1", "--num-draft-tokens")
    _check_sampling(sampling)
    adapters = served_models(models, adapter_path)
    bases = {key: _base(key, adapter, models) for key, adapter in adapters.items()}
    drafts = per_served("--draft-model", draft_model, bases)
    templates = {
        m: _template(t) for m, t in per_served("--chat-template", chat_template, bases).items()
    }
    arguments = {
        m: _arguments(a)
        for m, a in per_served("--chat-template-args", chat_template_args, bases).items()
    }
    return {
        model: ModelOptions(
            model=None if bases[model] == model else bases[model],
            draft_model=drafts.get(model),
            num_draft_tokens=num_draft_tokens,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
            adapter_path=adapters[model],
            chat_template=templates.get(model),
            chat_template_args=arguments.get(model, {}),
            trust_remote_code=trust_remote_code,
            sampling=sampling,
        )
        for model in adapters
    }


def _base(key: str, adapter: str | None, models: tuple[str, ...]) -> str:
    """The model the served id `key` serves."""
    return next(m for m in models if served_id(m, adapter) == key)


def _template(value: str) -> str:
    """A template's text: the file `value` names, or `value` itself when it is Jinja."""
    if "\n" not in value and Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise OptionError(
        f"no template file at {value} (nor is it a template's text: that holds {{{{ or {{%)",
        "--chat-template",
    )


def _arguments(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise OptionError(f"not JSON: {exc}", "--chat-template-args") from exc
    if not isinstance(parsed, dict):
        raise OptionError("must be a JSON object", "--chat-template-args")
    for reserved in ("messages", "tools", "add_generation_prompt", "tokenize"):
        if reserved in parsed:
            raise OptionError(f"may not set {reserved!r}", "--chat-template-args")
    return parsed


def _check_sampling(sampling: SamplingDefaults) -> None:
    if sampling.temperature is not None and not 0 <= sampling.temperature <= 2:
        raise OptionError("must be between 0 and 2", "--temp")
    if sampling.top_p is not None and not 0 < sampling.top_p <= 1:
        raise OptionError("must be more than 0 and at most 1", "--top-p")
    if sampling.top_k is not None and sampling.top_k < 0:
        raise OptionError("must be at least 0 (0: off)", "--top-k")
    if sampling.min_p is not None and not 0 <= sampling.min_p <= 1:
        raise OptionError("must be between 0 and 1", "--min-p")
    if sampling.max_tokens is not None and sampling.max_tokens < 1:
        raise OptionError("must be at least 1", "--max-tokens")


def head_width(config: dict[str, Any]) -> int | None:
    """The width of an attention head, as the model's config gives it (None: not said)."""
    text = config.get("text_config") or {}
    for where in (config, text):
        if isinstance(where.get("head_dim"), int):
            return int(where["head_dim"])
    for where in (config, text):
        hidden, heads = where.get("hidden_size"), where.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            return hidden // heads
    return None


def fitting_groups(width: int) -> list[int]:
    """The `--kv-group-size` values that divide a head `width` values wide."""
    return [size for size in (32, 64, 128) if width % size == 0]


def kv_group_problem(name: str, width: int, option: ModelOptions) -> str | None:
    """Why `option`'s KV quantization cannot be applied to heads `width` wide (None: it can)."""
    if width % option.kv_group_size == 0:
        return None
    fits = fitting_groups(width)
    if not fits:
        return (
            f"{name}'s attention heads are {width} values wide: no group size (32, 64, 128) "
            "divides them, so its KV cache cannot be quantized; leave out --kv-bits"
        )
    return (
        f"{name}'s attention heads are {width} values wide: --kv-group-size "
        f"{option.kv_group_size} does not divide them (use {' or '.join(map(str, fits))})"
    )
