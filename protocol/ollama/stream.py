"""What an Ollama client sees of one answer, streamed as NDJSON or whole. No I/O.

`/api/chat` writes one object per line:

    {"model", "created_at", "message": {"role": "assistant", "content", "thinking"?,
     "tool_calls"?}, "done": false}                             per chunk with something new
    {"model", "created_at", "message": {"role": "assistant", "content": ""},
     "done_reason", "done": true, "total_duration", "load_duration", "prompt_eval_count",
     "prompt_eval_duration", "eval_count", "eval_duration"}     last

and `/api/generate` the same with `"response"` (and `"thinking"`) in place of `"message"`,
`"done"` before `"done_reason"`, as Ollama orders them. An error ends a stream as the line
`{"error": "<message>"}` (which the ollama library raises as `ResponseError`).

`OllamaWriter` is the dialect's `ChoiceWriter` for `protocol.core.stream.CompletionStream`,
which keeps the order, the errors and the cancel; `NDJSON` is its framing. `answer_body`
builds the non-streaming answer from what a `TimedBuilder` collected.

Tool calls come whole in Ollama, their arguments an object: a call's argument deltas are
collected and the call is sent once complete (when the next call starts, or at the end). A
call whose arguments are not a JSON object (cut short by num_predict, say) is sent as content
text instead, `{"name": ..., "arguments": ...}` as the model wrote it.

Durations are in nanoseconds, measured by the gateway on a monotonic clock (`Timings`): from
the request's arrival to its placing on a runner (`load_duration`: the wait for a slot;
models stay loaded), from there to the first chunk (`prompt_eval_duration`), from the first
chunk to the end (`eval_duration`); `total_duration` is arrival to end. `created_at` is
the wall clock when the object is written, RFC 3339 in UTC with nanoseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import attrs
import orjson

from protocol.core.calls import Call, CallAssembler, call_input, call_text
from protocol.core.errors import ApiError
from protocol.core.stream import CollectedChoice, CompletionBuilder, Item
from protocol.frames import Chunk, FinishReason, ToolCallDelta, Usage
from protocol.ollama.errors import error_body

Endpoint = Literal["chat", "generate"]
Clock = Callable[[], int]
"""Nanoseconds: the wall clock (`time.time_ns`) or a monotonic one (`time.perf_counter_ns`)."""


@attrs.define
class Timings:
    """A request's moments on the gateway's monotonic clock, in nanoseconds."""

    arrived: int
    """The request came in."""
    dispatched: int
    """It was placed on a runner."""
    first: int | None = None
    """Its first chunk came back."""

    def metrics(self, end: int, usage: Usage) -> dict[str, int]:
        """The final object's counts and durations, in Ollama's order."""
        first = end if self.first is None else self.first
        return {
            "total_duration": end - self.arrived,
            "load_duration": self.dispatched - self.arrived,
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": first - self.dispatched,
            "eval_count": usage.completion_tokens,
            "eval_duration": end - first,
        }


def created_at(ns: int) -> str:
    """RFC 3339 in UTC with nanoseconds, trailing zeros trimmed, as Go writes a time."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    digits = f"{fraction:09d}".rstrip("0")
    return f"{stamp}.{digits}Z" if digits else f"{stamp}Z"


def done_reason(reason: FinishReason) -> str:
    """Ollama's reasons are "stop" and "length" (a call of tools ends with "stop" too)."""
    return "length" if reason == "length" else "stop"


class ToolCalls:
    """A choice's tool calls as Ollama's objects, each given out once whole
    (protocol.core.calls), with the text of those that are not valid calls."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls = CallAssembler()

    def feed(self, deltas: Iterable[ToolCallDelta]) -> tuple[list[dict[str, Any]], str]:
        """Take deltas; the calls they complete (every call before a new one) and the text
        of those that are not valid calls."""
        return _objects(self._calls.feed(deltas))

    def flush(self) -> tuple[list[dict[str, Any]], str]:
        """The calls still open, as Ollama's objects, and the text of those whose arguments
        are not a JSON object."""
        return _objects(self._calls.flush())


def _objects(calls: list[Call]) -> tuple[list[dict[str, Any]], str]:
    objects: list[dict[str, Any]] = []
    text: list[str] = []
    for call in calls:
        parsed = call_input(call.arguments)
        if parsed is None:
            text.append(call_text(call.name, call.arguments))
            continue
        function = {"index": call.index, "name": call.name, "arguments": parsed}
        objects.append({"id": call.id, "function": function} if call.id else {"function": function})
    return objects, "".join(text)


def _object(
    endpoint: Endpoint,
    model: str,
    stamp: str,
    content: str,
    *,
    thinking: str = "",
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An answer object's head: model, created_at and the content, not yet `done`."""
    if endpoint == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"model": model, "created_at": stamp, "message": message}
    body: dict[str, Any] = {"model": model, "created_at": stamp, "response": content}
    if thinking:
        body["thinking"] = thinking
    return body


def _done(body: dict[str, Any], endpoint: Endpoint, reason: str) -> dict[str, Any]:
    """Mark an object as the last, in Ollama's key order (chat: done_reason first)."""
    if endpoint == "chat":
        body["done_reason"] = reason
        body["done"] = True
    else:
        body["done"] = True
        body["done_reason"] = reason
    return body


def load_body(endpoint: Endpoint, model: str, now_ns: int) -> dict[str, Any]:
    """The answer to a request with nothing to generate: the model is loaded (it always is)."""
    return _done(_object(endpoint, model, created_at(now_ns), ""), endpoint, "load")


class OllamaWriter:
    """Renders one request's NDJSON lines (a `ChoiceWriter`; see the module docstring)."""

    __slots__ = ("_calls", "_model", "_mono", "_suffix", "_wall", "endpoint", "timings")

    include_usage = False
    """Ollama's counts are on the last object, never a chunk of their own."""

    def __init__(
        self,
        endpoint: Endpoint,
        model: str,
        timings: Timings,
        *,
        wall: Clock,
        mono: Clock,
        suffix: bytes = b"\n",
    ) -> None:
        self.endpoint = endpoint
        self._model = model
        self.timings = timings
        self._wall = wall
        self._mono = mono
        self._suffix = suffix
        self._calls = ToolCalls()

    def role(self, usage: Usage | None = None, index: int = 0) -> bytes:
        return b""  # Ollama has no opening object

    def chunk(self, chunk: Chunk) -> bytes:
        if self.timings.first is None:
            self.timings.first = self._mono()
        calls, text = self._calls.feed(chunk.tool_calls) if chunk.tool_calls else ([], "")
        content = chunk.text + text
        if not (content or chunk.reasoning or calls):
            return b""
        return self._line(content, chunk.reasoning, calls)

    def finish(self, reason: FinishReason, usage: Usage, index: int = 0) -> bytes:
        calls, text = self._calls.flush()
        out = self._line(text, "", calls) if calls or text else b""
        end = self._mono()
        body = _object(self.endpoint, self._model, created_at(self._wall()), "")
        _done(body, self.endpoint, done_reason(reason))
        body.update(self.timings.metrics(end, usage))
        return out + orjson.dumps(body) + self._suffix

    def usage_chunk(self, usage: Usage) -> bytes:
        return b""

    def _line(self, content: str, thinking: str, calls: list[dict[str, Any]]) -> bytes:
        body = _object(
            self.endpoint,
            self._model,
            created_at(self._wall()),
            content,
            thinking=thinking,
            tool_calls=calls,
        )
        body["done"] = False
        return orjson.dumps(body) + self._suffix


class NdjsonFraming:
    """One JSON object per line; an error is the line `{"error": ...}`; nothing after."""

    chunk_prefix = b""
    chunk_suffix = b"\n"

    def error(self, err: ApiError) -> bytes:
        return orjson.dumps(error_body(err)) + b"\n"

    def end(self, finish_reason: FinishReason | None, usage: Usage | None) -> bytes:
        return b""


NDJSON = NdjsonFraming()


class TimedBuilder(CompletionBuilder):
    """A `CompletionBuilder` that notes when the first chunk came (`timings.first`)."""

    __slots__ = ("_mono", "timings")

    def __init__(self, timings: Timings, mono: Clock) -> None:
        super().__init__()
        self.timings = timings
        self._mono = mono

    def feed(self, item: Item) -> bool:
        if self.timings.first is None and type(item) is Chunk:
            self.timings.first = self._mono()
        return super().feed(item)


def answer_body(
    builder: TimedBuilder, endpoint: Endpoint, model: str, *, wall: Clock, mono: Clock
) -> dict[str, Any]:
    """The non-streaming answer: the whole content and the last object's fields in one;
    raises the request's error if it failed."""
    choices, usage = builder.result()
    end = mono()
    choice: CollectedChoice = choices[0]
    calls = ToolCalls()
    tool_calls, text = calls.feed(choice.tool_calls)
    rest, rest_text = calls.flush()
    tool_calls += rest
    text += rest_text
    body = _object(
        endpoint,
        model,
        created_at(wall()),
        "".join(choice.content) + text,
        thinking="".join(choice.reasoning),
        tool_calls=tool_calls,
    )
    _done(body, endpoint, done_reason(choice.finish or "stop"))
    body.update(builder.timings.metrics(end, usage))
    return body
