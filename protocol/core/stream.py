"""What a client sees of one completion, in any dialect, decided in one place. No I/O.

`CompletionStream` is fed one request's items as they come (the runner's chunks, an error, a
cancel) and appends the messages to send. It owns the order of a streamed completion:

    role chunk      delta {"role": "assistant", "content": "", "refusal": null}, once, first
    delta chunks    delta {"reasoning_content"?, "content"?, "tool_calls"?}, only the non-empty
                    keys; with the logprobs of the tokens they cover (requests asking for them)
    finish chunk    delta {}, finish_reason ("cancelled" is sent as "stop")
    usage chunk     choices [] and the whole request's usage (include_usage only)

With `n` choices, every chunk has one choice, its `index` says which: the role chunks of all
choices come first, then their deltas as they are generated, each choice's finish chunk when
it ends, and the usage chunk and the end after the last.
    end             `data: [DONE]` over SSE; `done` on the browser socket

or, at any point, an error and then the end. A request that ends before its first chunk (an
error, a cancel while it waited for a runner) sends no chunk at all: no role chunk without a
runner's answer, unless the transport commits to a stream early (`start`, SSE after
`first_token_wait`).

Transports differ only in framing (`Framing`): how a chunk object, an error and the end are
wrapped. OpenAI's SSE is `protocol.openai.sse.SSE`; the browser socket's is
`protocol.browser.framing`. New kinds of delta (tool calls, logprobs, several choices) are
rendered here, once, for every transport.

Dialects differ only in the objects (`ChoiceWriter`): a chat.completion.chunk
(`protocol.openai.chat.response.ChunkWriter`), a legacy text_completion
(`protocol.openai.completions.TextCompletionWriter`), ... The order above, the errors, the
cancel and the usage are this module's, whatever the dialect; a dialect without an opening
chunk per choice (text completions) renders none.

`CompletionBuilder` is the non-streaming twin: fed the same items, it collects each choice,
from which each dialect builds its body (`protocol.openai.chat.response.chat_completion_body`, ...).
"""

from __future__ import annotations

from typing import Protocol

import attrs

from protocol.core.errors import ApiError, runner_error, server_error
from protocol.frames import Chunk, Echo, Error, FinishReason, TokenLogprob, ToolCallDelta, Usage

Item = Chunk | Error | ApiError
"""What a completion stream is fed: a runner's chunk or error frame, or an error the gateway
decided (runner lost, timeout) already as an `ApiError`."""

ZERO_USAGE = Usage(0, 0)


class ChoiceWriter(Protocol):
    """Renders one request's streamed objects in one dialect, each framed as the transport
    says; `CompletionStream` decides which to send and when."""

    @property
    def include_usage(self) -> bool:
        """The request asked for the usage chunk (stream_options.include_usage)."""

    def role(self, usage: Usage | None, index: int) -> bytes:
        """A choice's opening chunk (the chat's assistant role); b"": the dialect has none."""

    def chunk(self, chunk: Chunk) -> bytes:
        """What a runner's chunk shows of its choice (`chunk.index`); b"": nothing."""

    def finish(self, reason: FinishReason, usage: Usage, index: int) -> bytes:
        """A choice's last chunk, with its finish_reason."""

    def usage_chunk(self, usage: Usage) -> bytes:
        """The chunk with the whole request's usage, after the last finish chunk; b"" unless
        the request asked for it."""


class Framing(Protocol):
    """How one transport wraps a completion's messages."""

    @property
    def chunk_prefix(self) -> bytes:
        """Bytes before each `chat.completion.chunk` object."""

    @property
    def chunk_suffix(self) -> bytes:
        """Bytes after each chunk object."""

    def error(self, err: ApiError) -> bytes:
        """The message that ends a request with an error."""

    def end(self, finish_reason: FinishReason | None, usage: Usage | None) -> bytes:
        """The last message of a request: after its last chunk (`finish_reason` set, with the
        whole request's usage), or after an error (both None). Empty bytes: nothing to send."""


def _error_of(item: Item) -> ApiError:
    """An item that is not a chunk, as the error it means."""
    if isinstance(item, Error):
        return runner_error(item)
    assert isinstance(item, ApiError)
    return item


class CompletionStream:
    """The messages of one streamed completion, in order (see the module docstring).

    `feed` and `cancel` append to `out` and return True once the request is over; after
    that nothing more is appended whatever is fed.
    """

    __slots__ = ("_framing", "_open", "_usage", "_writer", "over", "started")

    def __init__(self, writer: ChoiceWriter, framing: Framing, *, n: int = 1) -> None:
        """`writer`: the dialect's objects, made by the dialect for this request (framed as
        `framing` frames chunks); `framing`: the transport's; `n`: the request's choices."""
        self._framing = framing
        self._open = list(range(n))
        """Choices not finished yet."""
        self._writer = writer
        self._usage: Usage | None = None
        """The usage of the last chunk seen."""
        self.started = False
        """The role chunk has been sent."""
        self.over = False
        """The end has been sent."""

    @property
    def include_usage(self) -> bool:
        return self._writer.include_usage

    def start(self, out: list[bytes], usage: Usage | None = None) -> None:
        """Send the role chunk now (if not yet sent). With continuous_usage_stats it carries
        `usage`, else `"usage": null`."""
        if self.started or self.over:
            return
        self.started = True
        for index in self._open:
            role = self._writer.role(usage, index)
            if role:
                out.append(role)

    def feed(self, item: Item, out: list[bytes]) -> bool:
        """The messages for one item; True when the request is over."""
        if self.over:
            return True
        if type(item) is Chunk:
            writer = self._writer
            usage = item.usage
            if not self.started:
                self.start(out, Usage(usage.prompt_tokens, 0, usage.cached_tokens, 0))
            self._usage = usage
            index = item.index
            rendered = writer.chunk(item)
            if rendered:
                out.append(rendered)
            if item.choice_finish is not None and index in self._open:
                self._open.remove(index)
                out.append(writer.finish(item.choice_finish, usage, index))
            if item.finish_reason is None:
                return False
            self._finish(item.finish_reason, usage, out, index)
            return True
        return self.fail(_error_of(item), out)

    def fail(self, err: ApiError, out: list[bytes]) -> bool:
        """End the request with `err` (nothing if it is already over)."""
        if self.over:
            return True
        self.over = True
        out.append(self._framing.error(err))
        end = self._framing.end(None, None)
        if end:
            out.append(end)
        return True

    def cancel(self, out: list[bytes]) -> bool:
        """End a request that was stopped without the runner's final chunk (it never reached
        a runner, or is being abandoned): a started stream gets its finish chunk with the
        usage so far; one that never started only its end, with zero usage."""
        if self.over:
            return True
        if not self.started:
            self.over = True
            end = self._framing.end("cancelled", ZERO_USAGE)
            if end:
                out.append(end)
            return True
        self._finish("cancelled", self._usage or ZERO_USAGE, out)
        return True

    def _finish(
        self, reason: FinishReason, usage: Usage, out: list[bytes], last: int | None = None
    ) -> None:
        """The finish chunks of the open choices (`last` with `reason`, any other one, which
        only a cancel leaves open, "cancelled"), the usage chunk and the end."""
        self.over = True
        writer = self._writer
        for index in self._open:
            out.append(
                writer.finish(reason if last in (None, index) else "cancelled", usage, index)
            )
        self._open = []
        if writer.include_usage:
            out.append(writer.usage_chunk(usage))
        end = self._framing.end(reason, usage)
        if end:
            out.append(end)


class CompletionBuilder:
    """The non-streaming response: fed the same items as `CompletionStream`, it collects the
    text of each choice (`result`), from which the dialect builds its body."""

    __slots__ = ("_choices", "error", "last", "over", "wants_logprobs")

    def __init__(self, *, logprobs: bool = False, n: int = 1) -> None:
        self._choices = [CollectedChoice() for _ in range(n)]
        self.wants_logprobs = logprobs
        self.last: Chunk | None = None
        self.error: ApiError | None = None
        self.over = False

    def feed(self, item: Item) -> bool:
        """Take one item; True when the request is over."""
        if self.over:
            return True
        if type(item) is Chunk:
            if not 0 <= item.index < len(self._choices):
                self.error = server_error(f"The runner sent a chunk for choice {item.index}.")
                self.over = True
                return True
            choice = self._choices[item.index]
            choice.content.append(item.text)
            choice.reasoning.append(item.reasoning)
            choice.tool_calls.extend(item.tool_calls)
            choice.logprobs.extend(item.logprobs)
            if item.echo is not None:  # the prompt, in one or more pieces
                echo = choice.echo
                choice.echo = (
                    item.echo
                    if echo is None
                    else Echo(echo.text + item.echo.text, echo.tokens + item.echo.tokens)
                )
            choice.finish = item.choice_finish or item.finish_reason
            if item.matched_stop is not None:
                choice.matched_stop = item.matched_stop
            self.last = item
            self.over = item.finish_reason is not None
            return self.over
        self.error = _error_of(item)
        self.over = True
        return True

    def result(self) -> tuple[list[CollectedChoice], Usage]:
        """What was collected of each choice, and the whole request's usage; raises the
        request's error if it failed (or never finished). Each dialect builds its body
        from it."""
        if self.error is not None:
            raise self.error
        last = self.last
        if last is None or last.finish_reason is None:
            raise server_error("The request ended without an answer.")
        return self._choices, last.usage


@attrs.define
class CollectedChoice:
    """What a non-streaming response collects of one choice."""

    content: list[str] = attrs.Factory(list)
    reasoning: list[str] = attrs.Factory(list)
    tool_calls: list[ToolCallDelta] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)
    finish: FinishReason | None = None
    echo: Echo | None = None
    """The prompt the runner sent back (requests with echo)."""
    matched_stop: str | None = None
    """The stop string that ended the choice, if one did."""
