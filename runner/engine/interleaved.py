"""Interleaved decoding: each request runs its own `mlx_lm.stream_generate`, round robin.

Every step advances each running request by one token, in the order they started. A request
starts from the prefix cache's longest match for its prompt, so it prefills only the rest;
`stream_generate` extends that cache in place, and `Generation` keeps it when the request ends.

Each request is exactly what a lone `stream_generate` on its prompt would give, with its own
sampler and logits processors; the cost is one forward pass per request per token.
`InterleavedDecoder` is both a `Decoder` and a whole `Stepping` (made by the `Interleaved`
strategy, `MlxEngine`'s default), and the batched strategy's decoder for requests that must not
be batched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import attrs
from mlx_lm.generate import stream_generate

from runner.engine.generation import Decoder, Generation, Stepping
from runner.engine.masking import ConstraintProcessor
from runner.engine.prefix_cache import compact
from runner.engine.request import Request
from runner.engine.sampling import make_logits_processors, make_sampler_for
from runner.engine.speculative import counted
from runner.engine.stats import EngineStats

log = logging.getLogger("runner.engine")


@attrs.frozen
class Interleaved:
    """The strategy (`mlx_engine.Strategy`) of one `stream_generate` per request, round robin.

    The KV bytes it reports are the kept prompts' only, within the prefix cache's bound."""

    def stepping(self, generation: Generation, stats: EngineStats) -> Stepping:
        return InterleavedDecoder(generation)

    def prefix_bytes(self) -> int | None:
        return None

    def kv_bytes(self, stats: EngineStats, prefix: int | None) -> int | None:
        return prefix

    def kv_limit(self, prefix_cache_bytes: int | None) -> int | None:
        return prefix_cache_bytes


class InterleavedDecoder:
    """Runs requests on their own `stream_generate`, a token each per `step`."""

    def __init__(self, generation: Generation) -> None:
        self._generation = generation
        self._streams: dict[str, tuple[Request, Iterator[Any]]] = {}
        self._guards: dict[str, ConstraintProcessor] = {}
        """The constraint processors of constrained requests."""
        self._draft_caches: dict[str, list[Any]] = {}
        """The draft's cache of each request that drafts."""
        self._drafts: dict[str, bool] = {}
        """Of the requests the model's draft could serve and that started alone, whether
        each drafts: their decode rates choose the next one's way (runner.engine.speculative)."""

    def __len__(self) -> int:
        return len(self._streams)

    def requests(self) -> list[Request]:
        """The requests running here, in the order they started."""
        return [request for request, _ in self._streams.values()]

    @property
    def nbytes(self) -> int:
        """Bytes held by the running requests' KV caches."""
        return sum(
            sum(c.nbytes for c in request.cache)
            for request, _ in self._streams.values()
            if request.cache is not None
        )

    # Stepping: every request can run here, at once.

    def check(self, request: Request) -> None:
        pass

    def place(self, request: Request) -> Decoder:
        return self

    def start(self, request: Request) -> None:
        model = self._generation.model
        cache, reused = self._generation.take_cache(request)
        request.cache = cache
        suffix = request.prompt[reused:]
        params = request.generate.sampling
        guard = request.guard()
        if guard is not None:
            self._guards[request.request_id] = guard
        draft = model.draft if guard is None else None
        # stream_generate cannot stop drafting midway: a request drafts whole or not at all.
        drafts = draft is not None and draft.choose(can_stop=False) == "draft"
        if draft is not None and not self._streams:
            self._drafts[request.request_id] = drafts
        if draft is not None and drafts:
            draft_cache = self._draft_caches[request.request_id] = draft.cache_for(
                request.prompt[:reused]
            )
            # runner.engine.speculative: the draft's cache starts where this one stands, and
            # the logits processors see the last prompt token and what is generated.
            stream = counted(
                draft,
                stream_generate(
                    model.model,
                    model.tokenizer_for(request),
                    suffix,
                    max_tokens=request.max_tokens,
                    draft_model=draft.model,
                    num_draft_tokens=draft.num_tokens,
                    sampler=make_sampler_for(params, model.vocab_size),
                    logits_processors=make_logits_processors(params, 1, None) or None,
                    prompt_cache=[*cache, *draft_cache],
                    **model.kv_quantization,
                ),
                request.max_tokens,
            )
        else:
            stream = stream_generate(
                model.model,
                model.tokenizer_for(request),
                suffix,
                max_tokens=request.max_tokens,
                sampler=make_sampler_for(params, model.vocab_size),
                # None, not [], when there are none: mlx-lm then skips the token bookkeeping.
                logits_processors=make_logits_processors(params, len(suffix), guard) or None,
                prompt_cache=cache,
                **model.kv_quantization,
            )
        self._streams[request.request_id] = (request, stream)

    def step(self) -> None:
        """One token for every running request."""
        generation = self._generation
        for request, stream in list(self._streams.values()):
            if not generation.is_running(request):
                continue  # ended during this step (a failing choice stops its siblings)
            try:
                self._advance(request, stream)
            except Exception as exc:  # handling its token failed: that request ends, alone
                if generation.is_running(request):
                    generation.fail(request, exc)

    def _advance(self, request: Request, stream: Iterator[Any]) -> None:
        if request.first_step_at is None:
            request.first_step_at = time.perf_counter()
        try:
            response = next(stream)
        except StopIteration:
            # stream_generate always ends with a finish_reason; this would be an mlx-lm change.
            self._generation.finish(request, "length", request.accounting.flush(), tokens=0)
            return
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        if request.constraint is not None:
            guard = self._guards[request.request_id]
            if guard.error is not None:
                raise RuntimeError(f"constraint: {guard.error}")
        self._generation.token(
            request, int(response.token), response.text, response.finish_reason, response.logprobs
        )

    def snapshot(self, request: Request) -> list[Any] | None:
        return None if request.cache is None else compact(request.cache, len(request.prompt))

    def release(self, request: Request) -> None:
        self._guards.pop(request.request_id, None)
        drafts = self._drafts.pop(request.request_id, None)
        draft = self._generation.model.draft
        started = request.first_token_at
        # A request that ran alone: its decode rate is its way's.
        if draft is not None and drafts is not None and started and len(self._streams) == 1:
            seconds = time.perf_counter() - started
            draft.observe(drafts, len(request.tokens) - 1, seconds)
        entry = self._streams.pop(request.request_id, None)
        if entry is not None:
            _close(request, entry[1])
        draft_cache = self._draft_caches.pop(request.request_id, None)
        if draft is not None and draft_cache is not None:
            draft.keep(request.prompt + request.tokens, draft_cache)

    def drop_all(self) -> None:
        for request, stream in self._streams.values():
            _close(request, stream)
        self._streams.clear()
        self._guards.clear()
        self._drafts.clear()
        self._draft_caches.clear()


def _close(request: Request, stream: Iterator[Any]) -> None:
    """Close the generator here, on the generation thread, not whenever it is collected."""
    close = getattr(stream, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:
        log.exception("closing the generation stream of %s", request.request_id)
