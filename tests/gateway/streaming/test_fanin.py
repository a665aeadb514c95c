"""The merge of a text completion's prompts into one stream (no sockets, no runner)."""

from __future__ import annotations

import attrs

from gateway.errors import RunnerLost
from gateway.streaming.fanin import FanIn
from gateway.streaming.request_stream import Failed, RequestStream
from protocol.frames import (
    Chunk,
    Echo,
    Error,
    FinishReason,
    Generate,
    GenerationStats,
    TokenLogprob,
    Usage,
)


def part(k: int) -> RequestStream:
    return RequestStream(Generate(f"cmpl-1-{k}", "m", (), prompt=f"p{k}", n=2))


def chunk(
    k: int,
    seq: int,
    text: str,
    index: int,
    *,
    usage: Usage,
    finish: FinishReason | None = None,
    choice_finish: FinishReason | None = None,
    echo: Echo | None = None,
) -> Chunk:
    return Chunk(
        f"cmpl-1-{k}",
        seq,
        text,
        "",
        1,
        usage,
        finish,
        None,
        index=index,
        choice_finish=choice_finish,
        echo=echo,
    )


class Cancels:
    def __init__(self) -> None:
        self.streams: list[str] = []

    def __call__(self, stream: RequestStream) -> None:
        stream.cancelled = True
        self.streams.append(stream.request_id)


def drain(stream: RequestStream) -> list[object]:
    items: list[object] = []
    while (item := stream.get_nowait()) is not None:
        items.append(item)
    return items


def test_choices_are_numbered_per_prompt_and_usage_is_summed() -> None:
    parts = [part(0), part(1)]
    # Prompt 0 answered before the merge began: it comes first.
    echo = Echo("p0")
    parts[0].push(chunk(0, 0, "a", 1, usage=Usage(3, 1), echo=echo))
    cancels = Cancels()
    fan_in = FanIn("cmpl-1", parts, 2, cancels)
    assert fan_in.stream.request_id == "cmpl-1"
    parts[1].push(chunk(1, 0, "b", 0, usage=Usage(4, 1)))
    parts[1].push(chunk(1, 1, "c", 1, usage=Usage(4, 2), choice_finish="length"))
    parts[1].push(chunk(1, 2, "d", 0, usage=Usage(4, 3), finish="stop"))
    assert not fan_in.stream.done
    parts[0].push(chunk(0, 1, "e", 0, usage=Usage(3, 2), finish="length"))
    assert fan_in.stream.done
    got = drain(fan_in.stream)
    assert all(isinstance(item, Chunk) for item in got)
    seen = [
        (c.text, c.index, c.usage, c.choice_finish, c.finish_reason, c.echo)
        for c in got
        if isinstance(c, Chunk)
    ]
    assert seen == [
        ("a", 1, Usage(3, 1), None, None, echo),
        ("b", 2, Usage(7, 2), None, None, None),
        ("c", 3, Usage(7, 3), "length", None, None),
        # Prompt 1 ends while prompt 0 goes on: its last choice ends, not the request.
        ("d", 2, Usage(7, 4), "stop", None, None),
        ("e", 0, Usage(7, 5), None, "length", None),
    ]
    assert cancels.streams == []


def test_an_error_fails_the_whole_and_cancels_the_others() -> None:
    parts = [part(0), part(1), part(2)]
    cancels = Cancels()
    fan_in = FanIn("cmpl-1", parts, 2, cancels)
    parts[0].push(chunk(0, 0, "a", 0, usage=Usage(3, 1)))
    parts[2].push(chunk(2, 0, "x", 0, usage=Usage(3, 1), finish="stop"))  # prompt 2 is over
    parts[1].push(Error("cmpl-1-1", "invalid_request", "token 99999 is outside", "prompt"))
    assert fan_in.stream.done
    assert cancels.streams == ["cmpl-1-0"]
    # What the cancelled prompt still sends goes nowhere.
    parts[0].push(chunk(0, 1, "b", 0, usage=Usage(3, 2), finish="cancelled"))
    got = drain(fan_in.stream)
    assert [type(item) for item in got] == [Chunk, Chunk, Error]
    error = got[-1]
    assert isinstance(error, Error)
    assert error.param == "prompt[1]"  # the prompt at fault


def test_a_gateway_failure_fails_the_whole() -> None:
    parts = [part(0), part(1)]
    fan_in = FanIn("cmpl-1", parts, 1, Cancels())
    failed = Failed(RunnerLost("r"))
    parts[1].push(failed)
    assert drain(fan_in.stream) == [failed]


def test_cancel_stops_every_prompt_still_running() -> None:
    parts = [part(0), part(1)]
    cancels = Cancels()
    fan_in = FanIn("cmpl-1", parts, 1, cancels)
    parts[0].push(chunk(0, 0, "a", 0, usage=Usage(3, 1), finish="stop"))
    fan_in.cancel(fan_in.stream)
    assert fan_in.stream.cancelled
    assert cancels.streams == ["cmpl-1-1"]
    parts[1].push(chunk(1, 0, "", 0, usage=Usage(3, 0), finish="cancelled"))
    last = drain(fan_in.stream)[-1]
    assert isinstance(last, Chunk)
    assert (last.finish_reason, last.usage) == ("cancelled", Usage(6, 1))


def test_a_prompts_chunk_keeps_every_field_but_its_place_and_the_usage() -> None:
    """Each prompt's chunks go on as they came (a stop string, logprobs, tool calls: every
    field), only renumbered, with the summed usage and the request's finish."""
    parts = [part(0), part(1)]
    fan_in = FanIn("cmpl-1", parts, 2, Cancels())
    stats = GenerationStats(1.0, 2.0, 3, 0.5)
    ended = attrs.evolve(
        chunk(1, 0, "x END", 1, usage=Usage(4, 2), finish="stop"),
        stats=stats,
        matched_stop="END",
        logprobs=(TokenLogprob("x", -0.5, ()),),
    )
    parts[1].push(ended)
    parts[0].push(attrs.evolve(ended, request_id="cmpl-1-0", matched_stop="STOP"))
    first, second = drain(fan_in.stream)
    assert first == attrs.evolve(
        ended, index=3, usage=Usage(4, 2), finish_reason=None, stats=None, choice_finish="stop"
    )
    assert second == attrs.evolve(
        ended, request_id="cmpl-1-0", index=1, usage=Usage(8, 4), matched_stop="STOP"
    )
