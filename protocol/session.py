"""Per-connection state machines for both ends of a runner link. No I/O.

Every rule about which frame may come when lives here (h11's "one place" rule):

    GatewaySession (the gateway's view of one runner)
        AWAIT_HELLO --Hello--> OPEN --Drain--> DRAINING --close()--> CLOSED
        OPEN: chunks and errors only for requests this connection was given, chunk seq
              0, 1, 2, ... with no gaps, nothing after a request's final chunk.
        DRAINING: as OPEN, but no new request may be given to the runner.

    RunnerSession (the runner's view of its gateway)
        AWAIT_WELCOME --Welcome--> OPEN --drain()--> DRAINING --close()--> CLOSED
        OPEN: Generate with a fresh request id; Cancel of a finished request is ignored
              (the two can cross on the wire); outgoing chunks are numbered here.
        DRAINING: a Generate (sent before the gateway saw Drain) is refused with an Error.

A frame that breaks a rule raises `StateError` (or `ProtocolError` for a version mismatch);
the caller closes the connection with the error's close code.
"""

from __future__ import annotations

import enum

import attrs

from protocol.closecodes import CloseCode
from protocol.errors import ProtocolError, StateError
from protocol.frames import (
    PROTOCOL_VERSION,
    Batch,
    Cancel,
    Chunk,
    Drain,
    Error,
    ErrorCode,
    FinishReason,
    GatewayFrame,
    Generate,
    GenerationStats,
    Heartbeat,
    Hello,
    RunnerFrame,
    Usage,
    Welcome,
)


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    AWAIT_WELCOME = "await_welcome"
    OPEN = "open"
    DRAINING = "draining"
    CLOSED = "closed"


@attrs.define
class _InFlight:
    next_seq: int = 0
    cancelled: bool = False


class GatewaySession:
    """The gateway's side of one runner connection."""

    def __init__(self) -> None:
        self.state = State.AWAIT_HELLO
        self.hello: Hello | None = None
        self._requests: dict[str, _InFlight] = {}

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._requests

    def receive(self, frame: RunnerFrame) -> RunnerFrame:
        """Check a frame from the runner against the state; returns it when legal."""
        if self.state is State.CLOSED:
            raise StateError("connection is closed")
        if self.state is State.AWAIT_HELLO:
            if not isinstance(frame, Hello):
                raise StateError(f"expected hello first, got {type(frame).__name__.lower()}")
            self._accept_hello(frame)
            return frame
        match frame:
            case Hello():
                raise StateError("hello sent twice")
            case Drain():
                self.state = State.DRAINING
            case Chunk():
                self._receive_chunk(frame)
            case Batch(frames=chunks):
                for chunk in chunks:
                    self._receive_chunk(chunk)
            case Error(request_id=rid) if rid is not None:
                self._request(rid, "error")
                del self._requests[rid]
            case _:
                pass
        return frame

    def _receive_chunk(self, chunk: Chunk) -> None:
        rid, seq = chunk.request_id, chunk.seq
        req = self._request(rid, "chunk")
        if seq != req.next_seq:
            raise StateError(f"chunk seq {seq} for {rid!r}, expected {req.next_seq}")
        req.next_seq += 1
        if chunk.finish_reason is not None:
            del self._requests[rid]

    def _accept_hello(self, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {hello.protocol_version} not supported "
                f"(gateway speaks {PROTOCOL_VERSION})",
                close_code=CloseCode.UNSUPPORTED_VERSION,
            )
        if not hello.models:
            raise ProtocolError("hello lists no models")
        if hello.max_concurrent < 1:
            raise ProtocolError("max_concurrent must be at least 1")
        if len({m.id for m in hello.models}) != len(hello.models):
            raise ProtocolError("hello lists a model twice")
        self.hello = hello
        self.state = State.OPEN

    def _request(self, request_id: str, what: str) -> _InFlight:
        req = self._requests.get(request_id)
        if req is None:
            raise StateError(f"{what} for request {request_id!r} not in flight on this runner")
        return req

    def send_generate(self, frame: Generate) -> Generate:
        """Record a request handed to this runner; refuses duplicates and over-capacity."""
        if self.state is not State.OPEN or self.hello is None:
            raise StateError(f"runner is not taking requests ({self.state.value})")
        if frame.request_id in self._requests:
            raise StateError(f"request {frame.request_id!r} already in flight")
        if len(self._requests) >= self.hello.max_concurrent:
            raise StateError("runner is at capacity")
        if frame.model not in {m.id for m in self.hello.models}:
            raise StateError(f"runner does not serve {frame.model!r}")
        self._requests[frame.request_id] = _InFlight()
        return frame

    def send_cancel(self, request_id: str) -> Cancel | None:
        """A Cancel to send, or None if the request is already over or being cancelled."""
        req = self._requests.get(request_id)
        if req is None or req.cancelled or self.state not in (State.OPEN, State.DRAINING):
            return None
        req.cancelled = True
        return Cancel(request_id)

    def close(self) -> list[str]:
        """Close the session; returns the ids of the requests that were still in flight."""
        self.state = State.CLOSED
        lost = list(self._requests)
        self._requests.clear()
        return lost


class RunnerSession:
    """The runner's side of its connection to a gateway."""

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.state = State.AWAIT_WELCOME
        self.welcome: Welcome | None = None
        self._requests: dict[str, _InFlight] = {}
        self._models = frozenset(m.id for m in hello.models)

    @property
    def in_flight(self) -> list[str]:
        return list(self._requests)

    @property
    def in_flight_count(self) -> int:
        return len(self._requests)

    def receive(self, frame: GatewayFrame) -> Error | None:
        """Check a frame from the gateway.

        Returns an Error frame to send back when a Generate must be refused (model not
        served, at capacity); raises `StateError` on a protocol violation.
        """
        if self.state is State.CLOSED:
            raise StateError("connection is closed")
        if self.state is State.AWAIT_WELCOME:
            if not isinstance(frame, Welcome):
                raise StateError(f"expected welcome first, got {type(frame).__name__.lower()}")
            if frame.protocol_version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"gateway speaks protocol {frame.protocol_version}, runner {PROTOCOL_VERSION}",
                    close_code=CloseCode.UNSUPPORTED_VERSION,
                )
            self.welcome = frame
            self.state = State.OPEN
            return None
        match frame:
            case Welcome():
                raise StateError("welcome sent twice")
            case Generate(request_id=rid, model=model):
                if rid in self._requests:
                    raise StateError(f"request {rid!r} already in flight")
                if self.state is State.DRAINING:
                    return Error(rid, "over_capacity", "runner is draining")
                if model not in self._models:
                    return Error(rid, "model_not_found", f"this runner does not serve {model!r}")
                if len(self._requests) >= self.hello.max_concurrent:
                    return Error(rid, "over_capacity", "runner is at its max concurrent requests")
                self._requests[rid] = _InFlight()
            case Cancel(request_id=rid):
                req = self._requests.get(rid)
                if req is not None:
                    req.cancelled = True
            case Heartbeat():
                pass
        return None

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._requests

    def drain(self) -> Drain:
        """Stop taking requests; returns the frame that tells the gateway."""
        if self.state is not State.OPEN:
            raise StateError(f"cannot drain in state {self.state.value}")
        self.state = State.DRAINING
        return Drain()

    def is_cancelled(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        return req is None or req.cancelled

    def chunk(
        self,
        request_id: str,
        *,
        text: str,
        reasoning: str,
        tokens: int,
        usage: Usage,
        finish_reason: FinishReason | None = None,
        stats: GenerationStats | None = None,
    ) -> Chunk:
        """Build the next chunk of a request, numbered; the final one ends the request."""
        req = self._requests.get(request_id)
        if req is None:
            raise StateError(f"request {request_id!r} is not in flight")
        chunk = Chunk(
            request_id, req.next_seq, text, reasoning, tokens, usage, finish_reason, stats
        )
        req.next_seq += 1
        if finish_reason is not None:
            del self._requests[request_id]
        return chunk

    def error(self, request_id: str, code: ErrorCode, message: str) -> Error:
        """Build an Error that ends a request."""
        if self._requests.pop(request_id, None) is None:
            raise StateError(f"request {request_id!r} is not in flight")
        return Error(request_id, code, message)

    def close(self) -> list[str]:
        """Close; returns the ids of the requests still in flight (to cancel in the engine)."""
        self.state = State.CLOSED
        lost = list(self._requests)
        self._requests.clear()
        return lost
