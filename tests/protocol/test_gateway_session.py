"""The gateway's side of a runner connection (GatewaySession), driven with frames and no event
loop: the handshake, what each frame means for the requests it carries, slots, drain,
failover before the first token, and the counters `/v1/runners` shows."""

from __future__ import annotations

from typing import get_args

import pytest

from protocol.closecodes import CloseCode
from protocol.errors import ProtocolError, StateError
from protocol.frames import (
    PROTOCOL_VERSION,
    Batch,
    Cancel,
    Chunk,
    Download,
    Drain,
    Error,
    FinishReason,
    Heartbeat,
    Hello,
    ModelInfo,
    ModelStatus,
    RunnerFrame,
    Usage,
)
from protocol.session import (
    Delivered,
    Draining,
    GatewaySession,
    Lost,
    ModelChanged,
    RequestFailed,
    RunnerFailed,
    State,
    Unstarted,
)
from tests.protocol.sessions import chunk, generate, make_hello


def open_gateway(max_concurrent: int = 2) -> GatewaySession[str]:
    session: GatewaySession[str] = GatewaySession()
    assert session.receive(make_hello(max_concurrent=max_concurrent)) == []
    return session


def with_requests(*request_ids: str, max_concurrent: int = 4) -> GatewaySession[str]:
    """An open session carrying these requests; each one's handle is "h-" + its id."""
    session = open_gateway(max_concurrent)
    for request_id in request_ids:
        session.assign(generate(request_id), f"h-{request_id}")
    return session


# --- the handshake ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        chunk("r", 0),
        Error("r", "internal_error", "x"),
        Error(None, "internal_error", "x"),
        Heartbeat(1.0),
        Drain(),
        Batch(()),
    ],
    ids=["chunk", "error", "connection-error", "heartbeat", "drain", "batch"],
)
def test_refuses_anything_before_hello(frame: RunnerFrame) -> None:
    session: GatewaySession[str] = GatewaySession()
    with pytest.raises(StateError, match="expected hello first") as info:
        session.receive(frame)
    assert info.value.close_code is CloseCode.ILLEGAL_STATE
    assert session.state is State.AWAIT_HELLO
    assert session.hello is None


def test_refuses_to_send_before_hello() -> None:
    session: GatewaySession[str] = GatewaySession()
    with pytest.raises(StateError, match="not taking requests"):
        session.assign(generate("r"), "h")
    assert session.cancel("r") is None
    assert session.free == 0
    assert not session.accepting


def test_accepts_hello() -> None:
    session: GatewaySession[str] = GatewaySession()
    hello = make_hello(models=("m1", "m2"), max_concurrent=3)
    assert session.receive(hello) == []
    assert session.state is State.OPEN
    assert session.hello is hello
    assert session.models == frozenset({"m1", "m2"})
    assert (session.in_flight, session.free, session.accepting) == (0, 3, True)


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1])
def test_refuses_other_protocol_versions(version: int) -> None:
    session: GatewaySession[str] = GatewaySession()
    with pytest.raises(ProtocolError, match="protocol version") as info:
        session.receive(make_hello(protocol_version=version))
    assert type(info.value) is ProtocolError
    assert info.value.close_code is CloseCode.UNSUPPORTED_VERSION
    assert session.state is State.AWAIT_HELLO


@pytest.mark.parametrize(
    ("hello", "match"),
    [
        (make_hello(models=()), "no models"),
        (make_hello(max_concurrent=0), "max_concurrent"),
        (make_hello(max_concurrent=-1), "max_concurrent"),
        (make_hello(models=("m1", "m1")), "model twice"),
    ],
    ids=["no-models", "zero-capacity", "negative-capacity", "duplicate-model"],
)
def test_refuses_unusable_hello(hello: Hello, match: str) -> None:
    session: GatewaySession[str] = GatewaySession()
    with pytest.raises(ProtocolError, match=match) as err:
        session.receive(hello)
    assert err.value.close_code == CloseCode.PROTOCOL_ERROR  # an invalid hello, not a bad state
    assert session.state is State.AWAIT_HELLO


def test_refuses_second_hello() -> None:
    session = open_gateway()
    with pytest.raises(StateError, match="hello sent twice"):
        session.receive(make_hello())


# --- chunks ----------------------------------------------------------------------------------


def test_chunks_are_delivered_to_their_request_in_order() -> None:
    session = with_requests("r")
    frames = [chunk("r", seq) for seq in range(3)]
    for frame in frames:
        assert session.receive(frame) == [Delivered("h-r", frame)]
    assert session.is_in_flight("r")
    final = chunk("r", 3, "stop")
    assert session.receive(final) == [Delivered("h-r", final)]
    assert not session.is_in_flight("r")
    assert (session.in_flight, session.free) == (0, 4)


def test_refuses_chunk_for_unknown_request() -> None:
    session = with_requests("known")
    with pytest.raises(StateError, match="'other' not in flight") as info:
        session.receive(chunk("other", 0))
    assert info.value.close_code is CloseCode.ILLEGAL_STATE


@pytest.mark.parametrize(
    ("seqs", "bad"),
    [((), 1), ((0,), 2), ((0,), 0), ((0, 1), 0), ((0, 1), 1), ((), -1)],
    ids=["first-not-zero", "gap", "repeat-first", "rewind", "repeat", "negative"],
)
def test_refuses_seq_gaps_and_repeats(seqs: tuple[int, ...], bad: int) -> None:
    session = with_requests("r")
    for seq in seqs:
        session.receive(chunk("r", seq))
    with pytest.raises(StateError, match=f"chunk seq {bad} for 'r', expected {len(seqs)}"):
        session.receive(chunk("r", bad))


def test_numbers_each_request_separately() -> None:
    session = with_requests("a", "b")
    session.receive(chunk("a", 0))
    session.receive(chunk("a", 1))
    session.receive(chunk("b", 0))
    with pytest.raises(StateError):
        session.receive(chunk("b", 2))


@pytest.mark.parametrize("finish_reason", get_args(FinishReason))
def test_refuses_anything_after_final_chunk(finish_reason: FinishReason) -> None:
    session = with_requests("r")
    session.receive(chunk("r", 0))
    session.receive(chunk("r", 1, finish_reason))
    for late in (
        chunk("r", 2),
        chunk("r", 2, "stop"),
        chunk("r", 0),
        Error("r", "internal_error", "x"),
    ):
        with pytest.raises(StateError, match="not in flight"):
            session.receive(late)


def test_every_chunk_of_a_batch_is_checked_and_delivered() -> None:
    session = with_requests("a", "b")
    frames = (
        Chunk("a", 0, "x", "", 1, Usage(1, 1)),
        Chunk("b", 0, "y", "", 1, Usage(1, 1)),
        Chunk("a", 1, "z", "", 1, Usage(1, 2), "stop"),
    )
    assert session.receive(Batch(frames)) == [
        Delivered("h-a", frames[0]),
        Delivered("h-b", frames[1]),
        Delivered("h-a", frames[2]),
    ]
    assert session.in_flight == 1  # "a" ended inside the batch
    with pytest.raises(StateError, match="not in flight"):
        session.receive(Batch((Chunk("a", 2, "late", "", 1, Usage(1, 3)),)))
    with pytest.raises(StateError, match="seq 5"):
        with_requests("c").receive(Batch((Chunk("c", 5, "gap", "", 1, Usage(1, 1)),)))


# --- errors ----------------------------------------------------------------------------------


def test_an_error_after_the_first_chunk_fails_the_request() -> None:
    session = with_requests("r")
    session.receive(chunk("r", 0))
    error = Error("r", "over_capacity", "busy after all")
    assert session.receive(error) == [RequestFailed("h-r", error)]
    assert not session.is_in_flight("r")
    with pytest.raises(StateError):
        session.receive(chunk("r", 1))
    with pytest.raises(StateError):
        session.receive(Error("r", "internal_error", "again"))


@pytest.mark.parametrize(
    "code", ["invalid_request", "context_length_exceeded", "model_not_found", "internal_error"]
)
def test_an_error_before_the_first_chunk_fails_the_request(code: str) -> None:
    session = with_requests("r")
    error = Error("r", code, "no")  # type: ignore[arg-type]  # each ErrorCode in turn
    assert session.receive(error) == [RequestFailed("h-r", error)]
    assert session.free == 4


def test_a_refusal_before_the_first_chunk_leaves_the_request_unstarted() -> None:
    """over_capacity before any token: the runner never ran it; it may run elsewhere."""
    session = with_requests("r")
    assert session.receive(Error("r", "over_capacity", "runner is draining")) == [
        Unstarted("h-r", "runner is draining")
    ]
    assert not session.is_in_flight("r")


def test_refuses_error_for_unknown_request() -> None:
    session = open_gateway()
    with pytest.raises(StateError, match="'r' not in flight"):
        session.receive(Error("r", "internal_error", "x"))


def test_an_error_without_request_is_the_runner_giving_up() -> None:
    session = with_requests("r")
    assert session.receive(Error(None, "internal_error", "engine down")) == [
        RunnerFailed("engine down")
    ]
    assert session.is_in_flight("r")  # its fate is decided when the link closes
    assert session.close() == [Unstarted("h-r", "runner lost")]


# --- slots, cancel, drain --------------------------------------------------------------------


def test_assign_records_the_request_and_takes_a_slot() -> None:
    session = open_gateway(max_concurrent=2)
    frame = generate("r", "m2")
    assert session.assign(frame, "h") is frame
    assert session.is_in_flight("r")
    assert (session.in_flight, session.free) == (1, 1)
    assert session.handles() == ["h"]


def test_assign_refuses_duplicate() -> None:
    session = with_requests("r")
    with pytest.raises(StateError, match="'r' already in flight"):
        session.assign(generate("r", "m2"), "again")
    assert session.in_flight == 1


def test_assign_refuses_over_capacity() -> None:
    session = with_requests("a", "b", max_concurrent=2)
    assert session.free == 0
    with pytest.raises(StateError, match="at capacity"):
        session.assign(generate("c"), "h-c")
    assert not session.is_in_flight("c")
    # A finished request frees its slot, and its id may be used again.
    session.receive(chunk("a", 0, "length"))
    session.assign(generate("c"), "h-c")
    session.receive(Error("b", "internal_error", "x"))
    session.assign(generate("a"), "h-a2")
    first = chunk("a", 0)
    assert session.receive(first) == [Delivered("h-a2", first)]


def test_assign_refuses_unknown_model() -> None:
    session = open_gateway()
    with pytest.raises(StateError, match="does not serve 'other'"):
        session.assign(generate("r", "other"), "h")
    assert session.in_flight == 0


def test_cancel() -> None:
    session = open_gateway()
    assert session.cancel("never") is None
    session.assign(generate("r"), "h")
    assert session.cancel("r") == Cancel("r")
    assert session.cancel("r") is None
    # Until the runner's last chunk arrives the request is still running.
    assert session.is_in_flight("r")
    session.receive(chunk("r", 0))
    session.receive(chunk("r", 1, "cancelled"))
    assert session.cancel("r") is None


def test_cancel_after_error() -> None:
    session = with_requests("r")
    session.receive(Error("r", "internal_error", "x"))
    assert session.cancel("r") is None


def test_drain_refuses_new_requests_but_finishes_old_ones() -> None:
    session = with_requests("a")
    assert session.receive(Drain("restarting")) == [Draining("restarting")]
    assert session.state is State.DRAINING
    assert (session.accepting, session.free) == (False, 0)
    with pytest.raises(StateError, match="draining"):
        session.assign(generate("b"), "h-b")
    assert session.cancel("a") == Cancel("a")
    final = Chunk("a", 0, "x", "", 1, Usage(1, 1), "cancelled")
    assert session.receive(final) == [Delivered("h-a", final)]
    assert session.in_flight == 0


def test_a_generate_crossing_the_drain_is_refused_and_unstarted() -> None:
    session = with_requests("a")
    session.receive(Drain())
    assert session.receive(Error("a", "over_capacity", "runner is draining")) == [
        Unstarted("h-a", "runner is draining")
    ]


# --- counters --------------------------------------------------------------------------------


def test_counters() -> None:
    session = with_requests("a", "b")
    session.receive(Chunk("a", 0, "xy", "", 2, Usage(1, 2)))
    session.cancel("a")
    session.receive(Chunk("a", 1, "z", "", 3, Usage(1, 5), "cancelled"))
    session.receive(Chunk("b", 0, "w", "", 1, Usage(1, 1)))
    session.receive(Error("b", "internal_error", "x"))
    assert session.tokens_generated == 6
    assert session.tokens_after_cancel == 3
    assert session.requests_served == 1  # an error is not a request served
    assert (session.kv_bytes, session.kv_limit_bytes) == (None, None)
    assert session.receive(Heartbeat(1.0, kv_bytes=10, kv_limit_bytes=20)) == []
    assert (session.kv_bytes, session.kv_limit_bytes) == (10, 20)


# --- close -----------------------------------------------------------------------------------


def test_close_says_which_requests_may_move() -> None:
    session = with_requests("a", "b", "c", "d")
    session.receive(chunk("b", 0, "stop"))
    session.receive(chunk("c", 0))
    session.cancel("d")
    assert session.close() == [
        Unstarted("h-a", "runner lost"),
        Lost("h-c"),
        Unstarted("h-d", "runner lost"),
    ]
    assert session.state is State.CLOSED
    assert (session.in_flight, session.free, session.accepting) == (0, 0, False)
    assert not session.is_in_flight("a")
    for frame in (chunk("a", 0), Heartbeat(1.0), make_hello(), Error(None, "internal_error", "x")):
        with pytest.raises(StateError, match="closed"):
            session.receive(frame)
    with pytest.raises(StateError):
        session.assign(generate("e"), "h-e")
    assert session.cancel("a") is None
    assert session.close() == []


def test_close_before_hello() -> None:
    session: GatewaySession[str] = GatewaySession()
    assert session.close() == []
    with pytest.raises(StateError, match="closed"):
        session.receive(make_hello())


# --- model states ----------------------------------------------------------------------------


def test_model_infos_start_as_the_hello_lists_them() -> None:
    hello = Hello(
        PROTOCOL_VERSION,
        "runner-a",
        (ModelInfo("m1", 4096, size_bytes=10), ModelInfo("m2", None, state="loadable")),
        2,
        make_hello().hardware,
        memory_budget_bytes=100,
    )
    session: GatewaySession[str] = GatewaySession()
    assert session.receive(hello) == []
    assert session.model_infos == {
        "m1": ModelInfo("m1", 4096, size_bytes=10),
        "m2": ModelInfo("m2", None, state="loadable"),
    }
    assert session.models == frozenset({"m1", "m2"})


def test_a_model_status_replaces_what_the_gateway_knew_of_that_model() -> None:
    session = open_gateway()
    loading = ModelInfo("m2", None, state="loading", download=Download(5, 20))
    assert session.receive(ModelStatus(loading)) == [ModelChanged(loading, ModelInfo("m2", 4096))]
    assert session.model_infos["m2"] == loading
    assert session.model_infos["m1"] == ModelInfo("m1", 4096)
    loaded = ModelInfo("m2", 2048, "mlx", size_bytes=20)
    assert session.receive(ModelStatus(loaded)) == [ModelChanged(loaded, loading)]
    assert session.model_infos["m2"] == loaded
    # A status changes no slot and no request: the model is served throughout.
    assert session.free == 2
    assert session.models == frozenset({"m1", "m2"})


def test_a_model_status_while_draining_is_taken() -> None:
    session = open_gateway()
    session.receive(Drain())
    unloaded = ModelInfo("m1", 4096, state="loadable")
    assert session.receive(ModelStatus(unloaded)) == [ModelChanged(unloaded, ModelInfo("m1", 4096))]


def test_refuses_a_model_status_for_a_model_the_hello_did_not_list() -> None:
    session = open_gateway()
    with pytest.raises(StateError, match="model_status for 'm9', which the hello did not list"):
        session.receive(ModelStatus(ModelInfo("m9", 1)))
    assert "m9" not in session.model_infos
