"""A Messages answer in Anthropic's wire shape, streamed and whole. No I/O.

Streamed, `MessageWriter` is the dialect's `ChoiceWriter` in the shared `CompletionStream`
(protocol.core.stream, which owns the order, the errors and the cancel), framed by
`ANTHROPIC_SSE` (`event: <name>` then `data: <json>`):

    message_start        the message with no content, stop_reason null, usage with the prompt
                         (input_tokens 0 when the stream had to start before the runner's
                         first chunk: the message_delta then carries it)
    ping                 once after message_start, then as the keep-alive
    content_block_start  a block opens: thinking (reasoning), text, tool_use (a call's id and
                         name); a different kind of output closes the open block first
    content_block_delta  thinking_delta, text_delta, input_json_delta (a call's arguments as
                         the model writes them)
    content_block_stop   the open block closes (at a change of block, or at the end)
    message_delta        stop_reason and the whole request's usage
    message_stop

or, at any point, `event: error` with Anthropic's error body, and nothing after it. A request
cancelled before its end (not by the client, which is gone then) ends with an error event: the
Messages API has no stop_reason for it.

Usage: the runner's prompt_tokens counts every prompt token, cached ones included (OpenAI's
convention); Anthropic's input_tokens does not. So input_tokens = prompt_tokens -
cached_tokens, cache_read_input_tokens = cached_tokens, cache_creation_input_tokens = 0 (the
prefix cache is filled as a side effect, not billed apart), output_tokens = completion_tokens
(reasoning included).

`message_body` is the non-streaming twin, built from a `CompletionBuilder`'s result.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

from protocol.anthropic.errors import error_body
from protocol.core.calls import assemble, call_input, call_text
from protocol.core.errors import ApiError, server_error
from protocol.core.stream import CollectedChoice
from protocol.frames import Chunk, FinishReason, ToolCallDelta, Usage

StopReason = Literal["end_turn", "max_tokens", "tool_use", "stop_sequence"]
STOP_REASONS: dict[FinishReason, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
CANCELLED = "The request was cancelled before it finished."


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic writes them."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def usage_of(usage: Usage) -> dict[str, int]:
    """The runner's usage in Anthropic's fields (see the module docstring)."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` id for a runner's call id (the same for a stream and a body)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(reason: FinishReason, matched_stop: str | None = None) -> StopReason:
    """The stop_reason of a finished answer (`matched_stop`: the stop sequence that ended
    it); a cancelled one has none (an error instead)."""
    if reason == "cancelled":
        raise server_error(CANCELLED)
    if reason == "stop" and matched_stop is not None:
        return "stop_sequence"
    return STOP_REASONS[reason]


class AnthropicSseFraming:
    """`event:` lines; an error is an `error` event; nothing after the last event."""

    chunk_prefix = b""
    chunk_suffix = b""

    def error(self, err: ApiError) -> bytes:
        return event("error", error_body(err))

    def end(self, finish_reason: FinishReason | None, usage: Usage | None) -> bytes:
        return b""


ANTHROPIC_SSE = AnthropicSseFraming()


class MessageWriter:
    """One streamed message's events (see the module docstring); keeps which content block
    is open."""

    __slots__ = ("_block", "_count", "_id", "_model", "_stop")

    include_usage = False

    def __init__(self, id: str, model: str) -> None:
        self._id = id
        self._model = model
        self._count = 0
        """Content blocks opened so far."""
        self._block: tuple[str, int] | None = None
        """The open block: its kind ("thinking", "text", or "tool_use") and, for a tool
        call, the call's index."""
        self._stop: str | None = None
        """The stop sequence that ended the answer (on its last chunk)."""

    def role(self, usage: Usage | None, index: int) -> bytes:
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_of(usage or Usage(0, 0)),
        }
        return event("message_start", {"type": "message_start", "message": message}) + PING

    def chunk(self, chunk: Chunk) -> bytes:
        if chunk.matched_stop is not None:
            self._stop = chunk.matched_stop
        out: list[bytes] = []
        if chunk.reasoning:
            self._open("thinking", 0, {"type": "thinking", "thinking": "", "signature": ""}, out)
            out.append(self._delta({"type": "thinking_delta", "thinking": chunk.reasoning}))
        if chunk.text:
            self._open("text", 0, {"type": "text", "text": ""}, out)
            out.append(self._delta({"type": "text_delta", "text": chunk.text}))
        for call in chunk.tool_calls:
            self._tool_call(call, out)
        return b"".join(out)

    def finish(self, reason: FinishReason, usage: Usage, index: int) -> bytes:
        if reason == "cancelled":
            return event("error", error_body(server_error(CANCELLED)))
        out: list[bytes] = []
        self._close(out)
        delta = {
            "stop_reason": stop_reason(reason, self._stop),
            "stop_sequence": self._stop if reason == "stop" else None,
        }
        out.append(
            event(
                "message_delta", {"type": "message_delta", "delta": delta, "usage": usage_of(usage)}
            )
        )
        out.append(event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def usage_chunk(self, usage: Usage) -> bytes:
        return b""

    def _tool_call(self, call: ToolCallDelta, out: list[bytes]) -> None:
        if call.id is not None:  # a call's first delta
            block = {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name or "",
                "input": {},
            }
            self._close(out)
            self._open("tool_use", call.index, block, out)
        if call.arguments and self._block == ("tool_use", call.index):
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))

    def _open(self, kind: str, key: int, block: dict[str, Any], out: list[bytes]) -> None:
        if self._block == (kind, key):
            return
        self._close(out)
        self._block = (kind, key)
        self._count += 1
        out.append(
            event(
                "content_block_start",
                {"type": "content_block_start", "index": self._count - 1, "content_block": block},
            )
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._count - 1, "delta": delta},
        )

    def _close(self, out: list[bytes]) -> None:
        if self._block is None:
            return
        self._block = None
        out.append(
            event("content_block_stop", {"type": "content_block_stop", "index": self._count - 1})
        )


def message_body(choice: CollectedChoice, usage: Usage, *, id: str, model: str) -> dict[str, Any]:
    """The non-streaming `message`: thinking, text and tool_use blocks, in that order (the
    order the model writes them in), each only when not empty."""
    content: list[dict[str, Any]] = []
    reasoning = "".join(choice.reasoning)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    calls, unparsed = _tool_uses(choice.tool_calls)
    text = "".join(choice.content) + unparsed
    if text:
        content.append({"type": "text", "text": text})
    content.extend(calls)
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice.finish or "cancelled", choice.matched_stop),
        "stop_sequence": choice.matched_stop if choice.finish == "stop" else None,
        "usage": usage_of(usage),
    }


def _tool_uses(deltas: list[ToolCallDelta]) -> tuple[list[dict[str, Any]], str]:
    """The tool_use blocks of the calls, and the text of those whose arguments are not a JSON
    object (cut short by max_tokens, say: protocol.core.calls), which goes out as text."""
    blocks = []
    unparsed = []
    for call in assemble(deltas):
        if call.id is None:
            continue  # never opened: nothing to name it by
        arguments = call.arguments or "{}"
        parsed = call_input(arguments)
        if parsed is None:
            unparsed.append(call_text(call.name, arguments))
            continue
        blocks.append(
            {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": parsed}
        )
    return blocks, "".join(unparsed)
