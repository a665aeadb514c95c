"""The JSON pieces every OpenAI answer shares: `usage`, finish reasons, `tool_calls`
entries, logprob entries and `system_fingerprint`."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from protocol.core.calls import Call
from protocol.frames import FinishReason, TokenLogprob, ToolCallDelta, Usage

FINISH_REASONS: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "cancelled": "stop",
}


def system_fingerprint(orchard_version: str, model: str, engine: str | None) -> str:
    """OpenAI's `system_fingerprint` ("fp_" and 10 hex digits): a hash of what decides the
    output besides the request (Orchard's version, the model, the runner's engine)."""
    digest = hashlib.sha256(f"{orchard_version}\0{model}\0{engine or ''}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


def tool_call_entries(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """A delta's `tool_calls`: consecutive pieces of one call joined into one entry."""
    entries: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.id is None and entries and entries[-1]["index"] == delta.index:
            entries[-1]["function"]["arguments"] += delta.arguments
        elif delta.id is None:
            entries.append({"index": delta.index, "function": {"arguments": delta.arguments}})
        else:
            entries.append(
                {
                    "index": delta.index,
                    "id": delta.id,
                    "type": "function",
                    "function": {"name": delta.name or "", "arguments": delta.arguments},
                }
            )
    return entries


def logprob_entries(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's ChatCompletionTokenLogprob objects."""
    return [
        {
            "token": entry.token,
            "logprob": entry.logprob,
            "bytes": list(entry.bytes),
            "top_logprobs": [
                {"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)}
                for top in entry.top_logprobs
            ],
        }
        for entry in entries
    ]


def openai_finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish_reason for an internal one ("cancelled" becomes "stop")."""
    return FINISH_REASONS[reason]


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object (CompletionUsage) for a `Usage`."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def call_entries(calls: Sequence[Call]) -> list[dict[str, Any]]:
    """A finished message's `tool_calls`: one entry per whole call (protocol.core.calls)."""
    return [
        {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
