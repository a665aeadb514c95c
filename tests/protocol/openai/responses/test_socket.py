"""The Responses WebSocket's state machine, fed messages with no event loop: lanes (FIFO
within one, concurrent between them), the stream limit, every refusal with its exact event,
authentication, steering (accepted, its interrupt, the successor, each failure) and hostile
input."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given, settings

from protocol.client_socket import CloseSocket, Reply, State
from protocol.core.errors import invalid_request
from protocol.openai.responses.socket import Event, Interrupt, ResponsesSocket, Run, Ticket
from tests.protocol.bad_input import BAD_JSON
from tests.protocol.openai.responses.events_support import Ids
from tests.protocol.strategies import hostile_bytes, json_values

KEY = "sk-right"


def session(*, keyed: bool = False, max_requests: int = 3) -> ResponsesSocket[str]:
    return ResponsesSocket(
        verify_key=(lambda key: key == KEY) if keyed else None,
        max_requests=max_requests,
        max_message_bytes=4096,
        new_id=Ids(),
    )


def state(s: ResponsesSocket[str]) -> State:
    return s.state  # a call, so that mypy does not keep a narrowed state across receive()


def send(s: ResponsesSocket[str], obj: Any) -> list[Event[str]]:
    return s.receive(orjson.dumps(obj))


def create(stream_id: str | None = None, **body: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi", **body}
    if stream_id is not None:
        obj["stream_id"] = stream_id
    return obj


def replies(events: list[Event[str]]) -> list[dict[str, Any]]:
    assert all(isinstance(e, Reply) for e in events), events
    return [orjson.loads(e.data) for e in events if isinstance(e, Reply)]


def error(
    message: str,
    param: str | None,
    code: str | None,
    *,
    status: int = 400,
    stream_id: str | None = None,
    kind: str = "invalid_request_error",
) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "error", "status": status}
    if stream_id is not None:
        event["stream_id"] = stream_id
    event["error"] = {"type": kind, "code": code, "message": message, "param": param}
    return event


def run_of(events: list[Event[str]]) -> Ticket:
    (event,) = events
    assert isinstance(event, Run), events
    return event.ticket


# --- creates and lanes -------------------------------------------------------------------------


def test_a_create_runs_at_once_with_the_post_body() -> None:
    s = session()
    ticket = run_of(send(s, create("agent_1", max_output_tokens=20)))
    assert ticket.stream_id == "agent_1"
    assert ticket.body == {"model": "m", "input": "hi", "max_output_tokens": 20, "stream": True}
    assert ticket.refusal is None
    assert s.in_flight == 1


def test_a_create_without_a_lane_runs_on_the_default_lane() -> None:
    s = session()
    ticket = run_of(send(s, create()))
    assert ticket.stream_id is None
    assert send(s, create()) == []  # the default lane is one lane: FIFO too
    assert run_of(s.ended(ticket, kept=True)).stream_id is None


@pytest.mark.parametrize("stream", [True, None])
def test_stream_true_or_null_is_the_implied_stream(stream: bool | None) -> None:
    ticket = run_of(send(session(), create(stream=stream)))
    assert ticket.body["stream"] is True


def test_a_lane_is_fifo_and_lanes_run_at_once() -> None:
    s = session(max_requests=4)
    a1 = run_of(send(s, create("a", input="a1")))
    assert send(s, create("a", input="a2")) == []  # waits for a1
    b1 = run_of(send(s, create("b", input="b1")))  # another lane: at once
    assert s.in_flight == 3
    s.bound(a1, "resp_a1", "h-a1", stored=True)
    a2 = run_of(s.ended(a1, kept=True))
    assert a2.body["input"] == "a2"
    assert s.ended(b1, kept=True) == []
    assert s.ended(a2, kept=False) == []
    assert s.in_flight == 0


def test_the_stream_limit_counts_running_and_waiting_creates() -> None:
    s = session(max_requests=2)
    first = run_of(send(s, create("a")))
    assert send(s, create("a")) == []
    assert replies(send(s, create("b"))) == [
        error(
            "This WebSocket connection has reached its stream limit (2 responses running or "
            "waiting in their lanes).",
            "stream_id",
            "websocket_stream_limit_reached",
            stream_id="b",
        )
    ]
    assert s.in_flight == 2
    run_of(s.ended(first, kept=True))  # room again
    assert run_of(send(s, create("b"))).stream_id == "b"


@pytest.mark.parametrize("stream_id", ["", "x" * 257, "a b", "é", 7, None, ["a"]])
def test_a_bad_stream_id_is_refused_at_once(stream_id: Any) -> None:
    s = session()
    obj = {**create(), "stream_id": stream_id}
    assert replies(send(s, obj)) == [
        error(
            "'stream_id' must be a string of 1 to 256 letters, digits, '_', '.' or '-'.",
            "stream_id",
            "invalid_value",
        )
    ]
    assert s.in_flight == 0


@pytest.mark.parametrize("stream_id", ["a", "x" * 256, "A-z_0.9"])
def test_good_stream_ids(stream_id: str) -> None:
    assert run_of(send(session(), create(stream_id))).stream_id == stream_id


def test_background_and_stream_false_are_refused_at_their_turn() -> None:
    s = session(max_requests=4)
    first = run_of(send(s, create("a")))
    assert send(s, create("a", background=True)) == []  # after `first`, on its lane
    assert send(s, create("a", stream=False)) == []
    assert send(s, create("a", input="last")) == []
    out = s.ended(first, kept=True)
    *refusals, last = out
    assert replies(refusals) == [
        error(
            "Background responses are not supported in WebSocket mode: use POST "
            "/v1/responses with 'background': true.",
            "background",
            "unsupported_parameter",
            stream_id="a",
        ),
        error(
            "WebSocket mode always streams: leave 'stream' out (or send true).",
            "stream",
            "unsupported_value",
            stream_id="a",
        ),
    ]
    assert isinstance(last, Run)
    assert last.ticket.body["input"] == "last"


def test_background_false_goes_to_the_plan() -> None:
    assert run_of(send(session(), create(background=False))).body["background"] is False


def test_a_create_refused_by_its_plan_gets_its_error_then_the_lane_goes_on() -> None:
    s = session()
    first = run_of(send(s, create("a")))
    assert send(s, create("a", input="next")) == []
    err = invalid_request("Invalid 'input': bad.", "input", "invalid_value")
    *refused, nxt = s.refused(first, err)
    assert replies(refused) == [
        error("Invalid 'input': bad.", "input", "invalid_value", stream_id="a")
    ]
    assert isinstance(nxt, Run)
    assert nxt.ticket.body["input"] == "next"


# --- refusals about a message ----------------------------------------------------------------


@pytest.mark.parametrize(("data", "message"), BAD_JSON)
def test_bad_json(data: bytes, message: str) -> None:
    assert replies(session().receive(data)) == [error(message, None, "invalid_json")]


@pytest.mark.parametrize("data", [b"[1]", b"null", b"{}", b'{"type": 3}'])
def test_not_a_message(data: bytes) -> None:
    assert replies(session().receive(data)) == [
        error("A message must be a JSON object with a string 'type'.", "type", "invalid_message")
    ]


@pytest.mark.parametrize("kind", ["response.cancel", "session.update", "auth", "x" * 100])
def test_unknown_types(kind: str) -> None:
    assert replies(send(session(), {"type": kind})) == [
        error(f"Unknown message type {kind[:64]!r}.", "type", "unknown_message_type")
    ]


def test_a_message_over_the_limit_is_not_read() -> None:
    s = session()
    data = orjson.dumps(create(input="x" * 5000))
    assert replies(s.receive(data)) == [
        error(
            f"Message of {len(data)} bytes is over the 4096-byte limit.",
            None,
            "message_too_large",
        )
    ]
    assert s.in_flight == 0


# --- authentication ----------------------------------------------------------------------------


def test_auth_first_when_keyed() -> None:
    s = session(keyed=True)
    assert state(s) is State.AWAIT_AUTH
    assert send(s, {"type": "auth", "api_key": KEY}) == [Reply(b'{"type":"auth.ok"}')]
    assert state(s) is State.OPEN
    run_of(send(s, create()))


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"type": "auth", "api_key": "wrong"}, "invalid API key"),
        (create(), "authenticate first"),
    ],
)
def test_refused_auth_closes(obj: dict[str, Any], reason: str) -> None:
    s = session(keyed=True)
    assert send(s, obj) == [CloseSocket(4004, reason)]
    assert s.state is State.CLOSED
    assert send(s, create()) == []


def test_auth_timer() -> None:
    s = session(keyed=True)
    assert s.auth_timed_out() == CloseSocket(4004, "no auth message in time")
    assert session().auth_timed_out() is None


def test_auth_with_unknown_fields_is_answered_and_still_waits() -> None:
    s = session(keyed=True)
    assert replies(send(s, {"type": "auth", "api_key": KEY, "x": 1})) == [
        error("Unknown field(s) in message: x.", None, "unknown_parameter")
    ]
    assert s.state is State.AWAIT_AUTH


# --- steering ----------------------------------------------------------------------------------


def running(s: ResponsesSocket[str], stream_id: str | None = "a", stored: bool = True) -> Ticket:
    ticket = run_of(send(s, create(stream_id, instructions="Be brief.", max_output_tokens=50)))
    s.bound(ticket, "resp_1", "handle-1", stored=stored)
    return ticket


def steer(target: Any = "resp_1", given: Any = "Shorter, please.", **extra: Any) -> dict[str, Any]:
    return {"type": "response.steer", "previous_response_id": target, "input": given, **extra}


def failed(code: str, message: str, given: Any = "Shorter, please.", **more: Any) -> dict[str, Any]:
    stream_id = more.pop("stream_id", None)
    event: dict[str, Any] = {
        "type": "response.steer.failed",
        "sequence_number": more.pop("seq", 0),
        "error": {"type": "invalid_request_error", "code": code, "message": message},
        "steer": {"input": given, "previous_response_id": "resp_1", **more},
    }
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event


def test_a_steer_is_accepted_interrupts_and_its_successor_runs_first() -> None:
    s = session()
    ticket = running(s)
    assert send(s, create("a", input="queued")) == []  # after the successor
    accepted, interrupt = send(s, steer())
    assert replies([accepted]) == [
        {
            "type": "response.steer.accepted",
            "sequence_number": 0,
            "steer": {"id": "steer_1", "previous_response_id": "resp_1"},
            "stream_id": "a",
        }
    ]
    assert interrupt == Interrupt("handle-1")
    # A second steer joins the first; the response is interrupted once.
    assert replies(send(s, steer(given=[{"role": "user", "content": "And kinder."}]))) == [
        {
            "type": "response.steer.accepted",
            "sequence_number": 1,
            "steer": {"id": "steer_2", "previous_response_id": "resp_1"},
            "stream_id": "a",
        }
    ]
    nxt = run_of(s.ended(ticket, kept=True))
    assert nxt.stream_id == "a"
    assert nxt.body == {
        "model": "m",
        "input": [
            {"role": "user", "content": "Shorter, please."},
            {"role": "user", "content": "And kinder."},
        ],
        "instructions": "Be brief.",
        "max_output_tokens": 50,
        "stream": True,
        "previous_response_id": "resp_1",
    }
    assert s.in_flight == 2
    assert run_of(s.ended(nxt, kept=True)).body["input"] == "queued"


def test_a_steer_of_a_response_that_was_not_kept_fails_after_it() -> None:
    s = session()
    ticket = running(s, stream_id=None)
    send(s, steer())
    assert replies(s.ended(ticket, kept=False)) == [
        failed(
            "successor_creation_failed",
            "The steered response ended without being kept: nothing to continue from.",
            id="steer_1",
            seq=1,
        )
    ]
    assert s.in_flight == 0


def test_steer_failures() -> None:
    s = session()
    assert replies(send(s, steer())) == [
        failed(
            "response_not_found",
            "No response with this id is running on this WebSocket connection.",
        )
    ]
    ticket = running(s)
    assert replies(send(s, steer(given=[{"role": "assistant", "content": "x"}]))) == [
        failed(
            "invalid_input",
            "Invalid 'input[0]': steering takes only messages with the role 'user'.",
            given=[{"role": "assistant", "content": "x"}],
            seq=1,
        )
    ]
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    (event,) = replies(send(s, steer(given=image)))
    assert event["error"]["code"] == "invalid_input"
    assert "input_image" in event["error"]["message"]
    assert replies(send(s, steer(extra=1))) == [
        failed("invalid_input", "Unknown field(s) in message: extra.", seq=3)
    ]
    empty = (
        "Invalid 'input': empty array. Expected an array with minimum length 1, but got an "
        "empty array instead."
    )
    assert replies(send(s, steer(given=[]))) == [failed("invalid_input", empty, given=[], seq=4)]
    s.ended(ticket, kept=True)
    (late,) = replies(send(s, steer()))
    assert late["error"]["code"] == "response_already_completed"
    assert late["stream_id"] == "a"


def test_a_response_not_stored_cannot_be_steered() -> None:
    s = session()
    running(s, stored=False)
    (event,) = replies(send(s, steer()))
    assert event["error"]["code"] == "steering_not_supported"
    assert event["stream_id"] == "a"


def test_too_many_pending_steers() -> None:
    s = session()
    running(s)
    for _ in range(8):
        reply = send(s, steer())[0]
        assert isinstance(reply, Reply)
        assert orjson.loads(reply.data)["type"] == "response.steer.accepted"
    (event,) = replies(send(s, steer()))
    assert event["error"]["code"] == "too_many_pending_steers"


@pytest.mark.parametrize(
    ("obj", "param", "code"),
    [
        (
            {"type": "response.steer", "input": "x"},
            "previous_response_id",
            "missing_required_parameter",
        ),
        (
            {"type": "response.steer", "input": "x", "previous_response_id": 3},
            "previous_response_id",
            "invalid_type",
        ),
        ({"type": "response.steer", "previous_response_id": "r"}, "input", None),
    ],
)
def test_a_steer_without_its_fields_is_an_error(
    obj: dict[str, Any], param: str, code: str | None
) -> None:
    (event,) = replies(send(session(), obj))
    assert event["type"] == "error"
    assert event["status"] == 400
    assert event["error"]["param"] == param
    assert event["error"]["code"] == code


def test_close_ignores_everything_after() -> None:
    s = session()
    ticket = running(s)
    s.close()
    assert s.state is State.CLOSED
    assert send(s, create()) == []
    assert s.ended(ticket, kept=True) == []
    assert s.in_flight == 0


# --- hostile input -------------------------------------------------------------------------------


@settings(max_examples=200)
@given(st.one_of(hostile_bytes(), json_values.map(orjson.dumps)))
def test_hostile_input_never_raises(data: bytes) -> None:
    s = session()
    for event in s.receive(data):
        assert isinstance(event, Reply | Run)
        if isinstance(event, Reply):
            assert orjson.loads(event.data)["type"] == "error"


@settings(max_examples=200)
@given(
    st.dictionaries(
        st.sampled_from(["type", "stream_id", "input", "previous_response_id", "model"]),
        json_values,
    )
)
def test_hostile_envelopes_never_raise(obj: dict[str, Any]) -> None:
    for kind in ("response.create", "response.steer"):
        s = session()
        s.receive(orjson.dumps({**obj, "type": kind}))
