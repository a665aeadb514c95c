"""An Engine on mlx-lm: one generation thread serves every request, a token each in turn.

MLX arrays, the model and its KV caches belong to the thread that made them, so `MlxEngine`
loads the model on its own generation thread and touches MLX nowhere else; `submit` and
`cancel` only drop work into lock-protected inboxes that the thread drains between steps.

For each request the generation thread:

1. on intake, applies the chat template and checks the lengths, so errors come at once and a
   cancelled queued request still reports its real prompt usage;
2. when one of the `max_concurrent` slots is free, takes the prefix-cache entry sharing the
   longest prefix with the prompt and starts `mlx_lm.stream_generate` on the rest of it;
3. advances every running request by one token per round (round robin), routes each token
   through `runner.accounting.RequestAccounting` and emits one `Output` per token;
4. at the end keeps the request's KV cache in the prefix cache for the requests after it.

Batching the running requests into one forward pass is a later step; this is the baseline.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from protocol.frames import (
    ErrorCode,
    FinishReason,
    Generate,
    GenerationStats,
    Message,
    ModelInfo,
)
from runner.accounting import Piece, RequestAccounting, prompt_opens_reasoning
from runner.demo_model import resolve_model
from runner.engine.base import Engine, EngineEvent, Failure, Output, Sink, emit
from runner.engine.sampling import make_logits_processors, make_sampler_for

log = logging.getLogger("runner.engine")

DEFAULT_CONTEXT_LENGTH = 4096
"""Used when the model config names no `max_position_embeddings`."""


class MlxEngine(Engine):
    """Serves one mlx-lm model (a local MLX directory, a Hugging Face id or "orchard-demo").

    Counters for tests and metrics are plain attributes, written by the generation thread:
    `tokens_generated`, `requests_finished` (terminal events of any kind), `active_requests`,
    `waiting_requests`, `peak_active_requests`, `prefix_cache_hits`; and `recent_tokens`, the
    generated token ids of the last few requests that finished (for exact-output tests).
    """

    def __init__(
        self,
        model: str,
        max_concurrent: int = 4,
        *,
        prefix_cache_size: int = 8,
        context_length: int | None = None,
        close_timeout: float = 30.0,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {max_concurrent}")
        self.model_name = model
        self.max_concurrent = max_concurrent
        self.prefix_cache_size = prefix_cache_size
        self._context_length = context_length
        self._close_timeout = close_timeout
        self._models: tuple[ModelInfo, ...] = ()
        self._sink: Sink | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._wakeup = threading.Condition()
        self._inbox: list[tuple[Generate, float]] = []
        self._cancels: list[str] = []
        self._closing = False

        self.tokens_generated = 0
        self.requests_finished = 0
        self.active_requests = 0
        self.waiting_requests = 0
        self.peak_active_requests = 0
        self.prefix_cache_hits = 0
        self.recent_tokens: collections.deque[tuple[str, tuple[int, ...]]] = collections.deque(
            maxlen=32
        )

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        return self._models

    def start(self, sink: Sink) -> None:
        """Start the generation thread and wait until it has loaded the model.

        A load error (missing files, unknown architecture...) is raised here, unchanged.
        """
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        self._sink = sink
        self._thread = threading.Thread(
            target=self._serve, name=f"mlx-engine:{self.model_name}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def submit(self, request: Generate) -> None:
        if self._sink is None:
            raise RuntimeError("submit before start")
        with self._wakeup:
            if not self._closing:
                self._inbox.append((request, time.perf_counter()))
                self._wakeup.notify()
                return
        self._emit(Failure(request.request_id, "internal_error", "the engine is closed"))

    def cancel(self, request_id: str) -> None:
        with self._wakeup:
            self._cancels.append(request_id)
            self._wakeup.notify()

    def close(self) -> None:
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self._close_timeout)
            if self._thread.is_alive():
                log.warning("generation thread still busy %.0fs after close", self._close_timeout)

    def _emit(self, event: EngineEvent) -> None:
        emit(self._sink, event)

    def _serve(self) -> None:
        try:
            self._serve_loaded()
        finally:
            # MLX 0.32 aborts the process at exit ("terminate called without an active
            # exception") unless a thread that used MLX destroys its streams before it ends.
            mx.clear_streams()

    def _serve_loaded(self) -> None:
        try:
            # mlx-lm annotates load() as returning a 2- or 3-tuple; return_config picks the 3.
            loaded: Any = mlx_lm.load(resolve_model(self.model_name), return_config=True)
            model, tokenizer, config = loaded
            worker = self._make_worker(model, tokenizer, config)
        except BaseException as exc:  # handed to the thread that called start()
            self._load_error = exc
            self._ready.set()
            return
        self._models = (ModelInfo(self.model_name, worker.context_length),)
        log.info(
            "loaded %s (context %d tokens, %s)",
            self.model_name,
            worker.context_length,
            type(worker).__name__,
        )
        self._ready.set()
        try:
            self._loop(worker)
        finally:
            worker.drop_all()

    def _make_worker(self, model: Any, tokenizer: Any, config: Any) -> _Worker:
        """The per-thread generation state; subclasses swap in their own (batched)."""
        return _Worker(self, model, tokenizer, config, self._context_length)

    def _loop(self, worker: _Worker) -> None:
        while True:
            with self._wakeup:
                while not (self._inbox or self._cancels or worker.busy or self._closing):
                    self._wakeup.wait()
                if self._closing:
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            try:
                for request, submitted_at in inbox:
                    worker.intake(request, submitted_at)
                for request_id in cancels:
                    worker.cancel(request_id)
                worker.fill_slots()
                worker.step_all()
            except Exception:
                # Per-request errors are handled inside; this is a bug, not a reason to stop.
                log.exception("generation loop error")


@attrs.define(eq=False)
class _Request:
    """A request as the generation thread tracks it."""

    generate: Generate
    submitted_at: float
    prompt: list[int]
    max_tokens: int
    accounting: RequestAccounting
    tokens: list[int] = attrs.field(factory=list)
    """Generated so far."""
    stream: Iterator[Any] | None = None
    cache: list[Any] | None = None
    prefill_tokens: int = 0
    """Prompt tokens actually processed (those not reused from the prefix cache)."""
    first_step_at: float | None = None
    first_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.generate.request_id


class _RequestError(Exception):
    """A request is invalid for this model; ends it with a Failure of `code`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code


class _Worker:
    """Everything the generation thread owns: model, tokenizer, caches and requests."""

    def __init__(
        self,
        engine: MlxEngine,
        model: Any,
        tokenizer: Any,
        config: dict[str, Any],
        context_length: int | None,
    ) -> None:
        self._engine = engine
        self._model = model
        self._tokenizer = tokenizer
        text_config = config.get("text_config") or {}
        self.context_length = int(
            context_length
            or config.get("max_position_embeddings")
            or text_config.get("max_position_embeddings")
            or DEFAULT_CONTEXT_LENGTH
        )
        self._vocab_size = int(
            config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer)
        )
        self._think_start_id, self._think_end_id = _think_ids(tokenizer)
        self._prefix_cache = _PrefixCache(engine.prefix_cache_size)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: dict[str, _Request] = {}

    @property
    def busy(self) -> bool:
        """Requests are running or waiting for a slot: keep stepping."""
        return bool(self._active or self._waiting)

    def intake(self, generate: Generate, submitted_at: float) -> None:
        """Template and validate a new request, then queue it for a slot."""
        request_id = generate.request_id
        if request_id in self._active or any(r.request_id == request_id for r in self._waiting):
            # The protocol layer guarantees fresh ids; a Failure here would end the live one.
            log.error("ignoring a second request with id %s", request_id)
            return
        try:
            request = self._prepare(generate, submitted_at)
        except _RequestError as exc:
            self._reject(request_id, exc.code, str(exc))
            return
        except Exception as exc:
            log.exception("request %s could not be prepared", request_id)
            self._reject(request_id, "internal_error", f"{type(exc).__name__}: {exc}")
            return
        self._waiting.append(request)
        self._engine.waiting_requests = len(self._waiting)

    def _reject(self, request_id: str, code: ErrorCode, message: str) -> None:
        self._engine.requests_finished += 1
        self._engine._emit(Failure(request_id, code, message))

    def cancel(self, request_id: str) -> None:
        """End a request with finish "cancelled"; unknown or finished ids are ignored."""
        request = self._active.get(request_id)
        if request is not None:
            self._finish(request, "cancelled", request.accounting.flush(), tokens=0)
            return
        for queued in self._waiting:
            if queued.request_id == request_id:
                self._waiting.remove(queued)
                self._engine.waiting_requests = len(self._waiting)
                self._finish(queued, "cancelled", Piece("", ""), tokens=0)
                return

    def fill_slots(self) -> None:
        """Start queued requests while slots are free."""
        while self._waiting and len(self._active) < self._engine.max_concurrent:
            request = self._waiting.popleft()
            self._active[request.request_id] = request
            try:
                self._start(request)
            except Exception as exc:
                self._fail(request, exc)
        self._engine.waiting_requests = len(self._waiting)
        self._engine.active_requests = len(self._active)
        self._engine.peak_active_requests = max(
            self._engine.peak_active_requests, len(self._active)
        )

    def step_all(self) -> None:
        """One token for every running request."""
        for request in list(self._active.values()):
            try:
                self._step(request)
            except Exception as exc:  # handling its token failed: that request ends, alone
                if request.request_id in self._active:
                    self._fail(request, exc)

    def drop_all(self) -> None:
        """Stop everything without events (engine closing)."""
        for request in self._active.values():
            _close_stream(request)
        self._active.clear()
        self._waiting.clear()

    def _prepare(self, generate: Generate, submitted_at: float) -> _Request:
        if generate.model != self._engine.model_name:
            raise _RequestError(
                "model_not_found",
                f"This engine serves {self._engine.model_name}, not {generate.model}.",
            )
        try:
            prompt = [
                int(token)
                for token in self._tokenizer.apply_chat_template(
                    [_message_dict(message) for message in generate.messages],
                    add_generation_prompt=True,
                    tokenize=True,
                )
            ]
        except Exception as exc:
            raise _RequestError(
                "invalid_request", f"The chat template rejected the messages: {exc}"
            ) from exc
        limit = self.context_length
        if len(prompt) >= limit:
            raise _RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens; "
                f"the messages take {len(prompt)}.",
            )
        max_tokens = generate.max_tokens
        if max_tokens is None:
            max_tokens = limit - len(prompt)
        elif max_tokens < 1:
            raise _RequestError("invalid_request", f"max_tokens must be at least 1: {max_tokens}")
        elif len(prompt) + max_tokens > limit:
            raise _RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens; you requested "
                f"{len(prompt) + max_tokens} ({len(prompt)} in the messages, {max_tokens} "
                "in the completion).",
            )
        for bias in generate.sampling.logit_bias:
            if not 0 <= bias.token < self._vocab_size:
                raise _RequestError(
                    "invalid_request",
                    f"logit_bias names token {bias.token}, outside this model's vocabulary "
                    f"of {self._vocab_size}.",
                )
        accounting = RequestAccounting(
            prompt_tokens=len(prompt),
            stop=generate.stop,
            think_start_id=self._think_start_id,
            think_end_id=self._think_end_id,
            think_start_text=self._tokenizer.think_start or "<think>",
            think_end_text=self._tokenizer.think_end or "</think>",
            starts_in_reasoning=prompt_opens_reasoning(
                prompt, self._think_start_id, self._think_end_id
            ),
        )
        return _Request(generate, submitted_at, prompt, max_tokens, accounting)

    def _start(self, request: _Request) -> None:
        cache, reused = self._prefix_cache.take(request.prompt)
        if cache is None:
            cache = make_prompt_cache(self._model)
        else:
            self._engine.prefix_cache_hits += 1
        suffix = request.prompt[reused:]
        request.cache = cache
        request.prefill_tokens = len(suffix)
        request.accounting.cached_tokens = reused
        params = request.generate.sampling
        request.stream = stream_generate(
            self._model,
            self._tokenizer,
            suffix,
            max_tokens=request.max_tokens,
            sampler=make_sampler_for(params, self._vocab_size),
            # None, not [], when there are none: mlx-lm then skips the token bookkeeping.
            logits_processors=make_logits_processors(params, len(suffix)) or None,
            prompt_cache=cache,
        )

    def _step(self, request: _Request) -> None:
        assert request.stream is not None
        if request.first_step_at is None:
            request.first_step_at = time.perf_counter()
        try:
            response = next(request.stream)
        except StopIteration:
            # stream_generate always ends with a finish_reason; this would be an mlx-lm change.
            self._finish(request, "length", request.accounting.flush(), tokens=0)
            return
        except Exception as exc:
            self._fail(request, exc)
            return
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        token = int(response.token)
        request.tokens.append(token)
        self._engine.tokens_generated += 1
        piece = request.accounting.feed(token, response.text)
        self._deliver(request, piece, response.finish_reason)

    def _deliver(self, request: _Request, piece: Piece, model_finish: str | None) -> None:
        """One token's piece: emit it, or end the request (stop string, EOS, length)."""
        if piece.stopped:
            self._finish(request, "stop", piece, tokens=1)
        elif model_finish is not None:
            tail = request.accounting.flush()
            piece = Piece(piece.text + tail.text, piece.reasoning)
            reason: FinishReason = "stop" if model_finish == "stop" else "length"
            self._finish(request, reason, piece, tokens=1)
        else:
            self._engine._emit(
                Output(
                    request.request_id,
                    piece.text,
                    piece.reasoning,
                    1,
                    request.accounting.usage(),
                )
            )

    def _finish(
        self, request: _Request, reason: FinishReason, piece: Piece, *, tokens: int
    ) -> None:
        now = time.perf_counter()
        self._forget(request)
        self._engine.recent_tokens.append((request.request_id, tuple(request.tokens)))
        self._engine._emit(
            Output(
                request.request_id,
                piece.text,
                piece.reasoning,
                tokens,
                request.accounting.usage(),
                finish_reason=reason,
                stats=self._stats(request, now),
            )
        )
        _close_stream(request)
        if request.cache is not None:
            self._prefix_cache.put(request.prompt + request.tokens, request.cache)
            request.cache = None

    def _fail(self, request: _Request, exc: Exception) -> None:
        log.exception("request %s failed", request.request_id, exc_info=exc)
        self._forget(request)
        request.cache = None  # its state is unknown after an error
        self._engine._emit(
            Failure(request.request_id, "internal_error", f"{type(exc).__name__}: {exc}")
        )
        _close_stream(request)

    def _forget(self, request: _Request) -> None:
        self._active.pop(request.request_id, None)
        self._engine.active_requests = len(self._active)
        self._engine.requests_finished += 1

    def _stats(self, request: _Request, now: float) -> GenerationStats:
        """Speeds of this request; zeros for what did not happen (no token, one token)."""
        first = request.first_token_at
        if first is None or request.first_step_at is None:
            return GenerationStats(0.0, 0.0, int(mx.get_peak_memory()), 0.0)
        prompt_time = first - request.first_step_at
        decode_time = now - first
        decoded = request.accounting.completion_tokens - 1
        return GenerationStats(
            prompt_tps=request.prefill_tokens / prompt_time if prompt_time > 0 else 0.0,
            generation_tps=decoded / decode_time if decoded > 0 and decode_time > 0 else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            time_to_first_token=first - request.submitted_at,
        )


def _close_stream(request: _Request) -> None:
    """Close the generator here, on the generation thread, not whenever it is collected."""
    if request.stream is None:
        return
    stream, request.stream = request.stream, None
    close = getattr(stream, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:
        log.exception("closing the generation stream of %s", request.request_id)


def _message_dict(message: Message) -> dict[str, str]:
    # Chat templates know "system"; OpenAI's "developer" role is its newer name.
    role = "system" if message.role == "developer" else message.role
    data = {"role": role, "content": message.content}
    if message.name is not None:
        data["name"] = message.name
    return data


def _think_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """The single-token think markers, or (None, None): multi-token markers are not split."""
    if not tokenizer.has_thinking:
        return None, None
    try:
        return int(tokenizer.think_start_id), int(tokenizer.think_end_id)
    except ValueError:
        log.warning("think markers span several tokens; reasoning is not split out")
        return None, None


class _PrefixCache:
    """KV caches of finished requests, keyed by the tokens each holds, least recent first.

    A new request takes (removes) the entry sharing the longest prefix with its prompt: a cache
    is mutated in place while generating, so one is never shared by two requests.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: list[tuple[list[int], list[Any]]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """A cache holding the longest available prefix of `prompt`, and that prefix's length.

        At least one prompt token is always left to process: generation needs the logits of
        the last one.
        """
        best, best_length = -1, 0
        for index, (tokens, _) in enumerate(self._entries):
            length = _common_prefix(tokens, prompt)
            if length > best_length:
                best, best_length = index, length
        reuse = min(best_length, len(prompt) - 1)
        if reuse <= 0:
            return None, 0
        tokens, cache = self._entries.pop(best)
        excess = len(tokens) - reuse
        # mlx-lm annotates the result as a list; it is the number of tokens trimmed.
        trimmed: Any = trim_prompt_cache(cache, excess) if excess > 0 else 0
        if trimmed != excess:
            return None, 0
        return cache, reuse

    def put(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep `cache`, which holds `tokens` or a prefix of them (its offset says how many)."""
        if self._capacity <= 0 or not cache or not can_trim_prompt_cache(cache):
            return
        held = getattr(cache[0], "offset", None)
        if not isinstance(held, int) or not 0 < held <= len(tokens):
            return
        tokens = tokens[:held]
        # An entry holding a prefix of these tokens is now redundant.
        self._entries = [
            (other, c) for other, c in self._entries if _common_prefix(other, tokens) < len(other)
        ]
        self._entries.append((tokens, cache))
        del self._entries[: -self._capacity]


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length
