"""What the family test modules share (test_families, test_batch_forward): a tool every
family's template renders, and a request to a family's built-in model."""

from __future__ import annotations

import json
from typing import Any

from protocol.frames import Generate, Message, Tool
from runner.demo_families import FAMILIES

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Köln"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = Tool("get_weather", "The weather in a city.", json.dumps(SCHEMA))


def ask(
    family: str,
    request_id: str,
    content: str = "What is the weather like in Paris?",
    **fields: Any,
) -> Generate:
    """A request to the family's model; think spans closed (the random models never close
    one), Harmony at low effort."""
    effort = "low" if family == "harmony" else ("none" if FAMILIES[family].think else None)
    fields.setdefault("reasoning_effort", effort)
    fields.setdefault("max_tokens", 200)
    return Generate(request_id, FAMILIES[family].model_id, (Message("user", content),), **fields)
