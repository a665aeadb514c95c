"""The per-request buffer between a runner link and a client handler (no sockets)."""

from __future__ import annotations

import attrs

from gateway.errors import RunnerLost
from gateway.streaming.request_stream import MAX_PENDING, Failed, RequestStream
from protocol.frames import (
    Chunk,
    Echo,
    Generate,
    GenerationStats,
    Message,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from protocol.merge import merge


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


def test_merging_keeps_each_choices_echo() -> None:
    """A choice's first chunk carries the prompt back (echo): merged with what follows, the
    merged chunk still does, once, whichever choice it belongs to."""
    echo = Echo("Hi")
    chunks = [
        Chunk("r", 0, "a", "", 1, Usage(1, 1), index=0, echo=echo),
        Chunk("r", 1, "b", "", 1, Usage(1, 2), index=1, echo=echo),
        Chunk("r", 2, "c", "", 1, Usage(1, 3), index=0),
        Chunk("r", 3, "d", "", 1, Usage(1, 4), index=1, finish_reason="length"),
    ]
    first, second = merge(chunks)
    assert (first.index, first.text, first.echo) == (0, "ac", echo)
    assert (second.index, second.text, second.echo, second.finish_reason) == (
        1,
        "bd",
        echo,
        "length",
    )
    assert merge(chunks[2:])[0].echo is None


def test_merging_joins_echo_pieces() -> None:
    """The pieces of a long prompt's echo, queued for a slow client, merge into one."""
    first, second = Echo("Hel"), Echo("lo")
    chunks = [
        Chunk("r", 0, "", "", 0, Usage(1, 0), echo=first),
        Chunk("r", 1, "a", "", 1, Usage(1, 1), echo=second),
    ]
    (merged,) = merge(chunks)
    assert (merged.text, merged.echo) == ("a", Echo("Hello"))


def test_a_merged_chunk_is_the_last_one_with_what_accumulates_joined() -> None:
    """Every field of the last chunk that does not accumulate (finish, stats, the stop string
    that ended it, choice, usage, seq: any added later too) is the merged chunk's."""
    stats = GenerationStats(1.0, 2.0, 3, 0.5)
    calls = (ToolCallDelta(0, "{", id="c", name="f"), ToolCallDelta(0, "}"))
    logprob = TokenLogprob("a", -0.5, ())
    first = Chunk("r", 0, "a", "r1", 1, Usage(5, 1), tool_calls=calls[:1], logprobs=(logprob,))
    last = Chunk(
        "r", 1, "b END", "r2", 2, Usage(5, 3), "stop", stats, calls[1:], (logprob,),
        choice_finish="stop", matched_stop="END",
    )  # fmt: skip
    (merged,) = merge([first, last])
    joined = {"text", "reasoning", "tokens", "tool_calls", "logprobs", "echo"}
    for field in attrs.fields(Chunk):
        if field.name not in joined:
            assert getattr(merged, field.name) == getattr(last, field.name), field.name
    assert (merged.text, merged.reasoning, merged.tokens) == ("ab END", "r1r2", 3)
    assert (merged.tool_calls, merged.logprobs) == (calls, (logprob, logprob))
    # Every field that is not joined differs between the two: the check above can fail.
    assert all(
        getattr(first, f.name) != getattr(last, f.name)
        for f in attrs.fields(Chunk)
        if f.name not in joined | {"request_id", "index", "echo"}
    )


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
