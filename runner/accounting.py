"""Per-request text routing and token counting, as pure logic (no mlx), fed one token at a time.

An engine decodes each generated token to a text segment and feeds `(token_id, segment)` to a
`RequestAccounting`, which chains:

1. `ReasoningSplitter`: routes the segment to the visible content or to the reasoning stream,
   following the model's `<think>` ... `</think>` marker tokens, and counts reasoning tokens
   (for a model that writes OpenAI's Harmony format, `runner.harmony.HarmonySplitter` instead,
   which also takes its tool calls out);
2. `runner.tool_calls.ToolCallSplitter` (requests with tools): takes the model's tool calls
   out of the content, as tool-call deltas;
3. `StopMatcher`: applies the request's stop strings to the content (never to reasoning or
   tool calls), holding back text that may be the start of a stop string;

and keeps the `Usage` of the request up to date.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from protocol.frames import ToolCallDelta, Usage
from runner.harmony import HarmonySplitter
from runner.tool_calls import ToolCallSplitter


def prompt_opens_reasoning(
    prompt: Sequence[int], think_start_id: int | None, think_end_id: int | None
) -> bool:
    """Whether a templated prompt ends inside a think span (an unclosed `<think>`).

    Some chat templates (DeepSeek-R1, Qwen3 with thinking forced on) end the generation prompt
    with `<think>`: the model's first tokens are then reasoning, with no marker of their own.
    """
    if think_start_id is None or think_end_id is None:
        return False
    for token in reversed(prompt):
        if token == think_end_id:
            return False
        if token == think_start_id:
            return True
    return False


class ReasoningSplitter:
    """Splits generated text into content and reasoning by the think marker tokens.

    A think span runs from a `<think>` token to the next `</think>` token; generation starts
    inside one when the prompt left it open (`starts_in_reasoning`, see
    `prompt_opens_reasoning`). Rules:

    - `reasoning_tokens` counts the tokens inside a span *including* the `<think>` and
      `</think>` marker tokens that open and close it (a span opened by the prompt counts only
      its closing marker). Every other token is a content token.
    - Marker text is emitted in neither stream. A `</think>` outside any span closes nothing:
      it is not counted as reasoning, and its text is dropped too.
    - A marker token's segment may carry text the detokenizer held back from earlier tokens
      (e.g. a pending space): the text before the marker belongs to the state before it, the
      text after to the state after. mlx-lm's detokenizers flush a marker's text with the
      marker token itself; if a segment lacks the marker text it all goes to the earlier state.

    Without marker ids (`None`, the tokenizer has no single-token think markers) everything is
    content.
    """

    def __init__(
        self,
        think_start_id: int | None,
        think_end_id: int | None,
        *,
        think_start_text: str = "<think>",
        think_end_text: str = "</think>",
        starts_in_reasoning: bool = False,
    ) -> None:
        self._enabled = think_start_id is not None and think_end_id is not None
        self._start_id = think_start_id
        self._end_id = think_end_id
        self._start_text = think_start_text
        self._end_text = think_end_text
        self.in_reasoning = self._enabled and starts_in_reasoning
        self.reasoning_tokens = 0

    def feed(self, token_id: int, text: str) -> tuple[str, str]:
        """Route one token's text segment; returns `(content, reasoning)`."""
        if not self._enabled:
            return text, ""
        if token_id == self._start_id:
            before, after = _cut(text, self._start_text)
            was_reasoning = self.in_reasoning
            self.in_reasoning = True
            self.reasoning_tokens += 1
            if was_reasoning:
                return "", before + after
            return before, after
        if token_id == self._end_id:
            before, after = _cut(text, self._end_text)
            if not self.in_reasoning:
                return before + after, ""
            self.in_reasoning = False
            self.reasoning_tokens += 1
            return after, before
        if self.in_reasoning:
            self.reasoning_tokens += 1
            return "", text
        return text, ""


def _cut(text: str, marker: str) -> tuple[str, str]:
    """Text before and after the last occurrence of `marker` (all before when absent)."""
    index = text.rfind(marker)
    if index < 0:
        return text, ""
    return text[:index], text[index + len(marker) :]


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    `feed` returns the text that is safe to emit now: it holds back the longest suffix that
    could still grow into a stop string. When a stop string completes, `feed` returns the text
    before it and `stopped` becomes true; the stop string and anything after it are dropped
    (OpenAI semantics), and later calls return nothing. With several stop strings the one that
    completes first wins (the longer one on a tie), however the text was split into pieces:
    generation would have stopped there. `flush` returns the held-back text once generation ends for
    another reason.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that completed, once one has."""

    def feed(self, text: str) -> str:
        """Add text; return what can be emitted now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        # (end, start) of each stop's first occurrence: the stop that completes first wins,
        # as it would have had the text come a character at a time; on a tie, the longer one.
        hits = [
            (index + len(stop), index, stop)
            for stop in self._stops
            if (index := buffer.find(stop)) >= 0
        ]
        if hits:
            _, start, self.matched = min(hits)
            self.stopped = True
            self._held = ""
            return buffer[:start]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Return and forget the held-back text (nothing after a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = min(len(buffer), max(len(stop) for stop in self._stops) - 1)
        for size in range(longest, 0, -1):
            suffix = buffer[-size:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return size
        return 0


@attrs.frozen
class Piece:
    """What one fed token (or the final flush) adds to a request's output."""

    text: str
    reasoning: str
    stopped: bool = False
    """A stop string completed: this is the request's last piece."""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class RequestAccounting:
    """The text and usage bookkeeping of one request, one generated token at a time.

    `completion_tokens` counts every token fed, including an end-of-sequence token and the
    token that completes a stop string (as vLLM does); `reasoning_tokens` follows
    `ReasoningSplitter`. Stop strings apply to the content only.
    """

    def __init__(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int = 0,
        stop: Iterable[str] = (),
        think_start_id: int | None = None,
        think_end_id: int | None = None,
        think_start_text: str = "<think>",
        think_end_text: str = "</think>",
        starts_in_reasoning: bool = False,
        tool_calls: ToolCallSplitter | None = None,
        harmony: HarmonySplitter | None = None,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.completion_tokens = 0
        self._splitter = ReasoningSplitter(
            think_start_id,
            think_end_id,
            think_start_text=think_start_text,
            think_end_text=think_end_text,
            starts_in_reasoning=starts_in_reasoning,
        )
        self._matcher = StopMatcher(stop)
        self._tools = tool_calls
        self._harmony = harmony

    @property
    def tool_calls_made(self) -> int:
        """Tool calls the model has started so far."""
        if self._harmony is not None:
            return self._harmony.calls
        return 0 if self._tools is None else self._tools.calls

    @property
    def stopped(self) -> bool:
        """A stop string was hit; feed nothing more."""
        return self._matcher.stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that was hit, if one was."""
        return self._matcher.matched

    def feed(self, token_id: int, text: str) -> Piece:
        """Account for one generated token and its text segment."""
        self.completion_tokens += 1
        calls: tuple[ToolCallDelta, ...] = ()
        if self._harmony is not None:
            was_reasoning = False
            content, reasoning, harmony_calls = self._harmony.feed(token_id, text)
            calls = tuple(harmony_calls)
        else:
            was_reasoning = self._splitter.in_reasoning
            content, reasoning = self._splitter.feed(token_id, text)
        if self._tools is not None and content:
            content, deltas = self._tools.feed(content)
            calls = tuple(deltas)
        visible = self._matcher.feed(content)
        if not self._matcher.stopped:
            return Piece(visible, reasoning, tool_calls=calls)
        if not was_reasoning:
            # The segment opened a span: its reasoning comes after the stop string, past the end.
            reasoning = ""
        return Piece(visible, reasoning, stopped=True, tool_calls=calls)

    def flush(self) -> Piece:
        """The held-back content (and the rest of a tool call left open), once generation
        ended without a stop string."""
        if self._harmony is not None:
            content, reasoning, calls = self._harmony.flush()
            visible = self._matcher.feed(content)
            return Piece(visible + self._matcher.flush(), reasoning, tool_calls=tuple(calls))
        if self._tools is None:
            return Piece(self._matcher.flush(), "")
        content, deltas = self._tools.flush()
        visible = self._matcher.feed(content)
        return Piece(visible + self._matcher.flush(), "", tool_calls=tuple(deltas))

    def usage(self) -> Usage:
        """Usage of the request so far."""
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            reasoning_tokens=(
                self._splitter.reasoning_tokens
                if self._harmony is None
                else self._harmony.reasoning_tokens
            ),
        )
