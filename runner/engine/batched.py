"""An Engine on mlx-lm's continuous batching: one forward pass per step for all running requests.

`BatchedMlxEngine` keeps `MlxEngine`'s thread model, intake, accounting and prefix cache (it
reuses them) and changes how running requests advance: every request the batch can take goes
into one `mlx_lm.generate.BatchGenerator`, whose `next()` decodes one token for each running
request and prefills newly inserted prompts in the same call, so a late request starts its
prefill at the next step.

Requests the batch cannot serve exactly run on the round-robin path of `MlxEngine` (their own
`stream_generate`), in the same thread, a token per step alongside the batch:

- a sampled request with a fixed `seed`: its draws must not depend on what runs alongside it,
  and a batch row's logits are only bit-identical to a lone run when the rows line up.

Everything else (greedy, sampled without a seed, logit_bias, penalties) is batched. Requests
with the same sampling settings share one sampler object, so the batch samples in one call.

An error while handling one row's token fails that request alone. An error inside the batch's
own step (the forward pass) leaves the batch in an unknown state: every row of it fails, and
a fresh batch serves what comes next.

KV memory: `kv_bytes` is the bytes held by KV caches now (batch, round-robin requests and the
prefix cache); with `max_kv_bytes` set, a request only starts when the worst case of every
running request (prompt + max_tokens each, rows padded to the longest as `BatchKVCache` lays
them out) fits, evicting prefix-cache entries first. Transient copies while a new row joins
the batch are not counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from protocol.frames import SamplingParams
from runner.engine.mlx_engine import (
    MlxEngine,
    _close_stream,
    _PrefixCache,
    _Request,
    _RequestError,
    _Worker,
)
from runner.engine.sampling import Sampler, make_logits_processors, make_sampler_for

log = logging.getLogger("runner.engine.batched")

_KV_STEP = 256
"""mlx-lm's KV caches grow in steps of this many tokens."""


class BatchedMlxEngine(MlxEngine):
    """`MlxEngine` with batched decoding; same constructor plus `max_kv_bytes`.

    Extra attributes: `kv_bytes` (KV-cache bytes held now), `kv_bytes_per_token`,
    `batched_requests` and `fallback_requests` (how many took each path so far),
    `peak_batch_size`.
    """

    def __init__(
        self,
        model: str,
        max_concurrent: int = 32,
        *,
        max_kv_bytes: int | None = None,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 512,
        **options: Any,
    ) -> None:
        super().__init__(model, max_concurrent, **options)
        self.max_kv_bytes = max_kv_bytes
        self.prefill_batch_size = prefill_batch_size
        # Smaller than mlx-lm's 2048: a long prompt joining the batch holds up the running
        # requests for one chunk per step.
        self.prefill_step_size = prefill_step_size
        self.kv_bytes = 0
        self.kv_bytes_per_token = 0
        self.batched_requests = 0
        self.fallback_requests = 0
        self.peak_batch_size = 0

    def _make_worker(self, model: Any, tokenizer: Any, config: Any) -> _Worker:
        return _BatchedWorker(self, model, tokenizer, config, self._context_length)


@attrs.define(eq=False)
class _Row:
    """A request's place in the batch."""

    uid: int
    detokenizer: Any


class _BatchedWorker(_Worker):
    """The generation thread's state: one BatchGenerator plus round-robin fallback requests."""

    def __init__(
        self,
        engine: BatchedMlxEngine,
        model: Any,
        tokenizer: Any,
        config: dict[str, Any],
        context_length: int | None,
    ) -> None:
        super().__init__(engine, model, tokenizer, config, context_length)
        self._batched_engine = engine
        self._eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._samplers: dict[tuple[float, float, float, int], Sampler] = {}
        self._rows: dict[str, _Row] = {}
        self._by_uid: dict[int, _Request] = {}
        # mlx-lm's BatchGenerator is untyped.
        self._batch: Any = self._new_batch()
        engine.kv_bytes_per_token = _bytes_per_token(model)
        if engine.max_kv_bytes is not None and self._reserve(self.context_length) > (
            engine.max_kv_bytes
        ):
            log.warning(
                "max_kv_bytes %d is below one full context (%d bytes): long requests are refused",
                engine.max_kv_bytes,
                self._reserve(self.context_length),
            )

    def _new_batch(self) -> Any:
        engine = self._batched_engine
        return BatchGenerator(
            self._model,
            max_tokens=self.context_length,
            stop_tokens=[[t] for t in sorted(self._eos)],
            completion_batch_size=engine.max_concurrent,
            prefill_batch_size=min(engine.prefill_batch_size, engine.max_concurrent),
            prefill_step_size=engine.prefill_step_size,
        )

    # Intake: the base class templates and validates; here the memory bound is checked too.

    def _prepare(self, generate: Any, submitted_at: float) -> _Request:
        request = super()._prepare(generate, submitted_at)
        limit = self._batched_engine.max_kv_bytes
        need = self._reserve(len(request.prompt) + request.max_tokens)
        if limit is not None and need > limit:
            raise _RequestError(
                "context_length_exceeded",
                f"This runner's KV-cache budget is {limit} bytes; the request may need "
                f"{need} ({len(request.prompt)} prompt + {request.max_tokens} completion "
                "tokens). Ask for fewer max_tokens.",
            )
        return request

    def fill_slots(self) -> None:
        """Start queued requests, in order, while slots and KV memory allow."""
        engine = self._batched_engine
        while self._waiting and len(self._active) < engine.max_concurrent:
            request = self._waiting[0]
            if not self._fits(request):
                break
            self._waiting.popleft()
            self._active[request.request_id] = request
            try:
                if _needs_own_stream(request.generate.sampling):
                    engine.fallback_requests += 1
                    self._start(request)  # MlxEngine's round-robin path
                else:
                    engine.batched_requests += 1
                    self._insert(request)
            except Exception as exc:
                self._fail(request, exc)
        engine.waiting_requests = len(self._waiting)
        engine.active_requests = len(self._active)
        engine.peak_active_requests = max(engine.peak_active_requests, len(self._active))
        engine.peak_batch_size = max(engine.peak_batch_size, len(self._rows))

    def _insert(self, request: _Request) -> None:
        cache, reused = self._prefix_cache.take(request.prompt)
        if cache is None:
            cache = make_prompt_cache(self._model)
        else:
            self._engine.prefix_cache_hits += 1
        request.accounting.cached_tokens = reused
        request.prefill_tokens = len(request.prompt) - reused
        params = request.generate.sampling
        # The batch's token context is the whole prompt (all_tokens + the suffix), so the
        # penalties skip all of it.
        processors = make_logits_processors(params, len(request.prompt))
        request.first_step_at = time.perf_counter()
        (uid,) = self._batch.insert(
            [request.prompt[reused:]],
            max_tokens=[request.max_tokens],
            caches=[cache],
            all_tokens=[list(request.prompt[:reused])],
            samplers=[self._shared_sampler(params)],
            logits_processors=[processors],
        )
        self._rows[request.request_id] = _Row(uid, self._tokenizer.detokenizer)
        self._by_uid[uid] = request

    def _shared_sampler(self, params: SamplingParams) -> Sampler:
        """One sampler object per distinct setting: the batch then samples in one call."""
        key = (params.temperature, params.top_p, params.min_p, params.top_k)
        if params.temperature <= 0:
            key = (0.0, 0.0, 0.0, 0)
        sampler = self._samplers.get(key)
        if sampler is None:
            sampler = self._samplers[key] = make_sampler_for(params, self._vocab_size)
        return sampler

    # Stepping.

    def step_all(self) -> None:
        """One batch step (decode + pending prefill), then a token for each fallback request."""
        if self._rows:
            self._step_batch()
        for request in list(self._active.values()):
            if request.request_id not in self._rows:
                self._step(request)
        self._update_kv_bytes()

    def _step_batch(self) -> None:
        try:
            _, responses = self._batch.next()
        except Exception as exc:
            # The batch's state is unknown: fail its requests and start a fresh one.
            log.exception("batch step failed")
            failed = [self._by_uid[row.uid] for row in self._rows.values()]
            self._rows.clear()
            self._by_uid.clear()
            self._batch.close()
            self._batch = self._new_batch()
            for request in failed:
                self._fail(request, exc)
            return
        now = time.perf_counter()
        for response in responses:
            running = self._by_uid.get(response.uid)
            if running is None:
                continue
            if running.first_token_at is None:
                running.first_token_at = now
            try:
                self._on_token(running, response)
            except Exception as exc:
                # One row's failure (detokenizer, accounting) ends that request only; the
                # other rows of this step still get their tokens.
                if running.request_id in self._active:
                    self._unbatch(running, removed=response.finish_reason is not None)
                    self._fail(running, exc)

    def _on_token(self, request: _Request, response: Any) -> None:
        row = self._rows[request.request_id]
        token = int(response.token)
        request.tokens.append(token)
        self._engine.tokens_generated += 1
        detokenizer = row.detokenizer
        # As stream_generate: an end-of-sequence token adds no text; the last token flushes.
        if token in self._eos:
            detokenizer.finalize()
        else:
            detokenizer.add_token(token)
            if response.finish_reason is not None:
                detokenizer.finalize()
        piece = request.accounting.feed(token, detokenizer.last_segment)
        if response.finish_reason is not None:
            # The batch has already dropped the row and handed back its cache.
            self._unbatch(request, removed=True)
            request.cache = response.prompt_cache
        if piece.stopped and response.finish_reason is None:
            self._unbatch(request, removed=False)  # a stop string: take the row out now
        self._deliver(request, piece, response.finish_reason)

    def _unbatch(self, request: _Request, *, removed: bool) -> None:
        """Take a request out of the batch; unless the batch did so, keep its cache."""
        row = self._rows.pop(request.request_id, None)
        if row is None:
            return
        self._by_uid.pop(row.uid, None)
        if removed:
            return
        try:
            caches = self._batch.remove([row.uid], return_prompt_caches=True)
        except Exception:
            # A row with nothing prefilled yet has no cache to extract; drop it without one.
            self._batch.remove([row.uid])
            caches = {}
        cache, _ = caches.get(row.uid, (None, None))
        request.cache = cache

    def cancel(self, request_id: str) -> None:
        request = self._active.get(request_id)
        if request is not None and request_id in self._rows:
            self._unbatch(request, removed=False)
        super().cancel(request_id)

    def drop_all(self) -> None:
        for request in self._active.values():
            _close_stream(request)
        self._active.clear()
        self._waiting.clear()
        self._rows.clear()
        self._by_uid.clear()
        self._batch.close()

    # KV memory.

    def _reserve(self, tokens: int) -> int:
        """Most bytes a KV cache holding `tokens` tokens can take.

        mlx-lm's caches grow from their current length by whole steps, so the capacity is
        below `tokens + _KV_STEP`, not necessarily a multiple of the step.
        """
        return (tokens + _KV_STEP - 1) * self._batched_engine.kv_bytes_per_token

    def _fits(self, request: _Request) -> bool:
        """Whether `request` can start within max_kv_bytes (evicting prefix entries if need be).

        Batch rows are right-aligned and some row always has no left padding, so the batch's
        KV length never exceeds the longest row's prompt + max_tokens.
        """
        limit = self._batched_engine.max_kv_bytes
        if limit is None:
            return True
        batch_rows = [r for r in self._active.values() if r.request_id in self._rows]
        others = [r for r in self._active.values() if r.request_id not in self._rows]
        if _needs_own_stream(request.generate.sampling):
            others.append(request)
        else:
            batch_rows.append(request)
        longest = max((len(r.prompt) + r.max_tokens for r in batch_rows), default=0)
        need = len(batch_rows) * self._reserve(longest) + sum(
            self._reserve(len(r.prompt) + r.max_tokens) for r in others
        )
        if need > limit:
            return False
        while len(self._prefix_cache) and need + _prefix_bytes(self._prefix_cache) > limit:
            _evict_oldest(self._prefix_cache)
        return True

    def _update_kv_bytes(self) -> None:
        total = self._batch.prompt_cache_nbytes + _prefix_bytes(self._prefix_cache)
        for request in self._active.values():
            if request.request_id not in self._rows and request.cache is not None:
                total += sum(c.nbytes for c in request.cache)
        self._batched_engine.kv_bytes = int(total)


def _needs_own_stream(params: SamplingParams) -> bool:
    """A seeded sampled request must draw the same whatever runs alongside it."""
    return params.seed is not None and params.temperature > 0


def _bytes_per_token(model: Any) -> int:
    """KV bytes one token adds, measured on a one-token forward pass."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    total = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is not None:
            total += (c.keys.nbytes + c.values.nbytes) // keys.shape[2]
    return max(total, 1)


def _prefix_bytes(prefix: _PrefixCache) -> int:
    return sum(sum(c.nbytes for c in cache) for _, cache in prefix._entries)


def _evict_oldest(prefix: _PrefixCache) -> None:
    del prefix._entries[0]
