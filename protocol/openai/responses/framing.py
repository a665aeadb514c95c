"""How the Responses API's streamed events are wrapped for each transport. No I/O.

`ResponseEvents` (protocol.openai.responses.events) renders every event once, as a JSON
object with `type` and `sequence_number`; an `EventFraming` wraps it:

- `SSE_EVENTS`, for `POST /v1/responses` with `stream: true`: `event: <type>` and
  `data: <json>` lines, a blank line after each event. The error event of a stream that had
  not started is flat: `{type: "error", sequence_number, code, message, param}`.
- `SocketEvents`, for the WebSocket mode (`/v1/responses`, protocol.openai.responses.socket):
  each event is one WebSocket message, the same JSON object plus the `stream_id` of the
  `response.create` that asked for it (none when it had none). The error event is nested, as
  OpenAI's `ResponseWsError`: `{type: "error", status, sequence_number, stream_id,
  error: {type, code, message, param}}`. A writer call may render several events at once:
  each ends with a newline (orjson never writes a raw one, it escapes them in strings), and
  the socket sends each line as a message (`split_events`).
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from protocol.core.errors import ApiError


class EventFraming(Protocol):
    """How one transport wraps a Responses stream's events."""

    def event(self, type: str, data: bytes) -> bytes:
        """The event `type` whose JSON object is `data`."""

    def error(self, err: ApiError, sequence_number: int) -> bytes:
        """The `error` event of a stream that fails before it started."""


class SseEvents:
    """Server-sent events (see the module docstring)."""

    def event(self, type: str, data: bytes) -> bytes:
        return b"event: " + type.encode() + b"\ndata: " + data + b"\n\n"

    def error(self, err: ApiError, sequence_number: int) -> bytes:
        data = {
            "type": "error",
            "sequence_number": sequence_number,
            "code": err.code,
            "message": err.message,
            "param": err.param,
        }
        return self.event("error", orjson.dumps(data))


SSE_EVENTS = SseEvents()


def error_event(
    err: ApiError, *, stream_id: str | None = None, sequence_number: int | None = None
) -> bytes:
    """The WebSocket mode's error event (no newline): its HTTP `status`, the sequence number
    when a response stream sent it, the `stream_id` when its create had one."""
    data: dict[str, Any] = {"type": "error", "status": err.status}
    if sequence_number is not None:
        data["sequence_number"] = sequence_number
    if stream_id is not None:
        data["stream_id"] = stream_id
    data["error"] = {"type": err.type, "code": err.code, "message": err.message, "param": err.param}
    return orjson.dumps(data)


class SocketEvents:
    """The WebSocket mode's framing for one response, on lane `stream_id` (see the module
    docstring)."""

    __slots__ = ("_tail", "stream_id")

    def __init__(self, stream_id: str | None) -> None:
        self.stream_id = stream_id
        # Spliced over the object's closing brace: no copy of the event's dict per token.
        self._tail = (
            b"}\n" if stream_id is None else b',"stream_id":' + orjson.dumps(stream_id) + b"}\n"
        )

    def event(self, type: str, data: bytes) -> bytes:
        return data[:-1] + self._tail

    def error(self, err: ApiError, sequence_number: int) -> bytes:
        return error_event(err, stream_id=self.stream_id, sequence_number=sequence_number) + b"\n"


def split_events(data: bytes) -> list[bytes]:
    """What `SocketEvents` rendered, one WebSocket message per event."""
    return data.split(b"\n")[:-1]
