"""The gateway's side of one browser socket, as a state machine. No I/O.

Every rule about what a browser may send when lives here (h11's "one place" rule). The
gateway feeds each WebSocket message to `receive` and acts on the events it returns; it tells
the session what it did with `bind` and `ended`, and about its auth timer with
`auth_timed_out`.

    ClientSession
        AWAIT_AUTH --auth, right key-----------------> OPEN     Reply auth.ok
        AWAIT_AUTH --auth, wrong or no key-----------> CLOSED   CloseSocket 4004 invalid API key
        AWAIT_AUTH --any other type------------------> CLOSED   CloseSocket 4004 authenticate first
        AWAIT_AUTH --auth_timed_out()----------------> CLOSED   CloseSocket 4004 no auth message…
        AWAIT_AUTH, OPEN --close()-------------------> CLOSED   (the bound handles, to stop)
        (no key to check: the session starts OPEN)

        In any state but CLOSED a message that is too large, not JSON, or not an object with
        a string type is answered with an error (request_id null) and changes nothing. So is
        an `auth` with unknown fields. In CLOSED every message is ignored.

    One request, while OPEN
        create ---> IN FLIGHT (Start) --bind(handle)--> IN FLIGHT, bound --ended()--> gone
        cancel of an id in flight: Stop(handle, or None if not bound yet), any number of times
        cancel of any other id: nothing (cancel and done cross on the wire)

An error names a request_id only when it is that request's last message, i.e. for a refused
create (then the id is not in flight). Errors that cannot end a request are sent with
request_id null: a create reusing an id in flight, and every refused cancel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs

from protocol.browser import errors
from protocol.browser.messages import (
    CancelRequest,
    Create,
    ErrorMessage,
    Ping,
    Pong,
    PoolSubscribe,
    chat_request,
    encode,
    request_id_of,
    structure,
)
from protocol.client_socket import (
    AuthGate,
    CloseSocket,
    Reply,
    State,
    load,
    unknown_message_type,
)
from protocol.core.errors import ApiError
from protocol.openai.chat.request import ChatRequest
from protocol.openai.errors import error_body
from protocol.openai.params import MAX_N

H = TypeVar("H")
"""What the gateway runs one request with (its stream, its task): the session only holds it."""


@attrs.frozen
class Start:
    """Run this valid chat request; call `bind` once it has a handle, `ended` once over."""

    request_id: str
    chat: ChatRequest


@attrs.frozen
class Stop(Generic[H]):
    """Stop a request in flight: its bound handle, or (None) the request still being set up.
    Stopping must be idempotent: a client may cancel a request more than once."""

    request_id: str
    handle: H | None


@attrs.frozen
class Subscribe:
    """Start sending this socket `pool.state` messages (comes once per socket)."""


Event = Reply | CloseSocket | Start | Stop[H] | Subscribe

_PONG = encode(Pong())


@attrs.define
class _Request(Generic[H]):
    handle: H | None = None
    stopped: bool = False
    """A Stop went out before the request was bound."""


class ClientSession(Generic[H]):
    """The gateway's side of one browser socket (see the module docstring)."""

    def __init__(
        self,
        *,
        verify_key: Callable[[str], bool] | None,
        max_requests: int,
        max_message_bytes: int,
        max_tokens_limit: int,
        store: bool = False,
        max_choices: int = MAX_N,
    ) -> None:
        """`verify_key` checks an `auth` message's key; None: the socket needs no `auth`
        (the gateway has no keys, or the upgrade request had a valid `Authorization`).
        `store`: the gateway keeps stored completions (`store: true` is accepted)."""
        self._gate = AuthGate(verify_key)
        self.max_requests = max_requests
        self.max_message_bytes = max_message_bytes
        self.max_tokens_limit = max_tokens_limit
        self.max_choices = max_choices
        self.store = store
        self.state = State.OPEN if verify_key is None else State.AWAIT_AUTH
        self.subscribed = False
        """A `pool.subscribe` has been taken."""
        self._requests: dict[str, _Request[H]] = {}

    @property
    def in_flight(self) -> int:
        """Requests started and not yet ended (waiting for a runner counts)."""
        return len(self._requests)

    def handles(self) -> list[H]:
        """The bound handles of the requests in flight."""
        return [req.handle for req in self._requests.values() if req.handle is not None]

    # --- input ------------------------------------------------------------------------------

    def receive(self, data: bytes | str) -> list[Event[H]]:
        """The events for one WebSocket message (text or binary). Never raises for what a
        client sent: anything wrong is answered with an error Reply or a CloseSocket."""
        if self.state is State.CLOSED:
            return []
        try:
            obj = load(data, self.max_message_bytes)
        except ApiError as err:
            return self._error(None, err)
        if self.state is State.AWAIT_AUTH:
            return self._authenticate(obj)
        match obj["type"]:
            case "chat.completions.create":
                return self._create(obj)
            case "cancel":
                return self._cancel(obj)
            case "ping":
                return self._ping(obj)
            case "pool.subscribe":
                return self._subscribe(obj)
            case other:
                # `auth` too: once OPEN there is nothing to authenticate.
                return self._error(None, unknown_message_type(other))

    def _authenticate(self, obj: dict[str, Any]) -> list[Event[H]]:
        try:
            admitted = self._gate.admit(obj)
        except ApiError as err:
            return self._error(None, err)  # unknown fields: the key is not even looked at
        if isinstance(admitted, CloseSocket):
            self.state = State.CLOSED
            return [admitted]
        self.state = State.OPEN
        return [Reply(admitted)]

    def _error(self, request_id: str | None, err: ApiError) -> list[Event[H]]:
        return [Reply(encode(ErrorMessage(request_id, error_body(err)["error"])))]

    def _create(self, obj: dict[str, Any]) -> list[Event[H]]:
        # The order of the checks is the API's: each later error names the request.
        try:
            rid = request_id_of(obj)
        except ApiError as err:
            return self._error(None, err)
        if rid in self._requests:
            # Refused with request_id null: an error naming rid would end the original.
            return self._error(None, errors.duplicate_request_id(rid))
        if len(self._requests) >= self.max_requests:
            return self._error(rid, errors.too_many_requests(self.max_requests))
        try:
            create = structure(obj, Create)  # a valid request_id, any body: only extra keys
            chat = chat_request(
                create.body, self.max_tokens_limit, store=self.store, max_choices=self.max_choices
            )
        except ApiError as err:
            return self._error(rid, err)  # refused requests are not tracked
        self._requests[rid] = _Request()
        return [Start(rid, chat)]

    def _cancel(self, obj: dict[str, Any]) -> list[Event[H]]:
        try:
            rid = request_id_of(obj)
            structure(obj, CancelRequest)
        except ApiError as err:
            # Null even with a valid id: the request it names goes on (see the docstring).
            return self._error(None, err)
        req = self._requests.get(rid)
        if req is None:
            return []  # already ended: cancel and done crossed on the wire
        if req.handle is None:
            req.stopped = True
        return [Stop(rid, req.handle)]

    def _ping(self, obj: dict[str, Any]) -> list[Event[H]]:
        try:
            structure(obj, Ping)
        except ApiError as err:
            return self._error(None, err)
        return [Reply(_PONG)]

    def _subscribe(self, obj: dict[str, Any]) -> list[Event[H]]:
        try:
            structure(obj, PoolSubscribe)
        except ApiError as err:
            return self._error(None, err)
        if self.subscribed:
            return []
        self.subscribed = True
        return [Subscribe()]

    # --- what the gateway did ----------------------------------------------------------------

    def bind(self, request_id: str, handle: H) -> bool:
        """Attach the handle a started request runs with. True: it runs on. False: stop the
        handle now, because the request was cancelled before it was bound (the handle is kept
        until `ended`), or it is not in flight (the socket closed, or it ended)."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        req.handle = handle
        return not req.stopped

    def ended(self, request_id: str) -> None:
        """The request is over (its `done` or `error` is sent): its id may be reused, and it
        no longer counts against `max_requests`. Unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def auth_timed_out(self) -> CloseSocket | None:
        """The gateway's auth timer fired: close if the socket is still not authenticated."""
        refused = self._gate.timed_out() if self.state is State.AWAIT_AUTH else None
        if refused is not None:
            self.state = State.CLOSED
        return refused

    def close(self) -> list[H]:
        """The socket is closing: the session ignores everything from now on. Returns the
        bound handles of the requests in flight, which the gateway must stop."""
        handles = self.handles()
        self.state = State.CLOSED
        self._requests.clear()
        return handles
