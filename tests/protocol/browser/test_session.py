"""The browser socket's state machine, fed bytes with no event loop: every rule, the exact
replies (byte for byte what the gateway sent before the session existed), and hostile input."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from protocol.browser.messages import ErrorMessage, decode_gateway_message
from protocol.browser.session import ClientSession, Event, Start, Stop, Subscribe
from protocol.client_socket import CloseSocket, Reply, State
from protocol.openai.chat.request import parse_chat_object
from tests.protocol.bad_input import BAD_JSON
from tests.protocol.strategies import hostile_bytes, json_values, text

KEY = "sk-right"
BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PONG = [Reply(b'{"type":"pong"}')]


def session(
    *, keyed: bool = False, max_requests: int = 3, max_message_bytes: int = 4096
) -> ClientSession[str]:
    return ClientSession(
        verify_key=(lambda key: key == KEY) if keyed else None,
        max_requests=max_requests,
        max_message_bytes=max_message_bytes,
        max_tokens_limit=100,
    )


def state(s: ClientSession[str]) -> State:
    return s.state  # a call, so that mypy does not keep a narrowed state across receive()


def send(s: ClientSession[str], obj: Any) -> list[Event[str]]:
    return s.receive(orjson.dumps(obj))


def create(rid: Any, body: Any = BODY, **extra: Any) -> dict[str, Any]:
    return {"type": "chat.completions.create", "request_id": rid, "body": body, **extra}


def cancel(rid: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "cancel", "request_id": rid, **extra}


def error(
    rid: str | None, message: str, param: str | None, code: str | None, kind: str = ""
) -> list[Event[str]]:
    """The one error reply, built as the gateway's `send_error` wrote it."""
    body = {
        "type": "error",
        "request_id": rid,
        "error": {
            "message": message,
            "type": kind or "invalid_request_error",
            "param": param,
            "code": code,
        },
    }
    return [Reply(orjson.dumps(body))]


def started(rid: str, body: dict[str, Any] = BODY) -> list[Event[str]]:
    return [Start(rid, parse_chat_object({**body, "stream": True}))]


INVALID_ID = (
    "'request_id' must be a string of 1 to 256 characters.",
    "request_id",
    "invalid_request_id",
)


# Authentication.


def test_no_key_to_check_starts_open() -> None:
    s = session()
    assert state(s) is State.OPEN
    assert send(s, {"type": "ping"}) == PONG
    # Without keys, `auth` is an unknown message type.
    assert send(s, {"type": "auth", "api_key": KEY}) == error(
        None, "Unknown message type 'auth'.", "type", "unknown_message_type"
    )


def test_auth_with_the_right_key() -> None:
    seen: list[str] = []

    def verify(key: str) -> bool:
        seen.append(key)
        return key == KEY

    s: ClientSession[str] = ClientSession(
        verify_key=verify, max_requests=1, max_message_bytes=100, max_tokens_limit=1
    )
    assert state(s) is State.AWAIT_AUTH
    assert send(s, {"type": "auth", "api_key": KEY}) == [Reply(b'{"type":"auth.ok"}')]
    assert seen == [KEY]
    assert state(s) is State.OPEN
    assert send(s, {"type": "ping"}) == PONG
    assert send(s, {"type": "auth", "api_key": KEY}) == error(
        None, "Unknown message type 'auth'.", "type", "unknown_message_type"
    )
    assert seen == [KEY]
    assert s.auth_timed_out() is None
    assert state(s) is State.OPEN


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        ({"type": "auth", "api_key": "wrong"}, "invalid API key"),
        ({"type": "auth", "api_key": 12}, "invalid API key"),
        ({"type": "auth", "api_key": None}, "invalid API key"),
        ({"type": "auth"}, "invalid API key"),
        ({"type": "ping"}, "authenticate first"),
        (create("r1"), "authenticate first"),
        ({"type": "teleport"}, "authenticate first"),
    ],
)
def test_without_a_valid_key_the_socket_is_closed(first: Any, reason: str) -> None:
    s = session(keyed=True)
    assert send(s, first) == [CloseSocket(4004, reason)]
    assert state(s) is State.CLOSED
    assert send(s, {"type": "auth", "api_key": KEY}) == []
    assert s.auth_timed_out() is None


def test_auth_timer() -> None:
    s = session(keyed=True)
    assert s.auth_timed_out() == CloseSocket(4004, "no auth message in time")
    assert state(s) is State.CLOSED
    assert send(s, {"type": "auth", "api_key": KEY}) == []
    assert s.auth_timed_out() is None


@pytest.mark.parametrize("data", [b"{nope", b"[1]", b'{"type": 1}', b"x" * 101])
def test_bad_messages_before_auth_are_answered_not_closed(data: bytes) -> None:
    s = session(keyed=True, max_message_bytes=100)
    [reply] = s.receive(data)
    assert isinstance(reply, Reply)
    assert orjson.loads(reply.data)["request_id"] is None
    assert state(s) is State.AWAIT_AUTH
    assert send(s, {"type": "auth", "api_key": KEY}) == [Reply(b'{"type":"auth.ok"}')]


def test_auth_with_unknown_fields_is_refused_without_checking_the_key() -> None:
    s: ClientSession[str] = ClientSession(
        verify_key=lambda key: pytest.fail("the key was checked"),
        max_requests=1,
        max_message_bytes=100,
        max_tokens_limit=1,
    )
    assert send(s, {"type": "auth", "api_key": KEY, "user": "me"}) == error(
        None, "Unknown field(s) in message: user.", None, "unknown_parameter"
    )
    assert state(s) is State.AWAIT_AUTH


# Messages that are not messages.


def test_too_large() -> None:
    s = session(max_message_bytes=20)
    assert s.receive(b"x" * 21) == error(
        None, "Message of 21 bytes is over the 20-byte limit.", None, "message_too_large"
    )
    # A str is measured as the bytes the client sent.
    assert s.receive("é" * 11) == error(
        None, "Message of 22 bytes is over the 20-byte limit.", None, "message_too_large"
    )
    assert s.receive(b'{"type":"ping"}     ') == PONG  # exactly the limit
    assert s.receive('{"type":"ping"}     ') == PONG


@pytest.mark.parametrize(("data", "message"), BAD_JSON)
def test_invalid_json(data: bytes, message: str) -> None:
    assert session().receive(data) == error(None, message, None, "invalid_json")


@pytest.mark.parametrize("obj", [[1, 2], None, "ping", 7, {}, {"type": 7}, {"type": ["ping"]}])
def test_invalid_message(obj: Any) -> None:
    assert send(session(), obj) == error(
        None, "A message must be a JSON object with a string 'type'.", "type", "invalid_message"
    )


@pytest.mark.parametrize(
    ("tag", "shown"),
    [("teleport", "'teleport'"), ("chunk", "'chunk'"), ("x" * 100, repr("x" * 64)), ("", "''")],
)
def test_unknown_message_type(tag: str, shown: str) -> None:
    assert send(session(), {"type": tag}) == error(
        None, f"Unknown message type {shown}.", "type", "unknown_message_type"
    )


# Creates.


def test_create_starts_a_request() -> None:
    s = session()
    assert send(s, create("r1")) == started("r1")
    assert s.in_flight == 1
    assert s.handles() == []


def test_create_takes_stream_true_and_stream_options() -> None:
    s = session()
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    [event] = send(s, create("r1", body))
    assert isinstance(event, Start)
    assert event.chat.stream
    assert event.chat.include_usage


@pytest.mark.parametrize("rid", ["x" * 256, "日本語", " "])
def test_request_id_edges(rid: str) -> None:
    assert send(session(), create(rid)) == started(rid)


@pytest.mark.parametrize("rid", [..., None, 1, "", "x" * 257, ["r"]])
def test_create_with_an_invalid_request_id(rid: Any) -> None:
    s = session()
    message = create(rid, unknown=1)  # the id is checked before the fields
    if rid is ...:
        del message["request_id"]
    assert send(s, message) == error(None, *INVALID_ID)
    assert s.in_flight == 0


def test_duplicate_request_id_is_refused_with_request_id_null() -> None:
    s = session()
    send(s, create("dup"))
    # Null even with unknown fields or a bad body: an error naming "dup" would end the original.
    for message in (create("dup"), create("dup", extra=1), create("dup", {})):
        assert send(s, message) == error(
            None,
            "request_id 'dup' is already in flight on this socket.",
            "request_id",
            "duplicate_request_id",
        )
    assert s.in_flight == 1


def test_too_many_requests() -> None:
    s = session(max_requests=2)
    send(s, create("a"))
    send(s, create("b"))
    too_many = error(
        "c",
        "At most 2 requests may be in flight on one socket.",
        None,
        "too_many_requests",
        "rate_limit_error",
    )
    assert send(s, create("c")) == too_many
    assert send(s, create("c", extra=1)) == too_many  # before the fields are looked at
    assert send(s, create("a")) == error(  # a duplicate is still a duplicate
        None,
        "request_id 'a' is already in flight on this socket.",
        "request_id",
        "duplicate_request_id",
    )
    assert s.in_flight == 2
    s.ended("a")
    assert send(s, create("c")) == started("c")


def test_unknown_fields_in_a_create() -> None:
    s = session()
    # Before the body is looked at, named sorted, attributed to the request.
    assert send(s, create("r1", {}, zeta=1, alpha=2)) == error(
        "r1", "Unknown field(s) in message: alpha, zeta.", None, "unknown_parameter"
    )
    assert s.in_flight == 0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            ...,
            (
                "Invalid type for the request body: expected an object, but got null instead.",
                None,
                "invalid_type",
            ),
        ),
        (
            [BODY],
            (
                "Invalid type for the request body: expected an object, but got an array instead.",
                None,
                "invalid_type",
            ),
        ),
        (
            {**BODY, "max_tokens": 101},
            (
                "max_tokens is 101; this gateway allows at most 100.",
                "max_tokens",
                "integer_above_max_value",
            ),
        ),
        (
            {**BODY, "stream": False},
            ("The WebSocket API always streams; 'stream' must be true or omitted.", "stream", None),
        ),
        (
            {**BODY, "n": 200},
            (
                "Invalid 'n': integer above maximum value. Expected a value <= 128, but got "
                "200 instead.",
                "n",
                "integer_above_max_value",
            ),
        ),
    ],
)
def test_refused_bodies(body: Any, expected: tuple[str, str | None, str | None]) -> None:
    s = session()
    message = create("r1", body)
    if body is ...:
        del message["body"]
    assert send(s, message) == error("r1", *expected)
    # Refused creates are not tracked: the id is free, nothing counts.
    assert s.in_flight == 0
    assert send(s, create("r1")) == started("r1")


# Cancels.


def test_cancel_of_a_request_waiting_for_its_handle() -> None:
    s = session()
    send(s, create("r1"))
    assert send(s, cancel("r1")) == [Stop("r1", None)]
    assert send(s, cancel("r1")) == [Stop("r1", None)]  # again: stopping is idempotent
    # Bound after the cancel went out: the gateway must stop the handle itself.
    assert s.bind("r1", "h1") is False
    assert send(s, cancel("r1")) == [Stop("r1", "h1")]
    assert s.in_flight == 1  # until the gateway says it ended
    s.ended("r1")
    assert send(s, cancel("r1")) == []


def test_cancel_of_a_bound_request() -> None:
    s = session()
    send(s, create("r1"))
    assert s.bind("r1", "h1") is True
    assert send(s, cancel("r1")) == [Stop("r1", "h1")]
    assert s.in_flight == 1


def test_cancel_of_an_unknown_or_ended_request_is_ignored() -> None:
    s = session()
    assert send(s, cancel("never")) == []
    send(s, create("r1"))
    s.ended("r1")
    assert send(s, cancel("r1")) == []


@pytest.mark.parametrize("rid", [..., None, 2, "", "x" * 257])
def test_cancel_with_an_invalid_request_id(rid: Any) -> None:
    message = cancel(rid)
    if rid is ...:
        del message["request_id"]
    assert send(session(), message) == error(None, *INVALID_ID)


def test_cancel_with_unknown_fields_is_refused_with_request_id_null() -> None:
    s = session()
    send(s, create("r1"))
    # Null: an error naming r1 would end r1 in the client's eyes while it runs on.
    assert send(s, cancel("r1", body={}, why="slow")) == error(
        None, "Unknown field(s) in message: body, why.", None, "unknown_parameter"
    )
    assert send(s, cancel("gone", x=1)) == error(
        None, "Unknown field(s) in message: x.", None, "unknown_parameter"
    )
    assert s.in_flight == 1
    assert s.bind("r1", "h1") is True  # not stopped


# Ping and pool.subscribe.


def test_ping() -> None:
    s = session()
    assert s.receive(b'{"type": "ping"}') == PONG
    assert s.receive('{"type": "ping"}') == PONG
    assert send(s, {"type": "ping", "request_id": "r1"}) == error(
        None, "Unknown field(s) in message: request_id.", None, "unknown_parameter"
    )


def test_pool_subscribe_once() -> None:
    s = session()
    assert send(s, {"type": "pool.subscribe", "every": 5}) == error(
        None, "Unknown field(s) in message: every.", None, "unknown_parameter"
    )
    assert not s.subscribed
    assert send(s, {"type": "pool.subscribe"}) == [Subscribe()]
    assert s.subscribed
    assert send(s, {"type": "pool.subscribe"}) == []


# The gateway's side.


def test_bind_handles_ended() -> None:
    s = session()
    for rid in ("a", "b", "c"):
        send(s, create(rid))
    assert s.bind("c", "hc")
    assert s.bind("a", "ha")
    assert s.handles() == ["ha", "hc"]  # bound ones only, in the order they were created
    assert s.bind("nope", "hx") is False
    s.ended("a")
    s.ended("a")  # twice, or unknown: ignored
    s.ended("nope")
    assert s.handles() == ["hc"]
    assert s.in_flight == 2


def test_close() -> None:
    s = session()
    send(s, create("a"))
    send(s, create("b"))
    s.bind("b", "hb")
    assert s.close() == ["hb"]
    assert state(s) is State.CLOSED
    assert s.in_flight == 0
    assert s.handles() == []
    assert send(s, {"type": "ping"}) == []
    assert send(s, create("c")) == []
    assert s.bind("a", "ha") is False  # a request that got its handle as the socket closed
    assert s.close() == []


# Hostile input.


def _check_events(s: ClientSession[str], events: list[Event[str]]) -> None:
    """At most one event; every reply a valid gateway message; an error names only a request
    that is not in flight (it was that create's last message)."""
    assert len(events) <= 1
    for event in events:
        if isinstance(event, Reply):
            message = decode_gateway_message(event.data)
            if isinstance(message, ErrorMessage) and message.request_id is not None:
                assert s.bind(message.request_id, "h") is False
        else:
            assert isinstance(event, CloseSocket | Start | Stop | Subscribe)


@settings(max_examples=200)
@given(data=hostile_bytes() | st.binary(max_size=64), keyed=st.booleans())
def test_hostile_bytes(data: bytes, keyed: bool) -> None:
    s = session(keyed=keyed)
    events = s.receive(data)
    assert all(isinstance(event, Reply | CloseSocket) for event in events)
    _check_events(s, events)


@settings(max_examples=200)
@given(data=text, keyed=st.booleans())
def test_hostile_text(data: str, keyed: bool) -> None:
    events = session(keyed=keyed).receive(data)
    assert all(isinstance(event, Reply | CloseSocket) for event in events)


@settings(max_examples=200)
@given(obj=json_values, keyed=st.booleans())
def test_hostile_json(obj: Any, keyed: bool) -> None:
    s = session(keyed=keyed)
    events = send(s, obj)
    assert all(isinstance(event, Reply | CloseSocket) for event in events)
    _check_events(s, events)


hostile_messages = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["chat.completions.create", "cancel", "ping", "pool.subscribe", "auth"]
        )
    },
    optional={
        "request_id": st.sampled_from(["r1", "r2", ""]) | json_values,
        "body": json_values | st.just(BODY),
        "api_key": st.just(KEY) | json_values,
        "extra": json_values,
    },
)


@settings(max_examples=300)
@given(messages=st.lists(hostile_messages, max_size=8), keyed=st.booleans())
def test_hostile_messages(messages: list[dict[str, Any]], keyed: bool) -> None:
    s = session(keyed=keyed)
    for message in messages:
        _check_events(s, send(s, message))


# A model of the requests in flight.

RIDS = st.sampled_from(["a", "b", "c", "d"])


class RequestsInFlight(RuleBasedStateMachine):
    """Random creates, cancels, binds and ends against a dict of what should be in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.session = session(max_requests=3)
        self.model: dict[str, str | None] = {}
        self.stopped: set[str] = set()
        self.handles = 0

    @rule(rid=RIDS, extra=st.booleans())
    def create(self, rid: str, extra: bool) -> None:
        events = send(self.session, create(rid, **({"x": 1} if extra else {})))
        if rid in self.model or len(self.model) >= 3 or extra:
            [reply] = events
            assert isinstance(reply, Reply)
        else:
            assert events == started(rid)
            self.model[rid] = None

    @rule(rid=RIDS)
    def cancel(self, rid: str) -> None:
        events = send(self.session, cancel(rid))
        if rid in self.model:
            assert events == [Stop(rid, self.model[rid])]
            if self.model[rid] is None:
                self.stopped.add(rid)
        else:
            assert events == []

    @rule(rid=RIDS)
    def bind(self, rid: str) -> None:
        if rid in self.model and self.model[rid] is not None:
            return  # the gateway binds a request once
        self.handles += 1
        handle = f"h{self.handles}"
        runs_on = self.session.bind(rid, handle)
        assert runs_on is (rid in self.model and rid not in self.stopped)
        if rid in self.model:
            self.model[rid] = handle

    @rule(rid=RIDS)
    def ended(self, rid: str) -> None:
        self.session.ended(rid)
        self.model.pop(rid, None)
        self.stopped.discard(rid)

    @invariant()
    def in_flight_matches(self) -> None:
        assert self.session.in_flight == len(self.model)
        assert sorted(self.session.handles()) == sorted(h for h in self.model.values() if h)


TestRequestsInFlight = RequestsInFlight.TestCase
