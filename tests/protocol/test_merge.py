"""protocol.merge: the outputs of a request that piled up, one per choice, with no event loop."""

from __future__ import annotations

import attrs

from protocol.frames import Chunk, Echo, GenerationStats, TokenLogprob, ToolCallDelta, Usage
from protocol.merge import JOINED, merge


def test_nothing_merges_to_nothing() -> None:
    assert merge([]) == []


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


def test_the_choice_that_ends_the_request_comes_last() -> None:
    chunks = [
        Chunk("r", 0, "a", "", 1, Usage(1, 1), index=1),
        Chunk("r", 1, "b", "", 1, Usage(1, 2), index=0),
        Chunk("r", 2, "c", "", 1, Usage(1, 3), index=1, finish_reason="stop"),
    ]
    assert [(c.index, c.text) for c in merge(chunks)] == [(0, "b"), (1, "ac")]


def test_merging_joins_echo_pieces() -> None:
    """The pieces of a long prompt's echo, queued for a slow client, merge into one."""
    first, second = Echo("Hel"), Echo("lo")
    chunks = [
        Chunk("r", 0, "", "", 0, Usage(1, 0), echo=first),
        Chunk("r", 1, "a", "", 1, Usage(1, 1), echo=second),
    ]
    (merged,) = merge(chunks)
    assert (merged.text, merged.echo) == ("a", Echo("Hello"))


def test_echo_pieces_stay_apart_when_asked() -> None:
    """Merged, the pieces of a long prompt's echo would make one frame as large as it: with
    `echo_apart` (the runner's merge) each piece is merged with what follows it only."""
    chunks = [
        Chunk("r", 0, "", "", 0, Usage(1, 0), echo=Echo("a")),
        Chunk("r", 1, "", "", 0, Usage(1, 0), echo=Echo("b")),
        Chunk("r", 2, "x", "", 1, Usage(1, 1)),
        Chunk("r", 3, "y", "", 1, Usage(1, 2)),
    ]
    merged = merge(chunks, echo_apart=True)
    assert [(c.echo, c.text, c.seq) for c in merged] == [(Echo("a"), "", 0), (Echo("b"), "xy", 3)]


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
    joined = {"text", "reasoning", "tokens", "tool_calls", "logprobs", "echo"}
    assert joined == JOINED
    for merged in (merge([first, last])[0], merge([first, last], echo_apart=True)[0]):
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
