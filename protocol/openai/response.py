"""Build OpenAI Chat Completions objects: stream chunks and the non-streaming body.

The shapes follow openapi.yaml (CreateChatCompletionStreamResponse,
CreateChatCompletionResponse, CompletionUsage); the order chunks go in is
`protocol.openai.stream`'s. Every chunk has id, object, created, model and one choice
{index 0, delta, logprobs null, finish_reason}; with include_usage every chunk also has
"usage": null (the usage so far with continuous_usage_stats), without it no usage key.
`system_fingerprint` and `service_tier` are left out: both are optional, and the spec types
the fingerprint as a string, which we have none of. Reasoning text goes in
`reasoning_content` (vLLM, exo).

The internal finish reason "cancelled" is not an OpenAI value; it is sent as "stop" (the text
ended where the client or the gateway asked it to); the browser socket's `done` message says
"cancelled".
"""

from __future__ import annotations

from typing import Any

import orjson

from protocol.frames import FinishReason, Usage

_FINISH_REASONS: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "cancelled": "stop",
}

_ROLE_DELTA = b'{"role":"assistant","content":""}'
_NO_FINISH = b',"logprobs":null,"finish_reason":null}]'


def openai_finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish_reason for an internal one ("cancelled" becomes "stop")."""
    return _FINISH_REASONS[reason]


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object (CompletionUsage) for a `Usage`."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


class ChunkWriter:
    """Renders the chunk objects of one streamed chat completion (the order they go in is
    `protocol.openai.stream.CompletionStream`'s).

    The parts of a chunk that never change (id, created, model) are serialized once, so
    each token costs one small `orjson.dumps` of the delta.
    """

    __slots__ = (
        "_choice_head",
        "_end",
        "_usage_head",
        "continuous_usage_stats",
        "include_usage",
    )

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        include_usage: bool = False,
        continuous_usage_stats: bool = False,
        *,
        prefix: bytes = b"data: ",
        suffix: bytes = b"\n\n",
    ) -> None:
        """`prefix` and `suffix` frame each chunk: an SSE event by default; the browser socket
        wraps chunks in its own envelope instead."""
        self.include_usage = include_usage
        self.continuous_usage_stats = continuous_usage_stats and include_usage
        head = orjson.dumps(
            {"id": id, "object": "chat.completion.chunk", "created": created, "model": model}
        )[:-1]
        self._choice_head = prefix + head + b',"choices":[{"index":0,"delta":'
        self._usage_head = prefix + head + b',"choices":[],"usage":'
        self._end = b"}" + suffix

    def role(self, usage: Usage | None = None) -> bytes:
        """The first chunk: the assistant role and empty content.

        With continuous_usage_stats it carries `usage` if given, else "usage": null.
        """
        return self._choice_head + _ROLE_DELTA + _NO_FINISH + self._usage(usage) + self._end

    def delta(self, content: str, reasoning: str, usage: Usage) -> bytes:
        """A chunk of text; the delta has only the non-empty keys (an empty delta is {})."""
        if reasoning:
            delta = (
                orjson.dumps({"reasoning_content": reasoning, "content": content})
                if content
                else orjson.dumps({"reasoning_content": reasoning})
            )
        elif content:
            delta = orjson.dumps({"content": content})
        else:
            delta = b"{}"
        return self._choice_head + delta + _NO_FINISH + self._usage(usage) + self._end

    def finish(self, reason: FinishReason, usage: Usage) -> bytes:
        """The last choice chunk: an empty delta and the finish_reason."""
        return b"".join(
            (
                self._choice_head,
                b'{},"logprobs":null,"finish_reason":"',
                _FINISH_REASONS[reason].encode(),
                b'"}]',
                self._usage(usage),
                self._end,
            )
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        """The chunk after the finish chunk with the whole request's usage and no choices.

        Empty bytes when the request did not ask for usage.
        """
        if not self.include_usage:
            return b""
        return self._usage_head + orjson.dumps(usage_dict(usage)) + self._end

    def _usage(self, usage: Usage | None) -> bytes:
        if not self.include_usage:
            return b""
        if self.continuous_usage_stats and usage is not None:
            return b',"usage":' + orjson.dumps(usage_dict(usage))
        return b',"usage":null'


def completion(
    *,
    id: str,
    created: int,
    model: str,
    content: str,
    reasoning: str,
    finish_reason: FinishReason,
    usage: Usage,
) -> dict[str, Any]:
    """The non-streaming response body (object "chat.completion")."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": _FINISH_REASONS[finish_reason],
            }
        ],
        "usage": usage_dict(usage),
    }
