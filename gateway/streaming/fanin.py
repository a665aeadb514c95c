"""Several runner requests seen as one: the prompts of one text completion.

A legacy completion with a list of prompts runs each prompt as its own request (its own
`RequestStream`, on whichever runner the pool picks). `FanIn` merges them into one stream
that the usual consumers read (a `Relay` for SSE, a `CompletionBuilder` otherwise), in the
order the chunks arrive:

- a chunk's choice becomes `prompt_index * n + choice`, as OpenAI numbers them;
- its usage is the sum of every prompt's usage so far;
- a prompt that ends while others go on ends its choice (`choice_finish`); the last one to
  end ends the merged request;
- an error of any prompt is the merged request's error: the other prompts are cancelled, and
  what they still send is dropped. A runner's error naming `prompt` names that one
  (`prompt[k]`).

Cancelling the merged stream (`cancel`, what its consumer is given in place of
`Pool.cancel`) cancels every prompt still running.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from gateway.streaming.request_stream import RequestStream, StreamItem
from protocol.frames import Chunk, Error, Usage


class FanIn:
    """Merges the streams of one request's prompts into `stream` (see the module docstring)."""

    __slots__ = ("_cancel", "_n", "_open", "_usages", "parts", "stream")

    def __init__(
        self,
        request_id: str,
        parts: list[RequestStream],
        n: int,
        cancel: Callable[[RequestStream], None],
    ) -> None:
        self.parts = parts
        self.stream = RequestStream(attrs.evolve(parts[0].generate, request_id=request_id))
        """The merged stream."""
        self._n = n
        self._cancel = cancel
        self._open = len(parts)
        self._usages = [Usage(0, 0)] * len(parts)
        for k, part in enumerate(parts):
            # What came before the merge began (the parts were submitted one by one) first.
            while (item := part.get_nowait()) is not None:
                self._on_item(k, item)
            part.sink = self._sink(k)

    def _sink(self, k: int) -> Callable[[StreamItem], bool]:
        def sink(item: StreamItem) -> bool:
            self._on_item(k, item)
            return True

        return sink

    def _on_item(self, k: int, item: StreamItem) -> None:
        if self.stream.done:
            return  # the merged request failed: the others' last words go nowhere
        if type(item) is Chunk:
            self._usages[k] = item.usage
            finish, choice_finish = item.finish_reason, item.choice_finish
            if finish is not None:
                self._open -= 1
                if self._open:
                    finish, choice_finish = None, finish
            # The part's chunk as a choice of the merged request; every other field (text,
            # matched_stop, ...) as it came.
            self.stream.push(
                attrs.evolve(
                    item,
                    usage=self._usage(),
                    finish_reason=finish,
                    stats=item.stats if finish is not None else None,
                    index=k * self._n + item.index,
                    choice_finish=choice_finish,
                )
            )
            return
        if isinstance(item, Error) and item.param == "prompt" and len(self.parts) > 1:
            item = attrs.evolve(item, param=f"prompt[{k}]")
        self.stream.push(item)
        self._stop_all()

    def _usage(self) -> Usage:
        usages = self._usages
        return Usage(
            sum(u.prompt_tokens for u in usages),
            sum(u.completion_tokens for u in usages),
            sum(u.cached_tokens for u in usages),
            sum(u.reasoning_tokens for u in usages),
        )

    def cancel(self, stream: RequestStream) -> None:
        """Stop the merged request: every prompt still running (`Pool.cancel`'s stand-in)."""
        stream.cancelled = True
        self._stop_all()

    def _stop_all(self) -> None:
        for part in self.parts:
            if not part.done and not part.cancelled:
                self._cancel(part)
