"""What `orchard runner` is told about each model beyond its name, as mlx_lm.server's options
give it: a draft model for speculative decoding, a quantized KV cache, a LoRA adapter, the
chat template and its arguments, and sampling defaults for requests that set none.

Options that belong to one model (`--draft-model`, `--adapter-path`, `--chat-template`,
`--chat-template-args`) take `VALUE` for every model, or `MODEL=VALUE` for the `--model` of
that name; the others hold for every model. No MLX here: `orchard --help` imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

KV_BITS = (4, 8)
"""What `--kv-bits` takes (mlx-lm's quantized KV cache)."""
DEFAULT_NUM_DRAFT_TOKENS = 3
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
"""mlx-lm's default: the first 5000 tokens stay unquantized."""


class OptionError(ValueError):
    """A value an option cannot take; `option` names it (`--kv-bits`)."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


@attrs.frozen
class SamplingDefaults:
    """What a request gets when it sets none of these (None: OpenAI's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None

    def shown(self) -> dict[str, float | int]:
        """The ones set, by their request names (for /v1/runners)."""
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.frozen
class ModelOptions:
    """One model's options (every field's default: as without the option)."""

    draft_model: str | None = None
    """A smaller model with the same tokenizer, for speculative decoding."""
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
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
    sampling: SamplingDefaults = SamplingDefaults()

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None and self.num_draft_tokens > 0


def per_model(option: str, values: Iterable[str], models: tuple[str, ...]) -> dict[str, str]:
    """`[MODEL=]VALUE` entries of `option`, by model: `VALUE` alone is for every model, and
    `MODEL=VALUE` (MODEL one of `models`) for one; an entry later overrides an earlier one."""
    found: dict[str, str] = {}
    for entry in values:
        name, sep, value = entry.partition("=")
        if sep and name in models:
            found[name] = value
        elif sep and name and not _looks_like_value(entry):
            raise OptionError(
                f"{name!r} is not one of the --model values ({', '.join(models)}); "
                "give VALUE for every model or MODEL=VALUE",
                option,
            )
        else:
            for model in models:
                found[model] = entry
    return found


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
    sampling: SamplingDefaults = SamplingDefaults(),
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
    drafts = per_model("--draft-model", draft_model, models)
    adapters = per_model("--adapter-path", adapter_path, models)
    templates = {
        m: _template(t) for m, t in per_model("--chat-template", chat_template, models).items()
    }
    arguments = {
        m: _arguments(a)
        for m, a in per_model("--chat-template-args", chat_template_args, models).items()
    }
    return {
        model: ModelOptions(
            draft_model=drafts.get(model),
            num_draft_tokens=num_draft_tokens,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
            adapter_path=adapters.get(model),
            chat_template=templates.get(model),
            chat_template_args=arguments.get(model, {}),
            trust_remote_code=trust_remote_code,
            sampling=sampling,
        )
        for model in models
    }


def _template(value: str) -> str:
    """A template's text: `value` itself, or the file it names."""
    path = Path(value)
    if "{" not in value and path.suffix in (".jinja", ".j2", ".txt", ".tmpl", ""):
        if not path.is_file():
            raise OptionError(f"no template file at {value}", "--chat-template")
        return path.read_text(encoding="utf-8")
    return value


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
