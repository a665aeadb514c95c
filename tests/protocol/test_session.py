"""The runner's side of its connection (RunnerSession), driven with frames and no event loop,
and both sides against each other. The gateway's side alone: test_gateway_session.py."""

from __future__ import annotations

from collections import deque
from typing import Literal, get_args

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protocol.closecodes import CloseCode
from protocol.codec import decode_gateway_frame, decode_runner_frame, encode
from protocol.errors import ProtocolError, StateError
from protocol.frames import (
    PROTOCOL_VERSION,
    Cancel,
    Chunk,
    Drain,
    Error,
    ErrorCode,
    FinishReason,
    GatewayFrame,
    Generate,
    Heartbeat,
    RunnerFrame,
    Usage,
    Welcome,
)
from protocol.session import (
    Delivered,
    GatewaySession,
    Lost,
    RequestFailed,
    RunnerSession,
    State,
    Unstarted,
)
from tests.protocol.sessions import STATS, USAGE, chunk, generate, make_hello
from tests.protocol.strategies import text


def make_welcome(protocol_version: int = PROTOCOL_VERSION) -> Welcome:
    return Welcome(runner_id="rn-1", protocol_version=protocol_version, heartbeat_interval=5.0)


def open_runner(max_concurrent: int = 2) -> RunnerSession:
    session = RunnerSession(make_hello(max_concurrent=max_concurrent))
    assert session.receive(make_welcome()) is None
    return session


def runner_chunk(
    session: RunnerSession, request_id: str, finish_reason: FinishReason | None = None
) -> Chunk:
    return session.chunk(
        request_id,
        text="x",
        reasoning="",
        tokens=1,
        usage=USAGE,
        finish_reason=finish_reason,
        stats=STATS if finish_reason is not None else None,
    )


# RunnerSession.


@pytest.mark.parametrize(
    "frame", [generate("r"), Cancel("r"), Heartbeat(1.0)], ids=["generate", "cancel", "heartbeat"]
)
def test_runner_refuses_anything_before_welcome(frame: GatewayFrame) -> None:
    session = RunnerSession(make_hello())
    with pytest.raises(StateError, match="expected welcome first") as info:
        session.receive(frame)
    assert info.value.close_code is CloseCode.ILLEGAL_STATE
    assert session.state is State.AWAIT_WELCOME
    assert session.in_flight == []


def test_runner_accepts_welcome() -> None:
    session = RunnerSession(make_hello())
    welcome = make_welcome()
    assert session.receive(welcome) is None
    assert session.state is State.OPEN
    assert session.welcome is welcome


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1])
def test_runner_refuses_other_protocol_versions(version: int) -> None:
    session = RunnerSession(make_hello())
    with pytest.raises(ProtocolError, match="protocol") as info:
        session.receive(make_welcome(protocol_version=version))
    assert info.value.close_code is CloseCode.UNSUPPORTED_VERSION
    assert session.state is State.AWAIT_WELCOME


def test_runner_refuses_second_welcome() -> None:
    session = open_runner()
    with pytest.raises(StateError, match="welcome sent twice"):
        session.receive(make_welcome())


def test_runner_accepts_generate_and_heartbeat() -> None:
    session = open_runner()
    assert session.receive(generate("r", "m2")) is None
    assert session.receive(Heartbeat(3.0)) is None
    assert session.in_flight == ["r"]
    assert not session.is_cancelled("r")


def test_runner_answers_unserved_model_with_error() -> None:
    session = open_runner()
    reply = session.receive(generate("r", "other"))
    assert isinstance(reply, Error)
    assert reply.request_id == "r"
    assert reply.code == "model_not_found"
    assert "'other'" in reply.message
    assert session.in_flight == []


def test_runner_answers_over_capacity_with_error() -> None:
    session = open_runner(max_concurrent=1)
    assert session.receive(generate("a")) is None
    reply = session.receive(generate("b"))
    assert isinstance(reply, Error)
    assert (reply.request_id, reply.code) == ("b", "over_capacity")
    assert session.in_flight == ["a"]
    # The refused id was never taken: it may come again once there is room.
    runner_chunk(session, "a", "stop")
    assert session.receive(generate("b")) is None


def test_runner_refuses_duplicate_request_id() -> None:
    session = open_runner()
    session.receive(generate("r"))
    with pytest.raises(StateError, match="'r' already in flight"):
        session.receive(generate("r"))
    # Checked before the model, so a duplicate is a violation even for an unserved model.
    with pytest.raises(StateError):
        session.receive(generate("r", "other"))


def test_runner_ignores_cancel_of_unknown_request() -> None:
    session = open_runner()
    session.receive(generate("r"))
    assert session.receive(Cancel("gone")) is None
    assert session.in_flight == ["r"]
    assert not session.is_cancelled("r")
    assert session.is_cancelled("gone")


def test_runner_cancel_marks_request() -> None:
    session = open_runner()
    session.receive(generate("r"))
    assert session.receive(Cancel("r")) is None
    assert session.is_cancelled("r")
    # Cancelled, but still running until the final chunk says so.
    assert session.in_flight == ["r"]
    assert session.receive(Cancel("r")) is None
    assert runner_chunk(session, "r", "cancelled").seq == 0
    assert session.in_flight == []
    # The gateway's Cancel may cross the final chunk on the wire.
    assert session.receive(Cancel("r")) is None


def test_runner_numbers_chunks() -> None:
    session = open_runner()
    session.receive(generate("a"))
    session.receive(generate("b"))
    assert [runner_chunk(session, "a").seq for _ in range(3)] == [0, 1, 2]
    assert runner_chunk(session, "b").seq == 0
    final = session.chunk(
        "a",
        text="end",
        reasoning="why",
        tokens=2,
        usage=Usage(5, 6),
        finish_reason="length",
        stats=STATS,
    )
    assert final == Chunk("a", 3, "end", "why", 2, Usage(5, 6), "length", STATS)
    assert session.in_flight == ["b"]
    with pytest.raises(StateError, match="'a' is not in flight"):
        runner_chunk(session, "a")
    with pytest.raises(StateError, match="'nope' is not in flight"):
        runner_chunk(session, "nope")


def test_runner_restarts_numbering_for_a_reused_id() -> None:
    session = open_runner()
    session.receive(generate("r"))
    runner_chunk(session, "r")
    runner_chunk(session, "r", "stop")
    session.receive(generate("r"))
    assert runner_chunk(session, "r").seq == 0


def test_runner_error_ends_request() -> None:
    session = open_runner()
    session.receive(generate("r"))
    runner_chunk(session, "r")
    frame = session.error("r", "internal_error", "out of memory")
    assert frame == Error("r", "internal_error", "out of memory")
    assert session.in_flight == []
    with pytest.raises(StateError):
        session.error("r", "internal_error", "again")
    with pytest.raises(StateError):
        runner_chunk(session, "r")


def test_runner_close() -> None:
    session = open_runner(max_concurrent=3)
    for request_id in ("a", "b", "c"):
        session.receive(generate(request_id))
    runner_chunk(session, "b", "stop")
    assert session.close() == ["a", "c"]
    assert session.state is State.CLOSED
    assert session.in_flight == []
    for frame in (generate("d"), Cancel("a"), Heartbeat(1.0), make_welcome()):
        with pytest.raises(StateError, match="closed"):
            session.receive(frame)
    with pytest.raises(StateError):
        runner_chunk(session, "a")
    assert session.close() == []


# Both sides against each other, through the codec.

REQUEST_IDS = ("r0", "r1", "r2", "r3", "r4")
MODELS = ("m1", "m2")
MAX_CONCURRENT = 3
# What the runner does next with a running request: mostly a middle chunk, so that
# requests run long enough to overlap, sometimes a last chunk or an error.
RUNNER_MOVES: tuple[FinishReason | Literal["error"] | None, ...] = (
    None,
    None,
    None,
    None,
    "stop",
    "length",
    "cancelled",
    "error",
)


class Link(RuleBasedStateMachine):
    """A gateway session and a runner session joined by two FIFO pipes of encoded frames.

    Frames wait in the pipes, so requests end, get cancelled and start again while frames
    about them are still on the way. Whatever the order, the two sides must agree on which
    requests are running, and every frame one side builds must be accepted by the other.
    Few rules, each broad: hypothesis turns rules off at random per run (swarm testing),
    and a request only progresses when gateway_generate, deliver and runner_move are all on.
    Each of those does a few steps at once, so requests run long and overlap.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hello = make_hello(models=MODELS, max_concurrent=MAX_CONCURRENT)
        self.gateway: GatewaySession[str] = GatewaySession()
        self.runner = RunnerSession(self.hello)
        self.started: set[str] = set()
        """Requests the gateway has had a chunk of (since their Generate)."""
        self.to_runner: deque[tuple[bytes, GatewayFrame]] = deque()
        self.to_gateway: deque[tuple[bytes, RunnerFrame]] = deque()
        self.cancel_sent: set[str] = set()
        self.closed = False

    def _gateway_ids(self) -> set[str]:
        return {rid for rid in REQUEST_IDS if self.gateway.is_in_flight(rid)}

    @initialize()
    def handshake(self) -> None:
        hello = decode_runner_frame(encode(self.hello))
        assert self.gateway.receive(hello) == []
        welcome = decode_gateway_frame(encode(make_welcome()))
        assert self.runner.receive(welcome) is None

    @rule(request_id=st.sampled_from(REQUEST_IDS), model=st.sampled_from((*MODELS, "m3")))
    def gateway_generate(self, request_id: str, model: str) -> None:
        frame = generate(request_id, model)
        refused = (
            self.closed
            or self.gateway.is_in_flight(request_id)
            or self.gateway.in_flight >= MAX_CONCURRENT
            or model not in MODELS
        )
        before = self._gateway_ids()
        if refused:
            with pytest.raises(StateError):
                self.gateway.assign(frame, request_id)
            assert self._gateway_ids() == before
        else:
            sent = self.gateway.assign(frame, request_id)
            self.to_runner.append((encode(sent), sent))
            assert self._gateway_ids() == before | {request_id}

    @rule(request_id=st.sampled_from(REQUEST_IDS))
    def gateway_cancel(self, request_id: str) -> None:
        frame = self.gateway.cancel(request_id)
        if (
            self.closed
            or not self.gateway.is_in_flight(request_id)
            or request_id in self.cancel_sent
        ):
            assert frame is None
        else:
            assert frame == Cancel(request_id)
            self.cancel_sent.add(request_id)
            self.to_runner.append((encode(frame), frame))

    @rule(from_gateway=st.booleans(), sent_at=st.floats(0, 2e9))
    def heartbeat(self, from_gateway: bool, sent_at: float) -> None:
        frame = Heartbeat(sent_at)
        if self.closed:
            with pytest.raises(StateError, match="closed"):
                self.runner.receive(frame)
            with pytest.raises(StateError, match="closed"):
                self.gateway.receive(frame)
        elif from_gateway:
            self.to_runner.append((encode(frame), frame))
        else:
            self.to_gateway.append((encode(frame), frame))

    @precondition(lambda self: bool(self.runner.in_flight))
    @rule(
        data=st.data(),
        middle=st.integers(0, 3),
        move=st.sampled_from(RUNNER_MOVES),
        body=text,
        code=st.sampled_from(get_args(ErrorCode)),
    )
    def runner_move(
        self,
        data: st.DataObject,
        middle: int,
        move: FinishReason | Literal["error"] | None,
        body: str,
        code: ErrorCode,
    ) -> None:
        """The runner sends a few chunks of a running request, then maybe ends it."""
        request_id = data.draw(st.sampled_from(self.runner.in_flight))
        for _ in range(middle):
            more = runner_chunk(self.runner, request_id)
            self.to_gateway.append((encode(more), more))
        frame: RunnerFrame
        if move == "error":
            frame = self.runner.error(request_id, code, body)
        else:
            finish = move
            if finish == "cancelled" and not self.runner.is_cancelled(request_id):
                finish = None
            frame = self.runner.chunk(
                request_id,
                text=body,
                reasoning="",
                tokens=1,
                usage=USAGE,
                finish_reason=finish,
                stats=STATS if finish is not None else None,
            )
        still_running = isinstance(frame, Chunk) and frame.finish_reason is None
        assert (request_id in self.runner.in_flight) == still_running
        self.to_gateway.append((encode(frame), frame))

    @precondition(lambda self: bool(self.to_runner or self.to_gateway))
    @rule(to_runner=st.booleans(), count=st.integers(1, 3))
    def deliver(self, to_runner: bool, count: int) -> None:
        """Deliver the oldest frames one way (the other way if nothing waits that way)."""
        for _ in range(count):
            if self.to_runner or self.to_gateway:
                self._deliver_one(to_runner)

    def _deliver_one(self, to_runner: bool) -> None:
        if (to_runner and self.to_runner) or not self.to_gateway:
            data, sent = self.to_runner.popleft()
            frame = decode_gateway_frame(data)
            assert frame == sent
            # What the gateway session let through, the runner never has to refuse.
            assert self.runner.receive(frame) is None
        else:
            data, sent_by_runner = self.to_gateway.popleft()
            from_runner = decode_runner_frame(data)
            assert from_runner == sent_by_runner
            # Every frame the runner session builds is legal for the gateway session, and
            # means what it says for the request it names.
            events = self.gateway.receive(from_runner)
            if isinstance(from_runner, Chunk):
                assert events == [Delivered(from_runner.request_id, from_runner)]
                self.started.add(from_runner.request_id)
            elif isinstance(from_runner, Error):
                rid = from_runner.request_id
                assert rid is not None
                unstarted = from_runner.code == "over_capacity" and rid not in self.started
                assert events == [
                    Unstarted(rid, from_runner.message)
                    if unstarted
                    else RequestFailed(rid, from_runner)
                ]
            else:
                assert events == []
            if isinstance(from_runner, Error) or (
                isinstance(from_runner, Chunk) and from_runner.finish_reason is not None
            ):
                assert from_runner.request_id is not None
                assert not self.gateway.is_in_flight(from_runner.request_id)
                self.cancel_sent.discard(from_runner.request_id)
                self.started.discard(from_runner.request_id)

    # Only with requests running, so there is something to lose.
    @precondition(lambda self: not self.closed and len(self.runner.in_flight) >= 2)
    @rule()
    def close(self) -> None:
        gateway_ids = self._gateway_ids()
        runner_ids = set(self.runner.in_flight)
        lost = self.gateway.close()
        assert sorted(event.handle for event in lost) == sorted(gateway_ids)
        for event in lost:
            assert event == (
                Lost(event.handle)
                if event.handle in self.started
                else Unstarted(event.handle, "runner lost")
            )
        assert sorted(self.runner.close()) == sorted(runner_ids)
        # Whatever was still on the wire is dropped with the connection.
        self.to_runner.clear()
        self.to_gateway.clear()
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule(request_id=st.sampled_from(REQUEST_IDS))
    def after_close(self, request_id: str) -> None:
        with pytest.raises(StateError, match="closed"):
            self.runner.receive(generate(request_id))
        with pytest.raises(StateError):
            runner_chunk(self.runner, request_id)
        with pytest.raises(StateError, match="closed"):
            self.gateway.receive(chunk(request_id, 0))

    @invariant()
    def sides_agree(self) -> None:
        gateway_ids = self._gateway_ids()
        runner_ids = set(self.runner.in_flight)
        assert self.gateway.in_flight == len(gateway_ids)
        if self.closed:
            assert gateway_ids == runner_ids == set()
            return
        starting = {f.request_id for _, f in self.to_runner if isinstance(f, Generate)}
        ending = {
            f.request_id
            for _, f in self.to_gateway
            if (isinstance(f, Chunk) and f.finish_reason is not None)
            or (isinstance(f, Error) and f.request_id is not None)
        }
        # A request the gateway counts is running on the runner, or its Generate or its
        # end is on the wire; never two of these at once.
        assert gateway_ids == runner_ids | starting | ending
        assert len(gateway_ids) == len(runner_ids) + len(starting) + len(ending)
        assert len(runner_ids) <= len(gateway_ids) <= MAX_CONCURRENT
        cancelled = {rid for rid in runner_ids if self.runner.is_cancelled(rid)}
        # The runner only knows of cancels the gateway sent, and once the pipes are empty
        # it knows of all of them.
        assert cancelled <= self.cancel_sent
        if not self.to_runner and not self.to_gateway:
            assert gateway_ids == runner_ids
            assert cancelled == self.cancel_sent & runner_ids


Link.TestCase.settings = settings(max_examples=200, stateful_step_count=50)
TestLink = Link.TestCase


# --- drain ------------------------------------------------------------------------------------


def test_runner_drain_refuses_generate_with_an_error() -> None:
    session = open_runner()
    session.receive(generate("a"))
    assert session.drain() == Drain()
    assert session.state is State.DRAINING
    refusal = session.receive(generate("b"))
    assert refusal == Error("b", "over_capacity", "runner is draining")
    assert session.in_flight == ["a"]
    # In-flight work still streams out normally.
    assert session.chunk("a", text="t", reasoning="", tokens=1, usage=Usage(1, 1)).seq == 0
    with pytest.raises(StateError):
        session.drain()
