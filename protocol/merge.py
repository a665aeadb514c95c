"""Merging the outputs of one request that piled up: one per choice, strings joined once.

Used wherever outputs wait to be sent: the runner merges its engine's outputs before they
become chunks (`runner.client`), the gateway merges the chunks a slow reader has not taken
(`gateway.streaming.request_stream`). Both kinds (`protocol.frames.Chunk`,
`runner.engine.base.Output`) are frozen attrs classes with the fields of `Mergeable`. A merged item
is the last one of its run with what accumulates joined (text, reasoning, tokens, tool-call deltas,
logprobs, echo): every other field, and any field added to those classes later, is the last item's.

Pure: no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, cast

import attrs

from protocol.frames import Echo, FinishReason, TokenLogprob, ToolCallDelta

JOINED = frozenset({"text", "reasoning", "tokens", "tool_calls", "logprobs", "echo"})
"""The fields a merge joins; every other field is the last item's."""


class Mergeable(Protocol):
    """What a merge reads of an item (an attrs instance)."""

    @property
    def index(self) -> int:
        """The choice."""

    @property
    def text(self) -> str: ...

    @property
    def reasoning(self) -> str: ...

    @property
    def tokens(self) -> int: ...

    @property
    def finish_reason(self) -> FinishReason | None: ...

    @property
    def tool_calls(self) -> tuple[ToolCallDelta, ...]: ...

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]: ...

    @property
    def echo(self) -> Echo | None: ...


M = TypeVar("M", bound=Mergeable)


def merge(items: Sequence[M], *, echo_apart: bool = False) -> list[M]:
    """Consecutive items of one request as one per choice (joined once: no quadratic
    copying), the choice that ends the request (the last item's, when it has a
    finish_reason) last.

    With `echo_apart`, a choice's echo pieces stay apart, each merged with what follows it
    (merged together, they would make one frame as large as the prompt): a choice's items
    are cut before each one that carries an echo piece, and each run merges on its own."""
    if not items:
        return []
    by_choice: dict[int, list[M]] = {}
    for item in items:
        by_choice.setdefault(item.index, []).append(item)
    last = items[-1]
    ends = last.index if last.finish_reason is not None else -1
    order = sorted(by_choice, key=lambda i: i == ends)
    if not echo_apart:
        return [merge_run(by_choice[i]) for i in order]
    return [merge_run(run) for i in order for run in echo_runs(by_choice[i])]


def echo_runs(items: Sequence[M]) -> list[list[M]]:
    """A choice's items cut before each one that carries an echo piece."""
    runs: list[list[M]] = [[]]
    for item in items:
        if item.echo is not None and runs[-1]:
            runs.append([])
        runs[-1].append(item)
    return runs


def merge_run(items: Sequence[M]) -> M:
    """A run of items of one choice as one: the last item, with what accumulates joined."""
    if len(items) == 1:
        return items[0]
    last: Any = items[-1]  # an attrs instance: the protocol cannot say so to attrs.evolve
    merged = attrs.evolve(
        last,
        text="".join(i.text for i in items),
        reasoning="".join(i.reasoning for i in items),
        tokens=sum(i.tokens for i in items),
        tool_calls=tuple(delta for i in items for delta in i.tool_calls),
        logprobs=tuple(entry for i in items for entry in i.logprobs),
        echo=joined_echo(items),
    )
    return cast(M, merged)


def joined_echo(items: Sequence[Mergeable]) -> Echo | None:
    """The echo pieces of a run of items (a choice's first ones carry them), as one."""
    pieces = [item.echo for item in items if item.echo is not None]
    if len(pieces) <= 1:
        return pieces[0] if pieces else None
    return Echo("".join(p.text for p in pieces), tuple(t for p in pieces for t in p.tokens))
