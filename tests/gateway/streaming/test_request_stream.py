"""The per-request buffer between a runner link and a client handler (no sockets)."""

from __future__ import annotations

from gateway.errors import RunnerLost
from gateway.streaming.request_stream import MAX_PENDING, Failed, RequestStream
from protocol.frames import (
    Chunk,
    Generate,
    Message,
    Usage,
)


def chunk(seq: int, final: bool = False) -> Chunk:
    return Chunk("r", seq, f"t{seq} ", "", 1, Usage(5, seq + 1), "length" if final else None)


def stream() -> RequestStream:
    return RequestStream(Generate("r", "m", (Message("user", "hi"),)))


async def test_a_slow_reader_gets_merged_chunks_and_nothing_lost() -> None:
    s = stream()
    total = MAX_PENDING + 1000
    for seq in range(total):
        s.push(chunk(seq, final=seq == total - 1))
    assert s.done
    assert s.merged == 1000
    items = [await s.get() for _ in range(MAX_PENDING + 1)]
    assert s.get_nowait() is None
    assert all(isinstance(i, Chunk) for i in items)
    text = "".join(i.text for i in items if isinstance(i, Chunk))
    assert text == "".join(f"t{n} " for n in range(total))
    last = items[-1]
    assert isinstance(last, Chunk)
    assert last.tokens == 1000
    assert last.finish_reason == "length"
    assert last.usage == Usage(5, total)


async def test_a_failure_after_overflow_stays_last() -> None:
    s = stream()
    for seq in range(MAX_PENDING + 3):
        s.push(chunk(seq))
    s.push(Failed(RunnerLost("x")))
    items = [await s.get() for _ in range(MAX_PENDING + 2)]
    assert isinstance(items[-2], Chunk)
    assert items[-2].tokens == 3
    assert isinstance(items[-1], Failed)
    assert s.get_nowait() is None


async def test_no_merging_while_the_reader_keeps_up() -> None:
    s = stream()
    for seq in range(3 * MAX_PENDING):
        s.push(chunk(seq))
        got = await s.get()
        assert isinstance(got, Chunk)
        assert got.seq == seq
    assert s.merged == 0


class Placed:
    """A stand-in for the pool's placement: says whether the model is loading."""

    def __init__(self) -> None:
        self.loading = False

    def model_loading(self) -> bool:
        return self.loading


class Meter:
    """A stand-in for the request's metrics: records what the stream tells it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, bool]] = []

    def chunk(self, chunk: Chunk, cancelled: bool) -> None:
        self.calls.append(("chunk", chunk.seq, cancelled))

    def fail(self, problem: object, cancelled: bool) -> None:
        self.calls.append(("fail", problem, cancelled))

    def end(self, outcome: str) -> None:
        self.calls.append(("end", outcome, False))


def test_whether_its_model_is_loading_is_its_placements_say() -> None:
    assert not stream().model_loading()  # no placement: nothing to wait for
    placed = Placed()
    s = RequestStream(Generate("r", "m", (Message("user", "hi"),)), placement=placed)
    assert not s.model_loading()
    placed.loading = True
    assert s.model_loading()


def test_its_meter_hears_each_chunk_and_a_failure_as_it_is_pushed() -> None:
    meter = Meter()
    s = RequestStream(Generate("r", "m", (Message("user", "hi"),)), meter)
    s.push(chunk(0))
    s.cancelled = True
    lost = RunnerLost("r1")
    s.push(Failed(lost))
    assert meter.calls == [("chunk", 0, False), ("fail", lost, True)]
    assert s.done
