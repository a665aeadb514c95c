"""The one way a finished answer is stored, streamed or not.

A dialect whose request asks to be kept (a chat `store: true`, a Responses `store`) gives the
endpoint a `keep` function: what to do with the answer's finished body, the object a
non-streamed request is answered with. The endpoint calls it with that body once the request
finished `keepable`. A streamed request's relay feeds each chunk it rendered to a `Keeper`,
which collects them as the non-streamed request would and calls the same `keep` at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.core.stream import CompletionBuilder
from protocol.frames import Chunk

Body = Callable[[CompletionBuilder], dict[str, Any]]
"""The finished answer's body, from the chunks collected."""
Keep = Callable[[dict[str, Any]], object]
"""Stores a finished answer's body."""


def keepable(builder: CompletionBuilder) -> bool:
    """True when the request the builder collected finished as OpenAI stores one: ended by
    its runner with stop, length or tool_calls (not failed, not cancelled)."""
    last = builder.last
    return (
        builder.error is None
        and last is not None
        and last.finish_reason is not None
        and last.finish_reason != "cancelled"
    )


class Keeper:
    """Stores a streamed answer when it finishes: the relay feeds it each chunk it renders."""

    __slots__ = ("body", "builder", "keep")

    def __init__(self, builder: CompletionBuilder, body: Body, keep: Keep) -> None:
        self.builder = builder
        self.body = body
        self.keep = keep

    def feed(self, chunk: Chunk) -> None:
        """A chunk the request's stream rendered; the last one stores the answer."""
        builder = self.builder
        if builder.feed(chunk) and keepable(builder):
            self.keep(self.body(builder))
