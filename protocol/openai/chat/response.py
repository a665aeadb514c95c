"""Build OpenAI Chat Completions objects: stream chunks and the non-streaming body.

The shapes follow openapi.yaml (CreateChatCompletionStreamResponse,
CreateChatCompletionResponse, CompletionUsage); the order chunks go in is
`protocol.core.stream`'s. Every chunk has id, object, created, model, system_fingerprint and
one choice {index 0, delta, logprobs, finish_reason}; with include_usage every chunk also has
"usage": null (the usage so far with continuous_usage_stats), without it no usage key.
`system_fingerprint` names the serving configuration: it changes when the model, the runner's
engine or Orchard's version does (`system_fingerprint()`). Reasoning text goes in
`reasoning_content` (vLLM, exo). A delta's tool calls are `{index, id, type, function: {name,
arguments}}` for a call's first piece and `{index, function: {arguments}}` after; a chunk's
logprobs are `{"content": [...], "refusal": null}` for requests that asked for them.

The internal finish reason "cancelled" is not an OpenAI value; it is sent as "stop" (the text
ended where the client or the gateway asked it to); the browser socket's `done` message says
"cancelled".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from protocol.core.calls import assemble
from protocol.core.stream import CompletionBuilder, Framing
from protocol.frames import Chunk, FinishReason, TokenLogprob, ToolCallDelta, Usage
from protocol.openai.chat.request import ChatRequest
from protocol.openai.objects import (
    FINISH_REASONS,
    call_entries,
    logprob_entries,
    tool_call_entries,
    usage_dict,
)

_ROLE_DELTA = b'{"role":"assistant","content":"","refusal":null}'
_NO_FINISH = b',"logprobs":null,"finish_reason":null}]'


class ChunkWriter:
    """Renders the chunk objects of one streamed chat completion (the order they go in is
    `protocol.core.stream.CompletionStream`'s).

    The parts of a chunk that never change (id, created, model) are serialized once, so
    each token costs one small `orjson.dumps` of the delta.
    """

    __slots__ = (
        "_choice_head",
        "_choice_heads",
        "_end",
        "_head",
        "_prefix",
        "_usage_head",
        "continuous_usage_stats",
        "include_usage",
        "logprobs",
    )

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        include_usage: bool = False,
        continuous_usage_stats: bool = False,
        *,
        logprobs: bool = False,
        fingerprint: str | None = None,
        prefix: bytes = b"data: ",
        suffix: bytes = b"\n\n",
    ) -> None:
        """`prefix` and `suffix` frame each chunk: an SSE event by default; the browser socket
        wraps chunks in its own envelope instead. `logprobs`: the request asked for them."""
        self.include_usage = include_usage
        self.continuous_usage_stats = continuous_usage_stats and include_usage
        self.logprobs = logprobs
        head = orjson.dumps(
            {
                "id": id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": fingerprint,
            }
        )[:-1]
        self._prefix = prefix
        self._head = head
        self._choice_head = prefix + head + b',"choices":[{"index":0,"delta":'
        self._choice_heads: dict[int, bytes] = {0: self._choice_head}
        self._usage_head = prefix + head + b',"choices":[],"usage":'
        self._end = b"}" + suffix

    def _head_of(self, index: int) -> bytes:
        """The bytes up to a chunk's delta, for choice `index`."""
        head = self._choice_heads.get(index)
        if head is None:
            head = self._choice_heads[index] = (
                self._prefix + self._head + b',"choices":[{"index":%d,"delta":' % index
            )
        return head

    def role(self, usage: Usage | None = None, index: int = 0) -> bytes:
        """A choice's first chunk: the assistant role and empty content.

        With continuous_usage_stats it carries `usage` if given, else "usage": null.
        """
        return self._head_of(index) + _ROLE_DELTA + _NO_FINISH + self._usage(usage) + self._end

    def chunk(self, chunk: Chunk) -> bytes:
        """What a runner's chunk shows: a delta with what it has (text, reasoning, tool calls,
        logprobs the request asked for, or tokens with continuous_usage_stats); b"" if none."""
        if (
            chunk.text
            or chunk.reasoning
            or chunk.tool_calls
            or (chunk.logprobs and self.logprobs)
            or (self.continuous_usage_stats and chunk.tokens)
        ):
            return self.delta(
                chunk.text,
                chunk.reasoning,
                chunk.usage,
                tool_calls=chunk.tool_calls,
                logprobs=chunk.logprobs,
                index=chunk.index,
            )
        return b""

    def delta(
        self,
        content: str,
        reasoning: str,
        usage: Usage,
        *,
        tool_calls: Sequence[ToolCallDelta] = (),
        logprobs: Sequence[TokenLogprob] = (),
        index: int = 0,
    ) -> bytes:
        """A chunk of text; the delta has only the non-empty keys (an empty delta is {})."""
        if tool_calls or logprobs or index:
            return self._rich_delta(
                content, reasoning, usage, tool_calls=tool_calls, logprobs=logprobs, index=index
            )
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

    def _rich_delta(
        self,
        content: str,
        reasoning: str,
        usage: Usage,
        *,
        tool_calls: Sequence[ToolCallDelta],
        logprobs: Sequence[TokenLogprob],
        index: int,
    ) -> bytes:
        """A delta with tool calls or logprobs, or of a choice past the first (off the
        plain-text fast path)."""
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_call_entries(tool_calls)
        choice_logprobs = (
            {"content": logprob_entries(logprobs), "refusal": None}
            if self.logprobs and logprobs
            else None
        )
        return b"".join(
            (
                self._head_of(index),
                orjson.dumps(delta),
                b',"logprobs":',
                orjson.dumps(choice_logprobs),
                b',"finish_reason":null}]',
                self._usage(usage),
                self._end,
            )
        )

    def finish(self, reason: FinishReason, usage: Usage, index: int = 0) -> bytes:
        """A choice's last chunk: an empty delta and the finish_reason."""
        return b"".join(
            (
                self._head_of(index),
                b'{},"logprobs":null,"finish_reason":"',
                FINISH_REASONS[reason].encode(),
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
    tool_calls: Sequence[ToolCallDelta] = (),
    logprobs: Sequence[TokenLogprob] | None = None,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The non-streaming response body (object "chat.completion") of one choice."""
    return completion_body(
        id=id,
        created=created,
        model=model,
        choices=[
            choice(0, content, reasoning, finish_reason, tool_calls=tool_calls, logprobs=logprobs)
        ],
        usage=usage,
        fingerprint=fingerprint,
    )


def completion_body(
    *,
    id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: Usage,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The non-streaming response body (object "chat.completion") of `choices`."""
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage_dict(usage),
    }


def chat_completion_body(
    builder: CompletionBuilder,
    *,
    id: str,
    created: int,
    model: str,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The chat.completion body of what `builder` collected; raises the request's error if it
    failed (or never finished)."""
    choices, usage = builder.result()
    return completion_body(
        id=id,
        created=created,
        model=model,
        choices=[
            choice(
                index,
                "".join(c.content),
                "".join(c.reasoning),
                # A choice still open when the request ended was cut short with it.
                c.finish or "cancelled",
                tool_calls=c.tool_calls,
                logprobs=c.logprobs if builder.wants_logprobs else None,
            )
            for index, c in enumerate(choices)
        ],
        usage=usage,
        fingerprint=fingerprint,
    )


def choice(
    index: int,
    content: str,
    reasoning: str,
    finish_reason: FinishReason,
    *,
    tool_calls: Sequence[ToolCallDelta] = (),
    logprobs: Sequence[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """One choice of a non-streaming response. `logprobs` None: the request did not ask for
    them. A message with tool calls and no text has content null."""
    calls = call_entries(assemble(tool_calls))
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if calls and not content else content,
        "refusal": None,
        "annotations": [],
    }
    if calls:
        for call in calls:
            del call["index"]
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return {
        "index": index,
        "message": message,
        "logprobs": None
        if logprobs is None
        else {"content": logprob_entries(logprobs), "refusal": None},
        "finish_reason": FINISH_REASONS[finish_reason],
    }


def chat_writer(
    chat: ChatRequest, *, id: str, created: int, fingerprint: str | None, framing: Framing
) -> ChunkWriter:
    """The writer of a chat request's stream, framed as `framing` frames chunks (SSE, or the
    browser socket's envelope)."""
    return ChunkWriter(
        id,
        created,
        chat.model,
        chat.include_usage,
        chat.continuous_usage_stats,
        logprobs=chat.logprobs,
        fingerprint=fingerprint,
        prefix=framing.chunk_prefix,
        suffix=framing.chunk_suffix,
    )
