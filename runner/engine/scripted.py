"""A scripted Engine: deterministic output and exact usage with no model, for fault and load tests.

Each request emits one token at a time: first `reasoning_tokens` reasoning tokens "think0 ",
"think1 ", ..., then content tokens from `text` ("tok0 ", "tok1 ", ... by default, indexed from
0 over all tokens), until one of:

- `max_tokens` tokens (`default_max_tokens` when the request has none): finish "length";
- `eos_after` tokens, if set and smaller: finish "stop", like a model ending on its own;
- a stop string completing in the content: finish "stop", the text before it kept;
- `cancel`: finish "cancelled" at the next round, with the usage of the tokens really emitted;
- `fail_after` tokens, if set: a Failure "internal_error".

A request for a model not in `models` fails with "model_not_found", one whose prompt reaches
`context_length` with "context_length_exceeded". At most `max_concurrent` requests hold a slot;
the others wait in submission order. Usage: `prompt_tokens` is
`scripted_prompt_tokens(messages)`, `completion_tokens` the tokens emitted, `reasoning_tokens`
the reasoning ones among them, `cached_tokens` 0.

A request with `n` > 1 runs n choices, each in its own slot, with the same script; their
outputs carry `index`, a choice that ends before the others says so with `choice_finish`,
the last one ends the request, and usage counts every choice's tokens (the prompt once), as
the mlx engines do. One choice failing fails the request.

One scheduler thread serves every request in rounds, like a batched engine's decode step, where
all rows get their token at once: a round emits the tokens due by then, of all requests, back to
back. That keeps the fake cheap at thousands of streams and lets the runner send one `batch`
frame per round. Pacing: with `tokens_per_second` R > 0, token i of a request is due at
`started + (i+1)/R`, `started` being when it got its slot; rounds are at least `min_step` seconds
apart, so a token is late by at most `min_step` (plus the round's own work). With R = 0 each
round emits one token for every running request and the next round follows at once.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence

from protocol.frames import (
    ErrorCode,
    FinishReason,
    Generate,
    GenerationStats,
    Message,
    ModelInfo,
    Usage,
)
from runner.accounting import StopMatcher
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.stats import EngineStats
from runner.engine.threaded import Submit, ThreadedEngine

log = logging.getLogger("runner.engine.scripted")

TextFunction = Callable[[Generate, int], str]


def scripted_prompt_tokens(messages: Sequence[Message]) -> int:
    """The prompt size ScriptedEngine reports: per message, one token for the role plus one
    per whitespace-separated word of the content."""
    return sum(1 + len(message.content.split()) for message in messages)


def default_text(request: Generate, index: int) -> str:
    """The content of token `index` of a request: "tok0 ", "tok1 ", ..."""
    return f"tok{index} "


class ScriptedEngine(ThreadedEngine):
    """A fake engine following the `Engine` event contract exactly (see the module docstring).

    Counters, for tests, in `stats` (an `EngineStats`, as the mlx engines'): `tokens_generated`,
    `active_requests`, `peak_active_requests`, `requests_finished` (terminal events of any
    kind). Only the scheduler thread writes them, as it computes a round and before the round's
    events reach the sink, so every event of one round sees the same values.
    """

    def __init__(
        self,
        models: Sequence[str] = ("scripted",),
        tokens_per_second: float = 0.0,
        max_concurrent: int = 64,
        *,
        default_max_tokens: int = 16,
        context_length: int = 4096,
        reasoning_tokens: int = 0,
        eos_after: int | None = None,
        fail_after: int | None = None,
        text: TextFunction = default_text,
        close_timeout: float = 10.0,
        min_step: float = 0.001,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {max_concurrent}")
        if min_step < 0:
            raise ValueError(f"min_step must not be negative, not {min_step}")
        super().__init__(thread_name="scripted-engine", close_timeout=close_timeout)
        self._models = tuple(ModelInfo(name, context_length) for name in models)
        self._model_ids = frozenset(models)
        self.tokens_per_second = tokens_per_second
        self.max_concurrent = max_concurrent
        self.default_max_tokens = default_max_tokens
        self.context_length = context_length
        self.reasoning_tokens = reasoning_tokens
        self.eos_after = eos_after
        self.fail_after = fail_after
        self.min_step = min_step
        self._text = text

        # The scheduler thread's own state.
        self._last_round = -math.inf
        self._requests: dict[str, list[_Stream]] = {}  # waiting or running: choices, by id
        self._waiting: deque[_Stream] = deque()  # cancelled ones are skipped (lazy deletion)
        self._running: dict[_Stream, None] = {}  # an ordered set: admission order
        self._due: list[tuple[float, int, _Stream]] = []  # paced: heap of next token times
        self._seq = itertools.count()  # heap tie-break: streams do not compare

        self.stats = EngineStats()

    # The scheduler thread: one round per step.

    def _next_step_at(self, pending: bool) -> float | None:
        """When the next round is due; None: nothing to do until notified."""
        last_round = self._last_round
        if self.tokens_per_second <= 0:
            return last_round if pending or self._running else None
        if pending:
            due = last_round
        elif self._due:
            due = self._due[0][0]
        else:
            return None
        return max(due, last_round + self.min_step)

    def _step(self, now: float, submits: list[Submit], cancels: list[str]) -> None:
        self._last_round = now
        for event in self._round(now, submits, cancels):
            if self._closing:
                return  # close drops running requests without events
            self._emit(event)
        # With R = 0 the next round follows at once: Python's GIL switch interval hands
        # the runner's event loop its turn, which then sends what piled up, merged.

    def _round(self, now: float, inbox: list[Submit], cancels: list[str]) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        for request, submitted_at in inbox:
            self._intake(request, submitted_at, events)
        for request_id in cancels:
            for stream in list(self._requests.get(request_id, ())):
                self._finish(stream, "cancelled", stream.matcher.flush(), events, now=now)
        self._admit(now)
        if self.tokens_per_second > 0:
            due = self._due
            while due and due[0][0] <= now:
                _, _, stream = heapq.heappop(due)
                if stream.done:
                    continue
                self._advance(stream, now, events)
                if not stream.done:
                    self._schedule(stream)
        else:
            for stream in list(self._running):
                if not stream.done:  # a choice whose sibling failed in this round is done
                    self._advance(stream, now, events)
        self._admit(now)  # slots freed in this round start their requests' clocks now
        return events

    def _intake(self, request: Generate, submitted_at: float, events: list[EngineEvent]) -> None:
        prompt_tokens = scripted_prompt_tokens(request.messages)
        if request.model not in self._model_ids:
            self._fail(
                request.request_id,
                "model_not_found",
                f"This runner does not serve {request.model}.",
                events,
            )
        elif prompt_tokens >= self.context_length:
            self._fail(
                request.request_id,
                "context_length_exceeded",
                f"The context length is {self.context_length} tokens; the messages take "
                f"{prompt_tokens}.",
                events,
            )
        else:
            max_tokens = request.max_tokens or self.default_max_tokens
            if self.eos_after is not None:
                max_tokens = min(max_tokens, self.eos_after)
            progress = _Progress(prompt_tokens, submitted_at)
            progress.open = max(request.n, 1)
            choices = [
                _Stream(request, progress, max_tokens, choice)
                for choice in range(max(request.n, 1))
            ]
            self._requests[request.request_id] = choices
            self._waiting.extend(choices)

    def _admit(self, now: float) -> None:
        """Give free slots to waiting requests, first come first served."""
        while self._waiting and self.stats.active_requests < self.max_concurrent:
            stream = self._waiting.popleft()
            if stream.done:
                continue
            stream.running = True
            stream.started = now
            self._running[stream] = None
            self.stats.active_requests += 1
            self.stats.peak_active_requests = max(
                self.stats.peak_active_requests, self.stats.active_requests
            )
            if self.tokens_per_second > 0:
                self._schedule(stream)

    def _schedule(self, stream: _Stream) -> None:
        due = stream.started + (stream.index + 1) / self.tokens_per_second
        heapq.heappush(self._due, (due, next(self._seq), stream))

    def _advance(self, stream: _Stream, now: float, events: list[EngineEvent]) -> None:
        """Emit the next token of a running request, or end it."""
        index = stream.index
        if self.fail_after is not None and index >= self.fail_after:
            self._forget_all(stream)
            self._fail(
                stream.request.request_id,
                "internal_error",
                f"scripted failure after {index} tokens",
                events,
            )
            return
        if index >= stream.max_tokens:  # max_tokens 0: nothing to generate
            reason = self._limit_reason(stream)
            self._finish(stream, reason, stream.matcher.flush(), events, now=now)
            return
        if index < self.reasoning_tokens:
            text, reasoning = "", f"think{index} "
        else:
            try:
                piece = self._text(stream.request, index)
            except Exception as exc:
                log.exception("scripted text function failed for %s", stream.request.request_id)
                self._forget_all(stream)
                self._fail(
                    stream.request.request_id,
                    "internal_error",
                    f"{type(exc).__name__}: {exc}",
                    events,
                )
                return
            text, reasoning = stream.matcher.feed(piece), ""
        stream.index += 1
        stream.progress.add_token(now, reasoning=index < self.reasoning_tokens)
        self.stats.tokens_generated += 1
        if stream.matcher.stopped:
            self._finish(stream, "stop", text, events, now=now, tokens=1)
        elif stream.index == stream.max_tokens:
            reason = self._limit_reason(stream)
            text += stream.matcher.flush()
            self._finish(stream, reason, text, events, now=now, tokens=1, reasoning=reasoning)
        else:
            usage = stream.progress.usage()
            events.append(
                Output(stream.request.request_id, text, reasoning, 1, usage, index=stream.choice)
            )

    def _limit_reason(self, stream: _Stream) -> FinishReason:
        return "stop" if stream.max_tokens == self.eos_after else "length"

    def _finish(
        self,
        stream: _Stream,
        reason: FinishReason,
        text: str,
        events: list[EngineEvent],
        *,
        now: float,
        tokens: int = 0,
        reasoning: str = "",
    ) -> None:
        self._forget(stream)
        progress = stream.progress
        progress.open -= 1
        last = progress.open == 0
        self.stats.requests_finished += last
        events.append(
            Output(
                stream.request.request_id,
                text,
                reasoning,
                tokens,
                progress.usage(),
                finish_reason=reason if last else None,
                stats=progress.stats(now) if last else None,
                index=stream.choice,
                choice_finish=None if last else reason,
                matched_stop=stream.matcher.matched if reason == "stop" else None,
            )
        )

    def _fail(
        self, request_id: str, code: ErrorCode, message: str, events: list[EngineEvent]
    ) -> None:
        self.stats.requests_finished += 1
        events.append(Failure(request_id, code, message))

    def _forget(self, stream: _Stream) -> None:
        """Mark a choice done and free its slot; its heap or queue entry is skipped later."""
        stream.done = True
        request_id = stream.request.request_id
        choices = self._requests.get(request_id)
        if choices is not None and stream in choices:
            choices.remove(stream)
            if not choices:
                del self._requests[request_id]
        if stream.running:
            stream.running = False
            del self._running[stream]
            self.stats.active_requests -= 1

    def _forget_all(self, stream: _Stream) -> None:
        """Forget every choice of `stream`'s request (it fails as a whole)."""
        for choice in list(self._requests.get(stream.request.request_id, ())):
            self._forget(choice)


class _Stream:
    """One request's place in the script, owned by the scheduler thread."""

    __slots__ = (
        "choice",
        "done",
        "index",
        "matcher",
        "max_tokens",
        "progress",
        "request",
        "running",
        "started",
    )

    def __init__(
        self, request: Generate, progress: _Progress, max_tokens: int, choice: int = 0
    ) -> None:
        self.request = request
        self.choice = choice
        """Which of the request's n choices this is."""
        self.progress = progress
        self.max_tokens = max_tokens
        self.matcher = StopMatcher(request.stop)
        self.index = 0
        """Tokens emitted so far."""
        self.started = 0.0
        self.running = False
        self.done = False


class _Progress:
    """Token counts and timings of one scripted request (all its choices)."""

    def __init__(self, prompt_tokens: int, submitted_at: float) -> None:
        self.open = 0
        """Its choices not ended yet."""
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self._submitted_at = submitted_at
        self._first_token_at: float | None = None

    def add_token(self, now: float, *, reasoning: bool) -> None:
        if self._first_token_at is None:
            self._first_token_at = now
        self.completion_tokens += 1
        self.reasoning_tokens += reasoning

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens,
        )

    def stats(self, now: float) -> GenerationStats:
        first = self._first_token_at
        if first is None:
            return GenerationStats(0.0, 0.0, 0, 0.0)
        elapsed = now - first
        decoded = self.completion_tokens - 1
        return GenerationStats(
            prompt_tps=0.0,
            generation_tps=decoded / elapsed if decoded > 0 and elapsed > 0 else 0.0,
            peak_memory_bytes=0,
            time_to_first_token=first - self._submitted_at,
        )
