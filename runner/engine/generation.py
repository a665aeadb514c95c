"""What the mlx engines' generation thread shares, whichever way it decodes.

`Generation` holds the requests (waiting for a slot, then running), the prefix cache and the
model, and does everything around decoding: intake, slots, cancel, routing each generated
token through the request's accounting, ending requests (emitting, keeping their KV cache)
and their stats. How running requests advance is a `Stepping` strategy's business:

- `interleaved.InterleavedDecoder`: one `mlx_lm.stream_generate` per request, round robin;
- `batched.BatchedStepping`: one mlx-lm `BatchGenerator` for most requests, plus an
  interleaved decoder for those the batch cannot serve exactly.

A strategy places each admitted request on a `Decoder`, which feeds its tokens back through
`Generation.token`; `Generation` keeps which decoder runs which request. When a request ends,
for whatever reason, `Generation` calls its decoder's `release`, which stops running it and
leaves its KV cache in `Request.cache`.

Prompt reuse (`prefix_cache`): a request starts from the longest prefix of its prompt the
prefix cache holds. Before it starts, it may wait (others behind it go ahead):

- for an entry that is on disk only, while the store reads it back (off this thread);
- for a running request that is still prefilling a prefix they share, longer than what the
  cache holds for it by `SHARE_MIN` tokens: that request keeps its prompt's cache as soon as
  its first token is out (`Decoder.snapshot`), and those waiting start from it. Requests that
  arrive together with one long system prompt prefill it once, not once each.

A request's KV cache is kept before its last output goes out, so that the runner has told the
gateway what it holds by the time the client can send its next turn.

Everything here runs on the generation thread and is not thread-safe.
"""

from __future__ import annotations

import collections
import copy
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from protocol.frames import (
    Echo,
    FinishReason,
    Generate,
    GenerationStats,
    PromptToken,
    TokenLogprob,
)
from runner.accounting import Piece
from runner.engine.base import Failure, Output, Sink, emit
from runner.engine.logprobs import prompt_entries
from runner.engine.mlx_model import MlxModel
from runner.engine.prefix_cache import BLOCK, Entry, PrefixCache, common_prefix
from runner.engine.request import ChoiceGroup, Request
from runner.engine.stats import EngineStats
from runner.errors import RequestError

log = logging.getLogger("runner.engine")

PREFILL_CHUNK = 512
"""Prompt tokens per forward pass when the generation thread prefills by itself (the one
prefill of a request with several choices)."""
SHARE_MIN = 4 * BLOCK
"""A waiting request waits for a running one's prefill when they share this many more prompt
tokens than the prefix cache holds for it (fewer: it prefills them itself)."""
DISK_MIN = BLOCK
"""A waiting request waits for an entry to be read back from disk when it would reuse this
many more tokens than it can from memory."""
ECHO_PIECE_TOKENS = 256
ECHO_PIECE_CHARS = 64 * 1024
"""An echo goes out in pieces of at most this many prompt tokens and text characters (a
piece with 20 alternatives per token is well under a megabyte of JSON)."""


def split_echo(echo: Echo) -> list[Echo]:
    """`echo` as pieces (one, for a short prompt) whose texts and tokens, joined in order, are
    its own."""
    text, tokens = echo.text, echo.tokens
    count = max(
        1,
        -(-len(text) // ECHO_PIECE_CHARS),
        -(-len(tokens) // ECHO_PIECE_TOKENS),
    )
    if count == 1:
        return [echo]
    return [
        Echo(
            text[i * ECHO_PIECE_CHARS : (i + 1) * ECHO_PIECE_CHARS],
            tokens[i * ECHO_PIECE_TOKENS : (i + 1) * ECHO_PIECE_TOKENS],
        )
        for i in range(count)
    ]


class Decoder(Protocol):
    """Runs requests, feeding each generated token to `Generation.token`."""

    def start(self, request: Request) -> None:
        """Start running a request that was given a slot."""

    def release(self, request: Request) -> None:
        """Stop running `request`, leaving its KV cache (if it can be kept) in
        `request.cache`. Called once the request has ended; unknown requests are ignored."""

    def snapshot(self, request: Request) -> list[Any] | None:
        """A copy of what a running request's KV cache holds of its prompt (called at its
        first token), or None when it cannot be copied so."""


class Stepping(Protocol):
    """A decoding strategy: where admitted requests run and how they advance."""

    def check(self, request: Request) -> None:
        """At intake: raise `RequestError` if `request` can never run here."""

    def place(self, request: Request) -> Decoder | None:
        """The decoder to start `request` on now, or None: it must wait (memory)."""

    def step(self) -> None:
        """Advance every running request by one token (prefilling new ones as needed)."""

    def drop_all(self) -> None:
        """Stop running everything, without events (the engine is closing)."""


class Generation:
    """The generation thread's requests and model (see the module docstring)."""

    def __init__(
        self,
        model: MlxModel,
        *,
        sink: Sink,
        stats: EngineStats,
        max_concurrent: int,
        prefix_cache: PrefixCache,
    ) -> None:
        self.model = model
        self.max_concurrent = max_concurrent
        self.prefix_cache = prefix_cache
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: dict[str, Request] = {}
        """Running requests, in the order they got their slots."""
        self._decoders: dict[str, Decoder] = {}
        """What runs each running request (by `Request.request_id`), once it has a slot."""
        self._sink = sink
        self.stats = stats
        """Where it counts (the engine's, or the warm-up's scratch record)."""

    @property
    def busy(self) -> bool:
        """Requests are running, or waiting for a slot and not for a read from disk: keep
        stepping. (A read that ends wakes the engine.)"""
        if self.active:
            return True
        return any(not isinstance(r.waits_for, Entry) for r in self.waiting)

    def poll(self) -> None:
        """Take in what the prefix cache's disk store finished; requests that waited for a
        read go on."""
        if self.prefix_cache.poll():
            for request in self.waiting:
                entry = request.waits_for
                if isinstance(entry, Entry) and not entry.loading:
                    request.waits_for = None

    def is_running(self, request: Request) -> bool:
        return self.active.get(request.request_id) is request

    def intake(
        self, generate: Generate, submitted_at: float, check: Callable[[Request], None]
    ) -> None:
        """Template and validate a new request (`check`: the strategy's own limits), then
        queue it for a slot; an invalid one ends at once with a Failure."""
        request_id = generate.request_id
        if request_id in self.active or any(r.request_id == request_id for r in self.waiting):
            # The protocol layer guarantees fresh ids; a Failure here would end the live one.
            log.error("ignoring a second request with id %s", request_id)
            return
        try:
            requests = self.model.prepare_choices(generate, submitted_at)
            for request in requests:
                check(request)
        except RequestError as exc:
            self._reject(request_id, exc)
            return
        except Exception as exc:
            log.exception("request %s could not be prepared", request_id)
            self._reject(request_id, RequestError("internal_error", f"{type(exc).__name__}: {exc}"))
            return
        self.waiting.extend(requests)
        self.stats.waiting_requests = len(self.waiting)

    def _reject(self, request_id: str, error: RequestError) -> None:
        self.stats.requests_finished += 1
        emit(self._sink, Failure(request_id, error.code, str(error), error.param))

    def cancel(self, request_id: str) -> None:
        """End a request (every choice of it) with finish "cancelled"; unknown or finished ids
        are ignored."""
        for request in [r for r in self.active.values() if r.generate.request_id == request_id]:
            self.finish(request, "cancelled", request.accounting.flush(), tokens=0)
        queued = [r for r in self.waiting if r.generate.request_id == request_id]
        for request in queued:
            self.waiting.remove(request)
            self.stats.waiting_requests = len(self.waiting)
            self.finish(request, "cancelled", Piece("", ""), tokens=0)

    def admit(self, place: Callable[[Request], Decoder | None]) -> None:
        """Start waiting requests, in order, while slots are free and `place` finds them a
        decoder; a request waiting to reuse more of its prompt (module docstring) is passed
        over meanwhile."""
        stats = self.stats
        for request in list(self.waiting):
            if len(self.active) >= self.max_concurrent:
                break
            if request.max_tokens == 0:
                self.waiting.remove(request)
                self._end_at_once(request)
                continue
            if self._must_wait(request):
                continue
            decoder = place(request)
            if decoder is None:
                break
            self.waiting.remove(request)
            self.active[request.request_id] = request
            self._decoders[request.request_id] = decoder
            try:
                decoder.start(request)
            except Exception as exc:
                self.fail(request, exc)
        stats.waiting_requests = len(self.waiting)
        stats.active_requests = len(self.active)
        stats.peak_active_requests = max(stats.peak_active_requests, len(self.active))

    def _must_wait(self, request: Request) -> bool:
        """Whether `request` should wait before it starts: for a read from disk, or for a
        running request's prefill (module docstring). Decided once per thing waited for."""
        waited = request.waits_for
        if waited is not None:
            if isinstance(waited, Entry):
                return waited.loading
            if self.is_running(waited) and waited.first_token_at is None:
                return True
            request.waits_for = None  # that prefill is done (or ended): look again
        if request.wants_prompt_logprobs or (
            request.group is not None and request.group.shared is not None
        ):
            return False  # these do not start from the prefix cache
        prompt, prefix = request.prompt, self.prefix_cache
        in_memory = prefix.match(prompt, memory_only=True)
        reusable = in_memory.length if in_memory is not None else 0
        found = prefix.match(prompt)
        if (
            found is not None
            and not found.entry.in_memory
            and found.length - reusable >= DISK_MIN
            and prefix.load(found.entry)
        ):
            request.waits_for = found.entry
            request.disk_tokens = found.length
            return True
        limit = len(prompt) - 1
        for other in self.active.values():
            if other.first_token_at is not None or other.wants_prompt_logprobs:
                continue
            shared = min(common_prefix(other.prompt, prompt), limit)
            if shared - reusable >= SHARE_MIN:
                request.waits_for = other
                other.followers += 1
                return True
        return False

    def take_cache(self, request: Request) -> tuple[list[Any], int]:
        """The KV cache to start `request` from: the prefix cache's longest match for its
        prompt or a fresh one, and how many prompt tokens it holds already.

        The choices of a request with n > 1 share one prefill: the first to start prefills
        all of the prompt but its last token here, and each later one starts from a copy. So
        does a request whose echo needs its prompt's logprobs (`_echo_pass`), from scratch.
        """
        group = request.group
        if group is not None and group.shared is not None:
            shared, held = group.shared
            group.started += 1
            if group.started == len(group.requests):
                group.shared = None  # the last choice to start takes it, no copy needed
            else:
                shared = copy.deepcopy(shared)
            request.prefill_tokens = len(request.prompt) - held
            if group.echo is not None:
                request.echo = group.echo
            return shared, held
        if request.wants_prompt_logprobs:
            # The prompt's logprobs need the logits at every position: no prefix cache.
            fresh = make_prompt_cache(self.model.model)
            held = len(request.prompt) - 1
            request.echo = self._echo_pass(request, fresh)
            request.prefill_tokens = len(request.prompt)
            if group is not None:
                group.echo = request.echo
                group.started += 1
                group.shared = (copy.deepcopy(fresh), held)
            return fresh, held
        cache, reused = self.prefix_cache.take(request.prompt, request.generate.prefix)
        if cache is None:
            cache = make_prompt_cache(self.model.model)
        else:
            self.stats.prefix_cache_hits += 1
        if request.disk_tokens:
            request.disk_tokens = min(request.disk_tokens, reused)
        request.accounting.cached_tokens = reused
        request.prefill_tokens = len(request.prompt) - reused
        if group is not None:
            held = len(request.prompt) - 1
            self._prefill(cache, request.prompt[reused:held])
            group.started += 1
            group.shared = (copy.deepcopy(cache), held)
            return cache, held
        return cache, reused

    def _echo_pass(self, request: Request, cache: list[Any]) -> Echo:
        """The echo of a request that wants its prompt's logprobs: the prompt but its last
        token run through the model into `cache`, each position's log-softmax giving the
        logprob of the token after it (and the most likely tokens there)."""
        prompt, skip = request.prompt, request.echo_skip
        assert request.echo_text is not None
        token_bytes = self.model.token_bytes
        top = request.generate.top_logprobs
        entries: list[PromptToken] = []
        if skip < len(prompt):
            entries.append(PromptToken(*token_bytes(prompt[skip])))
        model = self.model.model
        held = len(prompt) - 1
        for start in range(0, held, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, held)
            logits = model(mx.array([prompt[start:end]]), cache=cache)[0].astype(mx.float32)
            first = max(start, skip)  # the positions whose next token is echoed
            if first < end:
                logprobs = logits[first - start :] - mx.logsumexp(
                    logits[first - start :], axis=-1, keepdims=True
                )
                entries.extend(
                    prompt_entries(logprobs, prompt[first + 1 : end + 1], top, token_bytes)
                )
            mx.eval([c.state for c in cache])
        return Echo(request.echo_text, tuple(entries))

    def _send_echo(self, request: Request) -> Echo:
        """A choice's echo, before its first output: all of it but its last piece as outputs
        of their own, the last piece for that first output to carry. In pieces so that no
        frame to the gateway grows with the prompt."""
        assert request.echo is not None
        *leading, last = split_echo(request.echo)
        request.echo = None
        for piece in leading:
            emit(
                self._sink,
                Output(
                    request.generate.request_id,
                    "",
                    "",
                    0,
                    request.usage(),
                    index=request.index,
                    echo=piece,
                ),
            )
        return last

    def _end_at_once(self, request: Request) -> None:
        """A request for no token (max_tokens 0): its echo, if it asked for one, and its end."""
        try:
            if request.wants_prompt_logprobs:
                group = request.group
                if group is not None and group.echo is not None:
                    request.echo = group.echo
                else:
                    request.echo = self._echo_pass(request, make_prompt_cache(self.model.model))
                    if group is not None:
                        group.echo = request.echo
        except Exception as exc:
            self.fail(request, exc)
            return
        self.finish(request, "length", Piece("", ""), tokens=0)

    def _prefill(self, cache: list[Any], tokens: list[int]) -> None:
        """Run `tokens` through the model into `cache`, a chunk at a time."""
        model = self.model.model
        for start in range(0, len(tokens), PREFILL_CHUNK):
            model(mx.array([tokens[start : start + PREFILL_CHUNK]]), cache=cache)
            mx.eval([c.state for c in cache])

    def token(
        self,
        request: Request,
        token: int,
        text: str,
        model_finish: str | None,
        logprobs: Any = None,
    ) -> None:
        """One generated token of a running request and its text: emit it, or end the
        request (stop string, end of sequence, length). `logprobs`: the step's
        log-probabilities, used when the request asked for them. The hot path: keep it lean."""
        if request.followers and not request.tokens:
            self._keep_prompt(request)
        request.tokens.append(token)
        self.stats.tokens_generated += 1
        piece = request.accounting.feed(token, text)
        entries: tuple[TokenLogprob, ...] = ()
        if request.logprobs is not None and logprobs is not None:
            entries = (request.logprobs(token, logprobs),)
        if piece.stopped:
            self.finish(request, "stop", piece, tokens=1, logprobs=entries)
        elif model_finish is not None:
            tail = request.accounting.flush()
            piece = Piece(
                piece.text + tail.text,
                piece.reasoning,
                tool_calls=piece.tool_calls + tail.tool_calls,
            )
            reason: FinishReason = "stop" if model_finish == "stop" else "length"
            self.finish(request, reason, piece, tokens=1, logprobs=entries)
        else:
            echo = request.echo
            if echo is not None:
                echo = self._send_echo(request)
            emit(
                self._sink,
                Output(
                    request.generate.request_id,
                    piece.text,
                    piece.reasoning,
                    1,
                    request.usage(),
                    tool_calls=piece.tool_calls,
                    logprobs=entries,
                    index=request.index,
                    echo=echo,
                ),
            )

    def _keep_prompt(self, request: Request) -> None:
        """Keep a copy of `request`'s prompt cache now, for the requests waiting for its
        prefill; they go on (from it, or prefilling if it could not be copied)."""
        request.followers = 0
        decoder = self._decoders.get(request.request_id)
        snapshot = decoder.snapshot(request) if decoder is not None else None
        if snapshot is not None:
            self.prefix_cache.put(request.prompt, snapshot, request.generate.prefix)
        for waiting in self.waiting:
            if waiting.waits_for is request:
                waiting.waits_for = None

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        piece: Piece,
        *,
        tokens: int,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        """End a request with its terminal Output, then keep its KV cache for later prompts.
        A request that called tools and stopped finishes with "tool_calls". A choice of a
        request with n > 1 that is not the last to end only ends itself (`choice_finish`)."""
        now = time.perf_counter()
        self._forget(request)
        self.stats.recent_tokens.append((request.request_id, tuple(request.tokens)))
        if reason == "stop" and request.accounting.tool_calls_made:
            reason = "tool_calls"
        group = request.group
        last = True
        if group is not None:
            group.open -= 1
            last = group.open == 0
        echo = self._send_echo(request) if request.echo is not None else None
        stats = self._stats(request, now) if last else None
        # Kept before the last output goes out: the runner tells the gateway what it holds
        # before the client can send its next turn.
        self._release(request)
        self._release_followers(request)
        if request.cache is not None:
            self.prefix_cache.put(
                request.prompt + request.tokens, request.cache, request.generate.prefix
            )
            request.cache = None
        emit(
            self._sink,
            Output(
                request.generate.request_id,
                piece.text,
                piece.reasoning,
                tokens,
                request.usage(),
                finish_reason=reason if last else None,
                stats=stats,
                tool_calls=piece.tool_calls,
                logprobs=logprobs,
                index=request.index,
                choice_finish=None if last else reason,
                echo=echo,
                matched_stop=request.accounting.matched_stop if reason == "stop" else None,
            ),
        )

    def _release_followers(self, request: Request) -> None:
        """`request` ended: those waiting for its prefill wait no more."""
        if request.followers:
            request.followers = 0
            for waiting in self.waiting:
                if waiting.waits_for is request:
                    waiting.waits_for = None

    def fail(self, request: Request, exc: Exception) -> None:
        """End a request with a Failure "internal_error"; its KV cache is dropped."""
        log.exception("request %s failed", request.request_id, exc_info=exc)
        self._forget(request)
        emit(
            self._sink,
            Failure(request.generate.request_id, "internal_error", f"{type(exc).__name__}: {exc}"),
        )
        self._release(request)
        self._release_followers(request)
        request.cache = None  # its state is unknown after an error
        if request.group is not None:
            self._drop_choices(request.group)

    def _drop_choices(self, group: ChoiceGroup) -> None:
        """The request has failed: its other choices stop without events."""
        for other in group.requests:
            if other in self.waiting:
                self.waiting.remove(other)
                self.stats.waiting_requests = len(self.waiting)
            elif self.is_running(other):
                self._forget(other)
                self._release(other)
        group.open = 0
        group.shared = None

    def drop_all(self) -> None:
        """Forget every request without events (the engine is closing)."""
        self.active.clear()
        self.waiting.clear()
        self._decoders.clear()

    def _forget(self, request: Request) -> None:
        self.active.pop(request.request_id, None)
        self.stats.active_requests = len(self.active)
        self.stats.requests_finished += 1

    def moved(self, request: Request, decoder: Decoder) -> None:
        """A running `request` goes on on `decoder` (a lone request joining the batch)."""
        self._decoders[request.request_id] = decoder

    def _release(self, request: Request) -> None:
        decoder = self._decoders.pop(request.request_id, None)
        if decoder is not None:
            decoder.release(request)

    @staticmethod
    def _stats(request: Request, now: float) -> GenerationStats:
        """Speeds of this request; zeros for what did not happen (no token, one token)."""
        first = request.first_token_at
        if first is None or request.first_step_at is None:
            return GenerationStats(
                0.0, 0.0, int(mx.get_peak_memory()), 0.0, cached_disk_tokens=request.disk_tokens
            )
        prompt_time = first - request.first_step_at
        decode_time = now - first
        decoded = request.accounting.completion_tokens - 1
        return GenerationStats(
            prompt_tps=request.prefill_tokens / prompt_time if prompt_time > 0 else 0.0,
            generation_tps=decoded / decode_time if decoded > 0 and decode_time > 0 else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            time_to_first_token=first - request.submitted_at,
            cached_disk_tokens=request.disk_tokens,
        )
