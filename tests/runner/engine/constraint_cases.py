"""What the constrained decoding test modules share (test_constraint_grammars, _processor,
_engines, test_fast_forward and test_batch_forward): example tools and bounded schemas, a
request's constraint compiled on a tokenizer, the tokens its processor leaves open, and a
request decoded a token at a time."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np

from protocol.frames import Generate, ResponseFormat, Tool
from runner.engine.constraint import Constraint, constraint_for
from runner.engine.masking import ConstraintProcessor
from runner.engine.sampling import make_logits_processors
from tests.runner.engines import GREEDY, Reference, ask, greedy_tokens

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


CRATES: dict[str, Any] = {
    "type": "object",
    "properties": {
        "crates": {
            "type": "array",
            "items": SMALL,
            "minItems": 4,
            "maxItems": 4,
        },
        "done": {"const": True},
    },
    "required": ["crates", "done"],
    "additionalProperties": False,
}
"""Four bounded objects: mostly forced text (keys, quotes, commas), a few chosen values."""


def crates(request_id: str, prompt: str = "Crates?", **fields: Any) -> Generate:
    """A greedy request for CRATES (300 tokens at most unless given)."""
    return ask(
        request_id,
        prompt,
        max_tokens=fields.pop("max_tokens", 300),
        sampling=fields.pop("sampling", GREEDY),
        response_format=schema_format(CRATES),
        **fields,
    )


def stepwise(reference: Reference, request: Generate) -> list[int]:
    """The request decoded a token at a time (mlx-lm's stream_generate, greedy), every
    token's mask computed (its processor forces nothing); free text without one."""
    assert request.max_tokens is not None
    prompt = reference.prompt(request)
    guard = None
    if request.response_format is not None:
        constraint = compile_for(reference.tokenizer, response_format=request.response_format)
        guard = constraint.processor(forcing=False)
    processors = make_logits_processors(request.sampling, len(prompt), guard)
    return greedy_tokens(
        reference.model, reference.tokenizer, prompt, request.max_tokens, processors
    )
