"""The tool-call formats of the model families mlx-lm serves, each parsed as it is written.

`base` holds the contract every family's parser keeps; one module per family holds its
`FORMAT`; `format_for` picks the format of a loaded tokenizer.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from runner.tool_formats import grammars
from runner.tool_formats.base import CallFormat
from runner.tool_formats.whole import whole_format

STREAMED = (
    "json_tools",
    "qwen3_coder",
    "minimax_m2",
    "glm47",
    "kimi_k2",
    "mistral",
    "pythonic",
    "gemma4",
)
"""The mlx-lm tool parsers Orchard streams (`runner.tool_formats.<name>`, each a `FORMAT`)."""


def streamed_format(name: str) -> CallFormat | None:
    """Orchard's streaming format for mlx-lm's parser `name`, if it has one."""
    if name not in STREAMED:
        return None
    module = importlib.import_module(f"runner.tool_formats.{name}")
    found = module.FORMAT
    assert isinstance(found, CallFormat)
    grammar = getattr(grammars, name, None)
    if found.grammar is None and grammar is not None:
        found = attrs.evolve(found, grammar=grammar)
    return found


def format_for(tokenizer: Any) -> CallFormat | None:
    """The tool-call format of an mlx-lm `TokenizerWrapper` (None without tool calling): the
    streaming one for its parser where Orchard has one, else its parser read whole. The
    markers are the tokenizer's."""
    if not tokenizer.has_tool_calling:
        return None
    parse = tokenizer.tool_parser
    name = getattr(parse, "__module__", "").rsplit(".", 1)[-1]
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
    found = streamed_format(name)
    if found is None:
        return whole_format(name, start, end, parse)
    return attrs.evolve(found, start=start, end=end)


def forceable() -> list[str]:
    """The formats whose calls can be forced (they have a `CallFormat.grammar`)."""
    return [name for name in STREAMED if (found := streamed_format(name)) and found.grammar]
