"""The bounds every dialect's request parser enforces, and the shared checks that apply them:
a body's opening checks (`read_model_first`), the messages' size, stop strings. No I/O."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    clip,
    fail_too_long,
    fail_type,
    read_array,
    read_object,
    read_required_str,
)

MAX_MODEL_CHARS = 256
MAX_MESSAGES = 2048
MAX_PROMPT_CHARS = 4 * 1024 * 1024
"""Characters of all message contents and names together; the real bound is the context."""
MAX_STOP = 4
MAX_STOP_CHARS = 256
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SAMPLING_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "min_p": (0, 1),
    "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2),
}
"""The accepted range of each number parameter (OpenAI's; min_p is vLLM's)."""
TOP_K_MIN = -1
"""top_k of -1 or 0 means no top-k filter."""

CheckModel = Callable[[str], None]
"""Raises the error for a model nothing serves (404 model_not_found)."""


def read_model_first(data: Any, known: frozenset[str], check_model: CheckModel | None) -> str:
    """A body's opening checks, shared by the dialects: it is an object, its `model`
    (required, a string, at most MAX_MODEL_CHARS), then with `check_model` whether anything
    serves it, then that every field is one of `known`, before anything else is read, as
    OpenAI does. Returns the model."""
    data = read_object(data)
    model = read_required_str(data, "model")
    if len(model) > MAX_MODEL_CHARS:
        fail_too_long("model", MAX_MODEL_CHARS, len(model))
    if check_model is not None:
        check_model(model)
    unknown = [key for key in data if key not in known]
    if unknown:
        names = ", ".join(clip(key) for key in unknown[:10])
        plural = "s" if len(unknown) > 1 else ""
        raise invalid_request(
            f"Unrecognized request argument{plural} supplied: {names}",
            clip(unknown[0]),
            "unknown_parameter",
        )
    return model


def check_messages_chars(chars: int) -> None:
    """The messages' `chars` (as the dialect counts them) within MAX_PROMPT_CHARS (the chat's
    and Ollama's chat)."""
    if chars > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"Invalid 'messages': the messages are too long ({chars} characters; at most "
            f"{MAX_PROMPT_CHARS} are accepted).",
            "messages",
            "string_above_max_length",
        )


def read_stop_strings(value: Any, param: str, maximum: int, expected: str) -> tuple[str, ...]:
    """An optional array of at most `maximum` stop strings (`expected`: the type the error
    names): the chat's stop, Anthropic's stop_sequences and Ollama's options.stop."""
    items = read_array(value, param, maximum, expected)
    for i, item in enumerate(items):
        if type(item) is not str:
            fail_type(f"{param}[{i}]", "a string", item)
        check_stop_string(item, f"{param}[{i}]")
    return tuple(items)


def check_stop_string(value: str, param: str) -> str:
    """One stop string: not empty, at most MAX_STOP_CHARS characters."""
    if not value:
        raise invalid_request(
            f"Invalid '{param}': empty string. A stop sequence must not be empty.",
            param,
            "empty_string",
        )
    if len(value) > MAX_STOP_CHARS:
        fail_too_long(param, MAX_STOP_CHARS, len(value))
    return value


def check_ceiling(value: int | None, limit: int, param: str, per: str = "") -> None:
    """Refuse a value over one of the gateway's own ceilings (`--max-tokens-limit`,
    `--max-choices`), which every dialect applies after its own validation: a 400 naming
    the field as the dialect names it ("max_tokens", "options.num_predict", ...). `per`: what
    the ceiling counts, said after the limit (" choices per request")."""
    if value is not None and value > limit:
        raise invalid_request(
            f"{param} is {value}; this gateway allows at most {limit}{per}.",
            param,
            "integer_above_max_value",
        )
