"""A scripted Engine: deterministic output and exact usage with no model, for fault and load tests.

Each request runs on a thread of its own and emits one token at a time: first
`reasoning_tokens` reasoning tokens "think0 ", "think1 ", ..., then content tokens from `text`
("tok0 ", "tok1 ", ... by default, indexed from 0 over all tokens), paced at `tokens_per_second`
(0: as fast as possible), until one of:

- `max_tokens` tokens (`default_max_tokens` when the request has none): finish "length";
- `eos_after` tokens, if set and smaller: finish "stop", like a model ending on its own;
- a stop string completing in the content: finish "stop", the text before it kept;
- `cancel`: finish "cancelled" with the usage of the tokens really emitted;
- `fail_after` tokens, if set: a Failure "internal_error".

A request for a model not in `models` fails with "model_not_found", one whose prompt reaches
`context_length` with "context_length_exceeded". Usage: `prompt_tokens` is
`scripted_prompt_tokens(messages)`, `completion_tokens` the tokens emitted, `reasoning_tokens`
the reasoning ones among them, `cached_tokens` 0.
"""

from __future__ import annotations

import threading
import time
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
from runner.engine.base import Engine, EngineEvent, Failure, Output, Sink

TextFunction = Callable[[Generate, int], str]


def scripted_prompt_tokens(messages: Sequence[Message]) -> int:
    """The prompt size ScriptedEngine reports: per message, one token for the role plus one
    per whitespace-separated word of the content."""
    return sum(1 + len(message.content.split()) for message in messages)


def default_text(request: Generate, index: int) -> str:
    """The content of token `index` of a request: "tok0 ", "tok1 ", ..."""
    return f"tok{index} "


class ScriptedEngine(Engine):
    """A fake engine following the `Engine` event contract exactly (see the module docstring).

    Counters, for tests: `tokens_generated`, `active_requests`, `peak_active_requests`,
    `requests_finished` (terminal events of any kind).
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
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {max_concurrent}")
        self._models = tuple(ModelInfo(name, context_length) for name in models)
        self.tokens_per_second = tokens_per_second
        self.max_concurrent = max_concurrent
        self.default_max_tokens = default_max_tokens
        self.context_length = context_length
        self.reasoning_tokens = reasoning_tokens
        self.eos_after = eos_after
        self.fail_after = fail_after
        self._text = text
        self._close_timeout = close_timeout
        self._sink: Sink | None = None
        self._lock = threading.Condition()
        self._cancelled: dict[str, threading.Event] = {}
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()

        self.tokens_generated = 0
        self.active_requests = 0
        self.peak_active_requests = 0
        self.requests_finished = 0

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        return self._models

    def start(self, sink: Sink) -> None:
        self._sink = sink

    def submit(self, request: Generate) -> None:
        if self._sink is None:
            raise RuntimeError("submit before start")
        cancelled = threading.Event()
        thread = threading.Thread(
            target=self._run,
            args=(request, time.perf_counter(), cancelled),
            name=f"scripted:{request.request_id}",
            daemon=True,
        )
        with self._lock:
            if self._closing.is_set():
                closed = True
            else:
                closed = False
                self._cancelled[request.request_id] = cancelled
                self._threads.add(thread)
        if closed:
            self._emit(Failure(request.request_id, "internal_error", "the engine is closed"))
            return
        thread.start()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            event = self._cancelled.get(request_id)
            if event is not None:
                event.set()
                self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closing.set()
            self._lock.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(self._close_timeout)

    def _emit(self, event: EngineEvent) -> None:
        assert self._sink is not None
        self._sink(event)

    def _run(self, request: Generate, submitted_at: float, cancelled: threading.Event) -> None:
        try:
            self._serve(request, submitted_at, cancelled)
        finally:
            with self._lock:
                self._cancelled.pop(request.request_id, None)
                self._threads.discard(threading.current_thread())

    def _count(self, *, tokens: int = 0, finished: int = 0) -> None:
        # Request threads update these together; += on an attribute is not atomic.
        with self._lock:
            self.tokens_generated += tokens
            self.requests_finished += finished

    def _fail(self, request: Generate, code: ErrorCode, message: str) -> None:
        self._count(finished=1)
        self._emit(Failure(request.request_id, code, message))

    def _serve(self, request: Generate, submitted_at: float, cancelled: threading.Event) -> None:
        prompt_tokens = scripted_prompt_tokens(request.messages)
        if request.model not in {model.id for model in self._models}:
            self._fail(request, "model_not_found", f"This runner does not serve {request.model}.")
            return
        if prompt_tokens >= self.context_length:
            self._fail(
                request,
                "context_length_exceeded",
                f"The context length is {self.context_length} tokens; the messages take "
                f"{prompt_tokens}.",
            )
            return
        if not self._acquire_slot(cancelled):
            if not self._closing.is_set():
                self._finish(
                    request, _Progress(prompt_tokens, submitted_at), "cancelled", "", tokens=0
                )
            return
        try:
            self._generate(request, _Progress(prompt_tokens, submitted_at), cancelled)
        finally:
            with self._lock:
                self.active_requests -= 1
                self._lock.notify_all()

    def _acquire_slot(self, cancelled: threading.Event) -> bool:
        """Wait for one of the `max_concurrent` slots; False when cancelled or closing first."""
        with self._lock:
            while self.active_requests >= self.max_concurrent:
                if cancelled.is_set() or self._closing.is_set():
                    return False
                self._lock.wait()
            if cancelled.is_set() or self._closing.is_set():
                return False
            self.active_requests += 1
            self.peak_active_requests = max(self.peak_active_requests, self.active_requests)
            return True

    def _generate(self, request: Generate, progress: _Progress, cancelled: threading.Event) -> None:
        max_tokens = request.max_tokens or self.default_max_tokens
        if self.eos_after is not None:
            max_tokens = min(max_tokens, self.eos_after)
        matcher = StopMatcher(request.stop)
        started = time.perf_counter()
        for index in range(max_tokens):
            if self.tokens_per_second > 0:
                due = started + (index + 1) / self.tokens_per_second
                # Waiting on the event, not sleeping, so that cancel takes effect at once.
                cancelled.wait(max(0.0, due - time.perf_counter()))
            if self._closing.is_set():
                return
            if cancelled.is_set():
                self._finish(request, progress, "cancelled", matcher.flush(), tokens=0)
                return
            if self.fail_after is not None and index >= self.fail_after:
                self._fail(request, "internal_error", f"scripted failure after {index} tokens")
                return
            progress.add_token(reasoning=index < self.reasoning_tokens)
            self._count(tokens=1)
            if index < self.reasoning_tokens:
                text, reasoning = "", f"think{index} "
            else:
                text, reasoning = matcher.feed(self._text(request, index)), ""
            if matcher.stopped:
                self._finish(request, progress, "stop", text, tokens=1)
                return
            if index == max_tokens - 1:
                reason: FinishReason = "stop" if max_tokens == self.eos_after else "length"
                self._finish(
                    request, progress, reason, text + matcher.flush(), tokens=1, reasoning=reasoning
                )
                return
            self._emit(Output(request.request_id, text, reasoning, 1, progress.usage()))

    def _finish(
        self,
        request: Generate,
        progress: _Progress,
        reason: FinishReason,
        text: str,
        *,
        tokens: int,
        reasoning: str = "",
    ) -> None:
        self._count(finished=1)
        self._emit(
            Output(
                request.request_id,
                text,
                reasoning,
                tokens,
                progress.usage(),
                finish_reason=reason,
                stats=progress.stats(),
            )
        )


class _Progress:
    """Token counts and timings of one scripted request."""

    def __init__(self, prompt_tokens: int, submitted_at: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self._submitted_at = submitted_at
        self._first_token_at: float | None = None

    def add_token(self, *, reasoning: bool) -> None:
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
        self.completion_tokens += 1
        self.reasoning_tokens += reasoning

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens,
        )

    def stats(self) -> GenerationStats:
        first = self._first_token_at
        if first is None:
            return GenerationStats(0.0, 0.0, 0, 0.0)
        elapsed = time.perf_counter() - first
        decoded = self.completion_tokens - 1
        return GenerationStats(
            prompt_tps=0.0,
            generation_tps=decoded / elapsed if decoded > 0 and elapsed > 0 else 0.0,
            peak_memory_bytes=0,
            time_to_first_token=first - self._submitted_at,
        )
