"""The gateway's side of one Responses API WebSocket (OpenAI's WebSocket mode on
`/v1/responses`, the SDK's `client.responses.connect()`), as a state machine. No I/O.

Every rule about what a client may send when lives here. The gateway feeds each message to
`receive` and acts on the events it returns; it tells the session what became of each
create (`bound`, `refused`, `ended`) and about its auth timer (`auth_timed_out`).

    ResponsesSocket
        (gate) no key to check, or a valid `Authorization: Bearer` on the upgrade: OPEN;
        else the first message must be `auth` (protocol.client_socket.AuthGate), 4004 if not
        OPEN --response.create-----> its lane's FIFO; Run when it is the lane's first
        OPEN --response.steer------> steer.accepted (+ Interrupt) or steer.failed
        OPEN --close()-------------> CLOSED (everything after is ignored)

    One create, on lane `stream_id` (None: the default lane)
        queued --its turn--> Run --bound(response id)--> running --ended(kept)--> gone,
        the lane's next gets its Run
        a create refused before it ran (its envelope, or `plan` at its turn) gets its `error`
        event at its turn, so a lane's events stay in the order of its creates

    A steer of a running response (by `previous_response_id`)
        accepted --Interrupt--> the response ends incomplete, reason `steered` (or, if it
        finished first, as it finished) --ended(kept)--> its successor runs first on the lane:
        the same create with the steer input(s) as `input` and `previous_response_id` its id;
        not kept --> steer.failed successor_creation_failed

What a message can be refused for, and how (the texts are the wire format,
docs/responses-websocket.md): a message that is too large, not JSON, not an object with a
string `type`, of an unknown type: an `error` event with `status` and no `stream_id`; a
create with a bad `stream_id`: the same; a create beyond `max_requests` in flight on the
socket (running or waiting in a lane): `websocket_stream_limit_reached` with its
`stream_id`, at once; `background: true` or `stream: false`: an `error` event on its lane, at
its turn. Nothing closes the socket but a failed authentication.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs
import orjson

from protocol.client_socket import (
    AuthGate,
    CloseSocket,
    Reply,
    State,
    load,
    unknown_fields,
    unknown_message_type,
)
from protocol.core.errors import ApiError, invalid_request
from protocol.openai.responses.events import new_id
from protocol.openai.responses.framing import error_event
from protocol.openai.responses.input import parse_input

H = TypeVar("H")
"""What the gateway runs one response with: the session only holds it, to interrupt it."""

STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")
MAX_STEERS = 8
"""Steers that may wait for one response's successor."""
FINISHED_KEPT = 256
"""Responses that ended on this socket remembered, to say a steer came too late."""
_STEER_FIELDS = frozenset(("type", "previous_response_id", "input"))
_MESSAGE_FIELDS = frozenset(("type", "role", "content"))


@attrs.define(eq=False)
class Ticket:
    """One `response.create` on its way: its lane and its body (the `POST /v1/responses`
    body, `stream` set; validated by the dialect's `plan` when it runs)."""

    stream_id: str | None
    body: dict[str, Any]
    refusal: ApiError | None = None
    """Refused already (its envelope): its error is sent at its turn."""


@attrs.frozen
class Run:
    """Plan and run this create now; then `bound` (or `refused`), and `ended` once over."""

    ticket: Ticket


@attrs.frozen
class Interrupt(Generic[H]):
    """Stop this running response at its next token: a steer is waiting for it."""

    handle: H


Event = Reply | CloseSocket | Run | Interrupt[H]


@attrs.define
class _Running(Generic[H]):
    ticket: Ticket
    handle: H
    stored: bool
    steers: list[tuple[str, Any]] = attrs.Factory(list)
    """(id, input) of each accepted steer, in order."""


# --- errors (each made once; the texts are the wire format) ---------------------------------


def invalid_stream_id() -> ApiError:
    return invalid_request(
        "'stream_id' must be a string of 1 to 256 letters, digits, '_', '.' or '-'.",
        "stream_id",
        "invalid_value",
    )


def stream_limit_reached(limit: int) -> ApiError:
    """OpenAI's error for a create past the socket's limit (its documented status is 400)."""
    return invalid_request(
        f"This WebSocket connection has reached its stream limit ({limit} responses running "
        "or waiting in their lanes).",
        "stream_id",
        "websocket_stream_limit_reached",
    )


def background_refused() -> ApiError:
    return invalid_request(
        "Background responses are not supported in WebSocket mode: use POST /v1/responses "
        "with 'background': true.",
        "background",
        "unsupported_parameter",
    )


def stream_required() -> ApiError:
    return invalid_request(
        "WebSocket mode always streams: leave 'stream' out (or send true).",
        "stream",
        "unsupported_value",
    )


# --- the session -----------------------------------------------------------------------------


class ResponsesSocket(Generic[H]):
    """The gateway's side of one Responses WebSocket (see the module docstring)."""

    def __init__(
        self,
        *,
        verify_key: Callable[[str], bool] | None,
        max_requests: int,
        max_message_bytes: int,
        new_id: Callable[[str], str] = new_id,
    ) -> None:
        """`verify_key` checks an `auth` message's key; None: no `auth` is needed."""
        self._gate = AuthGate(verify_key)
        self.max_requests = max_requests
        self.max_message_bytes = max_message_bytes
        self._new_id = new_id
        self.state = State.OPEN if verify_key is None else State.AWAIT_AUTH
        self._lanes: dict[str | None, collections.deque[Ticket]] = {}
        self.in_flight = 0
        """Creates running or waiting in their lanes."""
        self._running: dict[str, _Running[H]] = {}
        """By response id."""
        self._by_ticket: dict[int, str] = {}
        self._finished: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        """Recently ended responses' ids → their lane."""
        self._seq = 0
        """The sequence numbers of the steer events (the socket's own)."""

    # --- input ------------------------------------------------------------------------------

    def receive(self, data: bytes | str) -> list[Event[H]]:
        """The events for one WebSocket message. Never raises for what a client sent."""
        if self.state is State.CLOSED:
            return []
        try:
            obj = load(data, self.max_message_bytes)
            if self.state is State.AWAIT_AUTH:
                return self._authenticate(obj)
            match obj["type"]:
                case "response.create":
                    return self._create(obj)
                case "response.steer":
                    return self._steer(obj)
                case other:
                    raise unknown_message_type(other)
        except ApiError as err:
            return [Reply(error_event(err))]

    def _authenticate(self, obj: dict[str, Any]) -> list[Event[H]]:
        admitted = self._gate.admit(obj)  # unknown fields: ApiError, answered
        if isinstance(admitted, CloseSocket):
            self.state = State.CLOSED
            return [admitted]
        self.state = State.OPEN
        return [Reply(admitted)]

    def _create(self, obj: dict[str, Any]) -> list[Event[H]]:
        stream_id = obj.get("stream_id")
        if "stream_id" in obj and not (type(stream_id) is str and STREAM_ID.fullmatch(stream_id)):
            raise invalid_stream_id()
        if self.in_flight >= self.max_requests:
            return [
                Reply(error_event(stream_limit_reached(self.max_requests), stream_id=stream_id))
            ]
        body = {key: value for key, value in obj.items() if key not in ("type", "stream_id")}
        ticket = Ticket(stream_id, body)
        if body.get("stream") is None:
            body["stream"] = True  # implied (null too: the HTTP API reads it as left out)
        if body.get("background") is True:
            ticket.refusal = background_refused()
        elif body["stream"] is False:
            ticket.refusal = stream_required()
        lane = self._lanes.setdefault(stream_id, collections.deque())
        lane.append(ticket)
        self.in_flight += 1
        return self._advance(stream_id) if len(lane) == 1 else []

    def _advance(self, stream_id: str | None) -> list[Event[H]]:
        """The lane's first create has its turn: Run it, or send its refusal and go on."""
        out: list[Event[H]] = []
        lane = self._lanes.get(stream_id)
        while lane:
            ticket = lane[0]
            if ticket.refusal is None:
                out.append(Run(ticket))
                return out
            out.append(Reply(error_event(ticket.refusal, stream_id=stream_id)))
            self._pop(ticket)
        return out

    def _pop(self, ticket: Ticket) -> None:
        lane = self._lanes[ticket.stream_id]
        assert lane[0] is ticket, "a lane's first create ends first"
        lane.popleft()
        self.in_flight -= 1
        if not lane:
            del self._lanes[ticket.stream_id]

    # --- steering ------------------------------------------------------------------------------

    def _steer(self, obj: dict[str, Any]) -> list[Event[H]]:
        target = obj.get("previous_response_id")
        if type(target) is not str:
            raise invalid_request(
                "'previous_response_id' must be the id of a response on this socket.",
                "previous_response_id",
                "missing_required_parameter" if target is None else "invalid_type",
            )
        if "input" not in obj:
            raise invalid_request("Missing required parameter: 'input'.", "input")
        given = obj["input"]
        try:
            unknown = obj.keys() - _STEER_FIELDS
            if unknown:
                raise unknown_fields(unknown)
            steer_input(given)
        except ApiError as err:
            return self._steer_failed("invalid_input", err.message, target, given)
        running = self._running.get(target)
        if running is None:
            if target in self._finished:
                return self._steer_failed(
                    "response_already_completed",
                    "The response has completed and takes no more steering input.",
                    target,
                    given,
                    stream_id=self._finished[target],
                )
            return self._steer_failed(
                "response_not_found",
                "No response with this id is running on this WebSocket connection.",
                target,
                given,
            )
        stream_id = running.ticket.stream_id
        if not running.stored:
            return self._steer_failed(
                "steering_not_supported",
                "Steering needs the response stored ('store': true): its successor continues "
                "from it by previous_response_id.",
                target,
                given,
                stream_id=stream_id,
            )
        if len(running.steers) >= MAX_STEERS:
            return self._steer_failed(
                "too_many_pending_steers",
                f"At most {MAX_STEERS} steers may wait for one response.",
                target,
                given,
                stream_id=stream_id,
            )
        steer_id = self._new_id("steer")
        running.steers.append((steer_id, given))
        accepted = {"id": steer_id, "previous_response_id": target}
        out: list[Event[H]] = [Reply(self._event("response.steer.accepted", stream_id, accepted))]
        if len(running.steers) == 1:
            out.append(Interrupt(running.handle))
        return out

    def _event(self, type: str, stream_id: str | None, steer: dict[str, Any], **more: Any) -> bytes:
        data: dict[str, Any] = {"type": type, "sequence_number": self._seq, **more, "steer": steer}
        self._seq += 1
        if stream_id is not None:
            data["stream_id"] = stream_id
        return orjson.dumps(data)

    def _steer_failed(
        self,
        code: str,
        message: str,
        target: str,
        given: Any,
        *,
        steer_id: str | None = None,
        stream_id: str | None = None,
    ) -> list[Event[H]]:
        steer: dict[str, Any] = {"input": given, "previous_response_id": target}
        if steer_id is not None:
            steer["id"] = steer_id
        error = {"type": "invalid_request_error", "code": code, "message": message}
        return [Reply(self._event("response.steer.failed", stream_id, steer, error=error))]

    # --- what the gateway did -------------------------------------------------------------------

    def bound(self, ticket: Ticket, response_id: str, handle: H, *, stored: bool) -> None:
        """A Run's create was planned: its response id, the handle to interrupt it with, and
        whether it will be kept (a steer needs it to be)."""
        if self.state is State.CLOSED:
            return
        self._running[response_id] = _Running(ticket, handle, stored)
        self._by_ticket[id(ticket)] = response_id

    def refused(self, ticket: Ticket, err: ApiError) -> list[Event[H]]:
        """A Run's create was refused (its body, its model): its error, then the lane's
        next."""
        if self.state is State.CLOSED:
            return []
        self._pop(ticket)
        out: list[Event[H]] = [Reply(error_event(err, stream_id=ticket.stream_id))]
        return out + self._advance(ticket.stream_id)

    def ended(self, ticket: Ticket, *, kept: bool) -> list[Event[H]]:
        """A Run's response is over (its last event sent); `kept`: it was stored. Then its
        successor runs if steers wait for it, else the lane's next create."""
        if self.state is State.CLOSED:
            return []
        response_id = self._by_ticket.pop(id(ticket), None)
        running = self._running.pop(response_id, None) if response_id is not None else None
        lane = self._lanes[ticket.stream_id]
        if response_id is not None:
            self._finished[response_id] = ticket.stream_id
            while len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)
        if running is not None and running.steers:
            assert response_id is not None
            if kept:
                lane[0] = successor(ticket, response_id, [given for _, given in running.steers])
                return [Run(lane[0])]
            failed: list[Event[H]] = []
            for steer_id, given in running.steers:
                failed += self._steer_failed(
                    "successor_creation_failed",
                    "The steered response ended without being kept: nothing to continue from.",
                    response_id,
                    given,
                    steer_id=steer_id,
                    stream_id=ticket.stream_id,
                )
            self._pop(ticket)
            return failed + self._advance(ticket.stream_id)
        self._pop(ticket)
        return self._advance(ticket.stream_id)

    def auth_timed_out(self) -> CloseSocket | None:
        """The gateway's auth timer fired: close if the socket is still not authenticated."""
        refused = self._gate.timed_out() if self.state is State.AWAIT_AUTH else None
        if refused is not None:
            self.state = State.CLOSED
        return refused

    def close(self) -> None:
        """The socket is closing: everything from now on is ignored."""
        self.state = State.CLOSED
        self._lanes.clear()
        self._running.clear()
        self._by_ticket.clear()
        self.in_flight = 0


def steer_input(given: Any) -> None:
    """Check a steer's `input`: a string, or a non-empty list of user messages with only
    `type` ("message"), `role` and `content`, whose content the create would take. Raises
    `ApiError`."""
    if type(given) is list:
        for index, item in enumerate(given):
            path = f"input[{index}]"
            if type(item) is not dict:
                raise invalid_request(f"Invalid '{path}': steering takes messages.", path)
            unknown = item.keys() - _MESSAGE_FIELDS
            if unknown:
                raise unknown_fields(unknown)
            if item.get("type", "message") != "message" or item.get("role") != "user":
                raise invalid_request(
                    f"Invalid '{path}': steering takes only messages with the role 'user'.",
                    path,
                )
    parse_input(given)


def successor(ticket: Ticket, response_id: str, inputs: list[Any]) -> Ticket:
    """The create that continues a steered response: its settings, the steers' input (in
    the order they came) and `previous_response_id` the steered response."""
    items: list[Any] = []
    for given in inputs:
        items += [{"role": "user", "content": given}] if type(given) is str else given
    body = {**ticket.body, "input": items, "previous_response_id": response_id}
    return Ticket(ticket.stream_id, body)
