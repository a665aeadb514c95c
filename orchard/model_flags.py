"""`orchard runner`'s options for its models, as mlx_lm.server names them (runner.model_options
says what each does; docs/operations.md has the table of mlx_lm.server's and Orchard's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from protocol.frames import SamplingDefaults
from runner.model_options import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_QUANTIZED_KV_START,
    ModelOptions,
    OptionError,
    model_options,
)

F = TypeVar("F", bound=Callable[..., Any])

PER_MODEL = "[MODEL=]VALUE"
_FOR_ONE = " Repeatable: VALUE for every --model, MODEL=VALUE for one."

FLAGS = (
    "draft_model",
    "num_draft_tokens",
    "kv_bits",
    "kv_group_size",
    "quantized_kv_start",
    "adapter_path",
    "chat_template",
    "chat_template_args",
    "trust_remote_code",
    "temp",
    "top_p",
    "top_k",
    "min_p",
    "default_max_tokens",
)
"""The parameter names these options give the command."""


def model_flags(command: F) -> F:
    """Add the options to `command`."""
    options = [
        click.option(
            "--draft-model",
            multiple=True,
            metavar=PER_MODEL,
            help="A small model with the model's tokenizer for speculative decoding (a lone "
            "request drafts with it while that measures faster; concurrent ones decode "
            "batched without it). Its tokenizer is compared at start." + _FOR_ONE,
        ),
        click.option(
            "--num-draft-tokens",
            type=int,
            default=DEFAULT_NUM_DRAFT_TOKENS,
            show_default=True,
            help="Tokens the draft model proposes per step.",
        ),
        click.option(
            "--kv-bits",
            type=int,
            default=None,
            help="Quantize the KV cache to 4 or 8 bits (past --quantized-kv-start tokens; "
            "batch rows stay at full width, kept prompts are quantized).",
        ),
        click.option(
            "--kv-group-size",
            type=int,
            default=DEFAULT_KV_GROUP_SIZE,
            show_default=True,
            help="Group size of the KV cache's quantization.",
        ),
        click.option(
            "--quantized-kv-start",
            type=int,
            default=DEFAULT_QUANTIZED_KV_START,
            show_default=True,
            help="With --kv-bits: tokens a request's cache holds before it is quantized.",
        ),
        click.option(
            "--adapter-path",
            multiple=True,
            metavar=PER_MODEL,
            help="A LoRA adapter (mlx-lm's format: a directory or a Hugging Face id); the "
            "model is served as MODEL:ADAPTER (the adapter's directory name). MODEL=DIR "
            "given again serves the model once per adapter, and MODEL= (no DIR) without one "
            "as well. A directory is checked at start, a Hub id once downloaded." + _FOR_ONE,
        ),
        click.option(
            "--chat-template",
            multiple=True,
            metavar=PER_MODEL,
            help="A chat template (Jinja text, or a file) in place of the tokenizer's." + _FOR_ONE,
        ),
        click.option(
            "--chat-template-args",
            multiple=True,
            metavar=PER_MODEL,
            help="A JSON object of chat template arguments, e.g. "
            "'{\"enable_thinking\": false}'; a request's chat_template_kwargs override "
            "them." + _FOR_ONE,
        ),
        click.option(
            "--trust-remote-code",
            is_flag=True,
            help="Let a model's tokenizer run code from its repository.",
        ),
        click.option("--temp", type=float, default=None, help="Default temperature."),
        click.option("--top-p", type=float, default=None, help="Default top_p."),
        click.option("--top-k", type=int, default=None, help="Default top_k (0: off)."),
        click.option("--min-p", type=float, default=None, help="Default min_p."),
        click.option(
            "--max-tokens",
            "default_max_tokens",
            type=int,
            default=None,
            help="Default bound on a completion's tokens (without it: the context's rest).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def options_of(models: tuple[str, ...], values: dict[str, Any]) -> dict[str, ModelOptions]:
    """Each model's options from the command's parsed `values`; a bad one is a usage error."""
    sampling = SamplingDefaults(
        temperature=values["temp"],
        top_p=values["top_p"],
        top_k=values["top_k"],
        min_p=values["min_p"],
        max_tokens=values["default_max_tokens"],
    )
    try:
        return model_options(
            models,
            draft_model=values["draft_model"],
            num_draft_tokens=values["num_draft_tokens"],
            kv_bits=values["kv_bits"],
            kv_group_size=values["kv_group_size"],
            quantized_kv_start=values["quantized_kv_start"],
            adapter_path=values["adapter_path"],
            chat_template=values["chat_template"],
            chat_template_args=values["chat_template_args"],
            trust_remote_code=values["trust_remote_code"],
            sampling=sampling,
        )
    except OptionError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from exc
