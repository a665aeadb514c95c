"""What the constrained decoding test modules share (test_constraint_grammars, _processor and
_engines): example tools and a bounded schema, a request's constraint compiled on a
tokenizer, and the tokens its processor leaves open."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np

from protocol.frames import ResponseFormat, Tool
from runner.engine.constraint import Constraint, constraint_for
from runner.engine.masking import ConstraintProcessor
from tests.runner.engines import ask

WEATHER = Tool(
    "weather",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    ),
)
NOW = Tool("now")
"""No parameters: its arguments are `{}`."""

SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "color"],
    "additionalProperties": False,
}
"""A schema whose every value is bounded: any model finishes it in a few tokens."""


def schema_format(schema: dict[str, Any]) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema), "answer", strict=True)


def compile_for(tokenizer: Any, **fields: Any) -> Constraint:
    constraint = constraint_for(ask("r", **fields), tokenizer)
    assert constraint is not None
    return constraint


def allowed(processor: ConstraintProcessor, context: list[int], vocab: int) -> set[int]:
    """The token ids the processor leaves open after `context` (the last one just sampled)."""
    masked = processor(mx.array(context), mx.zeros((1, vocab)))
    return {int(i) for i in np.flatnonzero(np.array(masked[0]) > -np.inf)}
