"""Per-connection state machines for both ends of a runner link. No I/O.

Every rule about which frame may come when lives here (h11's "one place" rule):

    GatewaySession (the gateway's view of one runner)
        AWAIT_HELLO --Hello--> OPEN --Drain--> DRAINING --close()--> CLOSED
        OPEN: chunks and errors only for requests this connection was given, chunk seq
              0, 1, 2, ... with no gaps, nothing after a request's final chunk.
        DRAINING: as OPEN, but no new request may be given to the runner.
        Each request: assign() --chunk...--> final chunk | Error | close()
              ended before its first chunk by an over_capacity Error or by close():
              Unstarted (it may run on another runner); after its first chunk: RequestFailed / Lost.
        Error with no request id: the runner gives up the connection (RunnerFailed).
        ModelStatus: a model of its hello changed state (ModelChanged); `model_infos` holds
              the latest word on each of its models.
        CacheHeld: prefixes its caches hold of one of its models (CacheReported), for routing.

    RunnerSession (the runner's view of its gateway)
        AWAIT_WELCOME --Welcome--> OPEN --drain()--> DRAINING --close()--> CLOSED
        OPEN: Generate with a fresh request id; Cancel of a finished request is ignored
              (the two can cross on the wire); outgoing chunks are numbered here.
        DRAINING: a Generate (sent before the gateway saw Drain) is refused with an Error.

A frame that breaks a rule raises `StateError` (or `ProtocolError` for a version mismatch);
the caller closes the connection with the error's close code. The gateway's session turns the
frames it accepts into events about its requests (`Delivered`, `RequestFailed`, `Unstarted`, `Lost`)
and the connection (`Draining`, `RunnerFailed`).
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

import attrs

from protocol.closecodes import CloseCode
from protocol.errors import ProtocolError, StateError
from protocol.frames import (
    PROTOCOL_VERSION,
    Batch,
    CacheHeld,
    Cancel,
    Chunk,
    Drain,
    Echo,
    Error,
    ErrorCode,
    FinishReason,
    GatewayFrame,
    Generate,
    GenerationStats,
    Heartbeat,
    Hello,
    ModelInfo,
    ModelStatus,
    RunnerFrame,
    Speculation,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    Welcome,
)


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    AWAIT_WELCOME = "await_welcome"
    OPEN = "open"
    DRAINING = "draining"
    CLOSED = "closed"


H = TypeVar("H")
"""What the gateway keeps for each request it gives a runner (its stream); opaque here."""


@attrs.frozen
class Delivered(Generic[H]):
    """A chunk of the request behind `handle`; the last one has a finish_reason."""

    handle: H
    chunk: Chunk


@attrs.frozen
class RequestFailed(Generic[H]):
    """The runner ended the request with an error."""

    handle: H
    error: Error


@attrs.frozen
class Unstarted(Generic[H]):
    """The request ends on this runner before its first token: refused (the runner began
    draining as it crossed the wire) or its connection closed. It may run elsewhere."""

    handle: H
    reason: str


@attrs.frozen
class Lost(Generic[H]):
    """The connection closed after the request's first token: it cannot move."""

    handle: H


@attrs.frozen
class Draining:
    """The runner takes nothing new; its requests finish."""

    reason: str


@attrs.frozen
class RunnerFailed:
    """The runner reported an error about the whole connection: the gateway closes it."""

    message: str


@attrs.frozen
class ModelChanged:
    """One of the runner's models was loaded, started loading or became loadable again."""

    model: ModelInfo
    previous: ModelInfo
    """What the gateway knew of it before."""


@attrs.frozen
class CacheReported:
    """The runner's caches started or stopped holding prefixes of one of its models (the
    frame as it came: `protocol.frames.CacheHeld`)."""

    held: CacheHeld


GatewayEvent = (
    Delivered[H]
    | RequestFailed[H]
    | Unstarted[H]
    | Lost[H]
    | Draining
    | RunnerFailed
    | ModelChanged
    | CacheReported
)


@attrs.define(slots=True)
class _Assigned(Generic[H]):
    """A request given to the runner, as the gateway tracks it."""

    handle: H
    next_seq: int = 0
    cancel_sent: bool = False


@attrs.define
class _InFlight:
    next_seq: int = 0
    cancelled: bool = False


class GatewaySession(Generic[H]):
    """The gateway's side of one runner connection: every request it carries, its free
    slots, its drain state and its counters. The pool routes by `accepting` and `free` and
    keeps no copy of any of it."""

    def __init__(self) -> None:
        self.state = State.AWAIT_HELLO
        self.hello: Hello | None = None
        self._requests: dict[str, _Assigned[H]] = {}
        self._capacity = 0
        self._models: frozenset[str] = frozenset()
        self.model_infos: dict[str, ModelInfo] = {}
        """Each model the runner serves, as its latest hello or ModelStatus describes it."""
        self.tokens_generated = 0
        """Completion tokens the runner reported on this connection."""
        self.tokens_after_cancel = 0
        """Of those, tokens that arrived after the gateway had sent a Cancel."""
        self.requests_served = 0
        """Requests that ended with a final chunk (any finish reason)."""
        self.kv_bytes: int | None = None
        """KV-cache memory from the runner's last heartbeat (None: not reported)."""
        self.kv_limit_bytes: int | None = None
        self.kv_prefix_bytes: int | None = None
        """Of `kv_bytes`, kept prompts' (the prefix cache's memory tier)."""
        self.kv_disk_bytes: int | None = None
        self.kv_disk_limit_bytes: int | None = None
        self.speculation: tuple[Speculation, ...] = ()
        """Each model's draft: tokens drafted and accepted, from the last heartbeat."""

    # --- what the pool reads ---------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def free(self) -> int:
        """Slots for new requests: 0 unless the runner is taking requests."""
        if self.state is not State.OPEN:
            return 0
        return self._capacity - len(self._requests)

    @property
    def accepting(self) -> bool:
        return self.state is State.OPEN

    @property
    def models(self) -> frozenset[str]:
        return self._models

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._requests

    def handles(self) -> list[H]:
        return [req.handle for req in self._requests.values()]

    # --- frames from the runner ----------------------------------------------------------

    def receive(self, frame: RunnerFrame) -> list[GatewayEvent[H]]:
        """Apply a frame from the runner; returns what it means for the gateway's requests.

        Raises `StateError` (or `ProtocolError`) for a frame the protocol forbids now.
        """
        if type(frame) is Chunk and self.state is not State.AWAIT_HELLO:
            return [self._chunk(frame)]
        if self.state is State.CLOSED:
            raise StateError("connection is closed")
        if self.state is State.AWAIT_HELLO:
            if not isinstance(frame, Hello):
                raise StateError(f"expected hello first, got {type(frame).__name__.lower()}")
            self._accept_hello(frame)
            return []
        match frame:
            case Batch(frames=chunks):
                return [self._chunk(chunk) for chunk in chunks]
            case Heartbeat():
                self.kv_bytes, self.kv_limit_bytes = frame.kv_bytes, frame.kv_limit_bytes
                self.kv_prefix_bytes = frame.kv_prefix_bytes
                self.kv_disk_bytes = frame.kv_disk_bytes
                self.kv_disk_limit_bytes = frame.kv_disk_limit_bytes
                self.speculation = frame.speculation
                return []
            case Error(request_id=None, message=message):
                return [RunnerFailed(message)]
            case Error(request_id=str(rid)):
                req = self._request(rid, "error")
                del self._requests[rid]
                if frame.code == "over_capacity" and req.next_seq == 0:
                    return [Unstarted(req.handle, frame.message)]
                return [RequestFailed(req.handle, frame)]
            case Drain(reason=reason):
                self.state = State.DRAINING
                return [Draining(reason)]
            case ModelStatus(model=info):
                previous = self.model_infos.get(info.id)
                if previous is None:
                    raise StateError(f"model_status for {info.id!r}, which the hello did not list")
                self.model_infos[info.id] = info
                return [ModelChanged(info, previous)]
            case CacheHeld(model=model):
                if model not in self._models:
                    raise StateError(f"cache_held for {model!r}, which the hello did not list")
                return [CacheReported(frame)]
            case Hello():
                raise StateError("hello sent twice")
        raise StateError(f"unexpected {type(frame).__name__.lower()} frame")

    def _chunk(self, chunk: Chunk) -> Delivered[H]:
        rid = chunk.request_id
        req = self._requests.get(rid)
        if req is None:
            if self.state is State.CLOSED:
                raise StateError("connection is closed")
            raise StateError(f"chunk for request {rid!r} not in flight on this runner")
        if chunk.seq != req.next_seq:
            raise StateError(f"chunk seq {chunk.seq} for {rid!r}, expected {req.next_seq}")
        req.next_seq += 1
        self.tokens_generated += chunk.tokens
        if req.cancel_sent:
            self.tokens_after_cancel += chunk.tokens
        if chunk.finish_reason is not None:
            del self._requests[rid]
            self.requests_served += 1
        return Delivered(req.handle, chunk)

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
        models = frozenset(m.id for m in hello.models)
        if len(models) != len(hello.models):
            raise ProtocolError("hello lists a model twice")
        self.hello = hello
        self._capacity = hello.max_concurrent
        self._models = models
        self.model_infos = {m.id: m for m in hello.models}
        self.state = State.OPEN

    def _request(self, request_id: str, what: str) -> _Assigned[H]:
        req = self._requests.get(request_id)
        if req is None:
            raise StateError(f"{what} for request {request_id!r} not in flight on this runner")
        return req

    # --- frames to the runner ------------------------------------------------------------

    def assign(self, frame: Generate, handle: H) -> Generate:
        """Record a request given to this runner; refuses duplicates, a runner that is not
        taking requests, over-capacity and models it does not serve."""
        if self.state is not State.OPEN:
            raise StateError(f"runner is not taking requests ({self.state.value})")
        if frame.request_id in self._requests:
            raise StateError(f"request {frame.request_id!r} already in flight")
        if len(self._requests) >= self._capacity:
            raise StateError("runner is at capacity")
        if frame.model not in self._models:
            raise StateError(f"runner does not serve {frame.model!r}")
        self._requests[frame.request_id] = _Assigned(handle)
        return frame

    def cancel(self, request_id: str) -> Cancel | None:
        """A Cancel to send, or None if the request is already over or being cancelled."""
        req = self._requests.get(request_id)
        if req is None or req.cancel_sent or self.state not in (State.OPEN, State.DRAINING):
            return None
        req.cancel_sent = True
        return Cancel(request_id)

    def close(self) -> list[Unstarted[H] | Lost[H]]:
        """Close the session; what becomes of each request still in flight."""
        self.state = State.CLOSED
        requests, self._requests = self._requests, {}
        return [
            Unstarted(req.handle, "runner lost") if req.next_seq == 0 else Lost(req.handle)
            for req in requests.values()
        ]


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
        tool_calls: tuple[ToolCallDelta, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        index: int = 0,
        choice_finish: FinishReason | None = None,
        echo: Echo | None = None,
        matched_stop: str | None = None,
    ) -> Chunk:
        """Build the next chunk of a request, numbered; the final one ends the request."""
        req = self._requests.get(request_id)
        if req is None:
            raise StateError(f"request {request_id!r} is not in flight")
        chunk = Chunk(
            request_id,
            req.next_seq,
            text,
            reasoning,
            tokens,
            usage,
            finish_reason,
            stats,
            tool_calls,
            logprobs,
            index,
            choice_finish,
            echo,
            matched_stop,
        )
        req.next_seq += 1
        if finish_reason is not None:
            del self._requests[request_id]
        return chunk

    def error(
        self, request_id: str, code: ErrorCode, message: str, param: str | None = None
    ) -> Error:
        """Build an Error that ends a request."""
        if self._requests.pop(request_id, None) is None:
            raise StateError(f"request {request_id!r} is not in flight")
        return Error(request_id, code, message, param)

    def close(self) -> list[str]:
        """Close; returns the ids of the requests still in flight (to cancel in the engine)."""
        self.state = State.CLOSED
        lost = list(self._requests)
        self._requests.clear()
        return lost
