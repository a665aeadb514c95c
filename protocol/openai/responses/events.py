"""The objects of OpenAI's Responses API: the `response` object, its output items, and the
events of a streamed response, decided in one place. No I/O.

`ResponseEvents` is both the `ChoiceWriter` and the `Framing` of one streamed response in
the shared `CompletionStream` (protocol.core.stream), which owns when things happen (the
first chunk, the finish, errors, cancel); this class owns what they look like:

    response.created, response.in_progress          when the stream starts (status in_progress)
    per output item, in the order the model writes them (think-span text first):
      reasoning     output_item.added, content_part.added (reasoning_text),
                    reasoning_text.delta ..., reasoning_text.done, content_part.done,
                    output_item.done
      message       output_item.added, content_part.added (output_text),
                    output_text.delta ..., output_text.done, content_part.done,
                    output_item.done
      function_call output_item.added, function_call_arguments.delta ...,
                    function_call_arguments.done, output_item.done
    response.completed                              (or response.incomplete: max_output_tokens)

An answer with neither text nor a function call still has its (empty) message, as the
non-streaming body does. Every event has `type` and `sequence_number` (from 0, no gaps); its
transport's `EventFraming` wraps it (protocol.openai.responses.framing: SSE's `event:` and
`data:` lines, or the WebSocket mode's message with its `stream_id`), and there is no
`[DONE]`. An error ends the stream with `response.failed` (its response with status failed
and the error), or with an `error` event when nothing was sent yet; a cancelled response (its
runner stopped it) is failed too, unless a steer stopped it (`steered`: response.incomplete,
reason `steered`).

`response_body` builds the non-streaming response from what a `CompletionBuilder` collected,
with the same items.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from protocol.core.calls import assemble
from protocol.core.errors import ApiError, server_error
from protocol.frames import Chunk, FinishReason, Message, ToolCall, ToolCallDelta, Usage
from protocol.openai.objects import call_entries
from protocol.openai.responses.framing import SSE_EVENTS, EventFraming
from protocol.openai.responses.request import ResponsesRequest

NewId = Callable[[str], str]
"""Makes an id with a prefix ("msg", "rs", "fc")."""

_ERROR_CODES = {429: "rate_limit_exceeded"}
"""OpenAI's ResponseErrorCode for a status; anything else is a server_error."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(usage: Usage) -> dict[str, Any]:
    """OpenAI's ResponseUsage for a `Usage` (cache_write_tokens is not counted: 0)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def response_base(
    request: ResponsesRequest, *, id: str, created_at: int, store: bool
) -> dict[str, Any]:
    """The response object of `request` in progress (queued, in the background): what it
    echoes of the request, no output and no usage yet (openapi.yaml's `usage` is an object,
    not nullable: it appears with the finished response). `store`: whether it is kept."""
    shown = {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": "queued" if request.background else "in_progress",
        "background": request.background,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "prompt_cache_key": request.prompt_cache_key,
        "prompt_cache_retention": request.prompt_cache_retention,
        "prompt_cache_options": request.prompt_cache_options,
        # OpenAI's, null where they do not apply: no conversations, prompt templates or
        # moderation here (the request refuses them).
        "conversation": None,
        "prompt": None,
        "moderation": None,
        "reasoning": {"effort": request.reasoning_effort, "summary": None},
        "safety_identifier": request.safety_identifier,
        "service_tier": "default",
        "store": store,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        # The open Responses specification's (OpenAI's object has neither): what sampled.
        "presence_penalty": request.sampling.presence_penalty,
        "frequency_penalty": request.sampling.frequency_penalty,
        "text": {"format": request.text_format, "verbosity": "medium"},
        "tool_choice": (
            {"type": "function", "name": request.tool_name}
            if request.tool_choice == "function"
            else request.tool_choice
        ),
        "tools": [
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description,
                "parameters": None if tool.parameters is None else orjson.loads(tool.parameters),
                "strict": tool.strict,
            }
            for tool in request.tools
        ],
        "top_logprobs": 0,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": "disabled",
        "metadata": dict(request.metadata),
    }
    if request.user is not None:  # a string, not nullable
        shown["user"] = request.user
    return shown


def finished(
    base: dict[str, Any],
    output: list[dict[str, Any]],
    reason: FinishReason,
    usage: Usage,
    completed_at: int,
) -> dict[str, Any]:
    """The response once its runner ended it with `reason`; "cancelled" only for a response
    stopped by a steer (incomplete, reason `steered`)."""
    incomplete = reason in ("length", "cancelled")
    why = "steered" if reason == "cancelled" else "max_output_tokens"
    return {
        **base,
        "status": "incomplete" if incomplete else "completed",
        "completed_at": None if incomplete else completed_at,
        "incomplete_details": {"reason": why} if incomplete else None,
        "output": output,
        "usage": usage_object(usage),
    }


def error_object(err: ApiError) -> dict[str, Any]:
    """A failed response's `error`."""
    return {"code": _ERROR_CODES.get(err.status, "server_error"), "message": err.message}


# --- output items ---------------------------------------------------------------------------


def reasoning_item(id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else [],
        "status": status,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; `text` None: its part is not added yet."""
    return {
        "id": id,
        "type": "message",
        "status": status,
        "content": [] if text is None else [output_text(text)],
        "role": "assistant",
    }


def function_call_item(
    id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": id,
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def output_items(
    reasoning: str,
    text: str,
    tool_calls: Sequence[ToolCallDelta],
    reason: FinishReason,
    new_id: NewId = new_id,
) -> list[dict[str, Any]]:
    """The output of a finished response, in the order the model writes it: its reasoning,
    its message (also when empty, unless it called a function), its function calls. At
    max_output_tokens the last item is the one cut short: incomplete, as streamed."""
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, "completed"))
    calls = call_entries(assemble(tool_calls))
    if text or not calls:
        items.append(message_item(new_id("msg"), text, "completed"))
    for call in calls:
        function = call["function"]
        items.append(
            function_call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    if reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def output_messages(output: Sequence[dict[str, Any]]) -> tuple[Message, ...]:
    """What a response said, as the assistant message that continues its conversation
    (previous_response_id), its reasoning included (the chat template decides whether it is
    rendered)."""
    reasoning = "".join(
        part["text"]
        for item in output
        if item["type"] == "reasoning"
        for part in item["content"]
        if part["type"] == "reasoning_text"
    )
    text = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = tuple(
        ToolCall(id=item["call_id"], name=item["name"], arguments=item["arguments"])
        for item in output
        if item["type"] == "function_call"
    )
    return (Message("assistant", text, tool_calls=calls, reasoning=reasoning or None),)


def response_body(
    base: dict[str, Any],
    *,
    reasoning: str,
    text: str,
    tool_calls: Sequence[ToolCallDelta],
    reason: FinishReason,
    usage: Usage,
    completed_at: int,
    new_id: NewId = new_id,
) -> dict[str, Any]:
    """The non-streaming response; a cancelled one is a server error (as its stream fails)."""
    if reason == "cancelled":
        raise server_error("The response was cancelled before it finished.")
    output = output_items(reasoning, text, tool_calls, reason, new_id)
    return finished(base, output, reason, usage, completed_at)


# --- streaming ------------------------------------------------------------------------------


class _Open:
    """The output item being written."""

    __slots__ = ("call_id", "id", "index", "kind", "name", "text")

    def __init__(self, kind: str, id: str, index: int, call_id: str = "", name: str = "") -> None:
        self.kind = kind
        self.id = id
        self.index = index
        self.call_id = call_id
        self.name = name
        self.text: list[str] = []


class ResponseEvents:
    """The events of one streamed response: `CompletionStream`'s writer and framing (see
    the module docstring). `response` is the final response object of one that ended
    completed or incomplete (to store it)."""

    __slots__ = (
        "_base",
        "_clock",
        "_new_id",
        "_open",
        "_output",
        "_queued",
        "_reason",
        "_seq",
        "ended",
        "framing",
        "response",
        "started",
        "steered",
    )

    include_usage = True
    """The final event carries the usage: always."""
    chunk_prefix = b""
    chunk_suffix = b""

    def __init__(
        self,
        base: dict[str, Any],
        *,
        clock: Callable[[], int],
        new_id: NewId = new_id,
        framing: EventFraming = SSE_EVENTS,
    ) -> None:
        self._base = base
        self.framing = framing
        """How each event is wrapped (protocol.openai.responses.framing): SSE, unless the
        transport sets its own before the stream starts (the WebSocket mode's)."""
        self.steered = False
        """Stopped for a `response.steer` (the WebSocket mode): its cancel ends it
        `response.incomplete`, reason `steered`, and it is kept, not failed."""
        self._clock = clock
        self._new_id = new_id
        self.response: dict[str, Any] | None = None
        """The final response object of one that ended completed or incomplete (the one its
        last event carries, with the ids it streamed: what is stored)."""
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        """Items done."""
        self._open: _Open | None = None
        self._reason: FinishReason = "stop"
        self.started = False
        self._queued = False
        """`queued` sent response.created already."""
        self.ended: dict[str, Any] | None = None
        """The final response object whatever the end: completed, incomplete, failed, or (a
        background response) cancelled."""

    def _event(self, type: str, **fields: Any) -> bytes:
        data = {"type": type, "sequence_number": self._seq, **fields}
        self._seq += 1
        return self.framing.event(type, orjson.dumps(data))

    def _snapshot(self, status: str) -> dict[str, Any]:
        return {**self._base, "status": status, "output": list(self._output)}

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands: final once ended; before, the items done so far
        (queued until its runner starts it, then in progress)."""
        if self.ended is not None:
            return self.ended
        return self._snapshot("in_progress" if self.started else self._base["status"])

    def queued(self) -> bytes:
        """A background response's first events, before any runner has it: response.created
        and response.queued, both with status queued. The stream's start then sends only
        response.in_progress."""
        self._queued = True
        response = self._snapshot("queued")
        return self._event("response.created", response=response) + self._event(
            "response.queued", response=response
        )

    def cancelled(self) -> None:
        """A background response cancelled before its stream started (nothing more is sent)."""
        self.ended = self._snapshot("cancelled")

    # --- ChoiceWriter ---------------------------------------------------------------------

    def role(self, usage: Usage | None, index: int) -> bytes:
        self.started = True
        response = self._snapshot("in_progress")
        created = b"" if self._queued else self._event("response.created", response=response)
        return created + self._event("response.in_progress", response=response)

    def chunk(self, chunk: Chunk) -> bytes:
        out: list[bytes] = []
        if chunk.reasoning:
            item = self._ensure(out, "reasoning")
            item.text.append(chunk.reasoning)
            out.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    delta=chunk.reasoning,
                )
            )
        if chunk.text:
            item = self._ensure(out, "message")
            item.text.append(chunk.text)
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    delta=chunk.text,
                    logprobs=[],
                )
            )
        for call in chunk.tool_calls:
            if call.id is not None:
                self._close(out, "completed")
                self._open = item = _Open(
                    "function_call",
                    self._new_id("fc"),
                    len(self._output),
                    call.id,
                    call.name or "",
                )
                out.append(
                    self._event(
                        "response.output_item.added",
                        output_index=item.index,
                        item=function_call_item(
                            item.id, item.call_id, item.name, "", "in_progress"
                        ),
                    )
                )
            current = self._open  # a call's first delta has its id: this is its item
            if call.arguments and current is not None and current.kind == "function_call":
                current.text.append(call.arguments)
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=current.id,
                        output_index=current.index,
                        delta=call.arguments,
                    )
                )
        return b"".join(out)

    def finish(self, reason: FinishReason, usage: Usage, index: int) -> bytes:
        self._reason = reason
        out: list[bytes] = []
        status = "incomplete" if reason in ("length", "cancelled") else "completed"
        if (
            self._open is None
            and reason != "cancelled"
            and not any(item["type"] in ("message", "function_call") for item in self._output)
        ):
            self._ensure(out, "message")  # an empty answer still has its message
        self._close(out, status)
        return b"".join(out)

    def usage_chunk(self, usage: Usage) -> bytes:
        reason = self._reason
        if reason == "cancelled" and not self.steered:
            if self._base["background"]:
                # Cancelled by request (POST .../cancel): its own status, and no event says
                # so (OpenAI's stream has none); the items cut short are incomplete.
                self.ended = self._snapshot("cancelled")
                return b""
            return self.error(server_error("The response was cancelled before it finished."))
        response = finished(self._base, list(self._output), reason, usage, self._clock())
        self.response = self.ended = response
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=response)

    # --- Framing --------------------------------------------------------------------------

    def error(self, err: ApiError) -> bytes:
        if not self.started and not self._queued:
            self._seq += 1
            return self.framing.error(err, self._seq - 1)
        self._open = None  # an item cut short is not part of a failed response's output
        response = {**self._snapshot("failed"), "error": error_object(err)}
        self.ended = response
        return self._event("response.failed", response=response)

    def end(self, finish_reason: FinishReason | None, usage: Usage | None) -> bytes:
        return b""  # the last event says it all: no [DONE]

    # --- items ----------------------------------------------------------------------------

    def _ensure(self, out: list[bytes], kind: str) -> _Open:
        """The open item if it is a `kind`, else a new one (the open one closed)."""
        item = self._open
        if item is not None and item.kind == kind:
            return item
        self._close(out, "completed")
        prefix = "rs" if kind == "reasoning" else "msg"
        self._open = item = _Open(kind, self._new_id(prefix), len(self._output))
        if kind == "reasoning":
            added = reasoning_item(item.id, "", "in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            added = message_item(item.id, None, "in_progress")
            part = output_text("")
        out.append(self._event("response.output_item.added", output_index=item.index, item=added))
        out.append(
            self._event(
                "response.content_part.added",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                part=part,
            )
        )
        return item

    def _close(self, out: list[bytes], status: str) -> None:
        """The done events of the open item, if any."""
        item = self._open
        if item is None:
            return
        self._open = None
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=text,
                )
            )
            done = function_call_item(item.id, item.call_id, item.name, text, status)
        elif item.kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            out.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
            out.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
            done = reasoning_item(item.id, text, status)
        else:
            out.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            out.append(
                self._event(
                    "response.content_part.done", **where, content_index=0, part=output_text(text)
                )
            )
            done = message_item(item.id, text, status)
        self._output.append(done)
        out.append(self._event("response.output_item.done", output_index=item.index, item=done))
