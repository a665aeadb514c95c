"""One request alone on a plain KV cache, at `stream_generate`'s speed, until a second arrives.

A batch row decodes through `BatchKVCache`, whose attention carries an array mask: a bigger
graph than a plain `KVCache` step, and on a GPU no fused attention kernel (1.97 → 4.4 ms of
CPU per step on an H200's big model, docs/benchmarks.md). While one request runs there is
nothing to batch, so `BatchedStepping` starts a lone request here: mlx-lm's `generate_step`
on a plain cache, pipelined as `stream_generate` is, with this request's own sampler and
logits processors. A long prompt is prefilled a chunk per step first (as the batch does it),
so a request arriving meanwhile waits one chunk, not the whole prompt.

When a second request arrives, `hand_over` stops the lone one between two tokens and gives
back what it needs to go on as a batch row (`BatchDecoder.join`):

- its KV cache, without the last token: `generate_step` has already fed that token to the
  model (the next step runs ahead of the one just yielded), and the batch feeds it again
  (mlx-lm's batch insert needs at least one token to prefill); or, before its first token,
  the chunks of its prompt prefilled so far, the batch prefilling the rest;
- its detokenizer, holding any partly decoded character;
- its constraint's processor, rolled back by that token for the same reason.

A constrained request feeds the tokens its grammar forces together (`fast_forward`): there the
cache and the matcher may hold a whole forced group while only part of it has been given out,
or none of the last group (when it ends the request); both are cut back to what was given out
(the cache to at most all but the last token, the batch feeding what it lacks).

A request whose output must not depend on what runs beside it (a seeded sampled one) is not
placed here but on its own stream; the handover keeps greedy and unseeded requests exact up
to the batch's numerics, as a request that started in the batch would be.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from runner.engine.fast_forward import forced_steps
from runner.engine.generation import PREFILL_CHUNK, Generation
from runner.engine.masking import ConstraintProcessor
from runner.engine.prefix_cache import compact
from runner.engine.request import Request
from runner.engine.rewind import Rewinder, rewindable
from runner.engine.sampling import make_logits_processors, make_sampler_for
from runner.engine.speculative import (
    PROBE_TOKENS,
    Way,
    cache_offset,
    speculative_steps,
    with_context,
)

log = logging.getLogger("runner.engine")


@attrs.define(eq=False)
class HandOver:
    """A lone request's state as it leaves the plain cache for a batch row."""

    request: Request
    cache: list[Any]
    held: list[int]
    """The tokens its KV cache holds: the prompt and every generated token but the last."""
    pending: list[int]
    """What the batch is to feed the model next: the last generated token (or the prompt
    past what the cache holds, for a request that never stepped)."""
    detokenizer: Any
    guard: ConstraintProcessor | None
    """Its constraint's processor, at the state before the last token."""


@attrs.define(eq=False)
class _Lone:
    request: Request
    steps: Generator[tuple[Any, Any], None, None] | None
    """`generate_step`: each token (an int) and the step's log-probabilities; None while
    the prompt is prefilled a chunk per step."""
    held: int
    """Prompt tokens its cache holds before `generate_step` starts."""
    detokenizer: Any
    guard: ConstraintProcessor | None
    way: Way | None = None
    """How it decodes with the model's draft (runner.engine.speculative; None: it cannot,
    having no draft or a constraint)."""
    sampler: Any = None
    switched_at: float | None = None
    """When a probe stopped drafting (`time.perf_counter()`)."""
    drafted_tokens: int = 0
    """Of its tokens, those made while it drafted."""
    draft_cache: list[Any] | None = None
    """The draft's cache while it drafts."""
    model: Any = None
    """What it calls the model through: the model, or its `rewinder`."""
    rewinder: Rewinder | None = None
    """For a model whose cache has recurrent layers (runner.engine.rewind)."""


class SoloDecoder:
    """Runs at most one request on `generate_step` (see the module docstring)."""

    def __init__(self, generation: Generation) -> None:
        self._generation = generation
        self._eos = generation.model.eos_token_ids
        self._lone: _Lone | None = None
        # A model with a layer that neither trims nor keeps a replaceable state cannot hand
        # its lone request over: it never runs one here. Recurrent layers (LFM2's
        # convolutions) go back by snapshots (runner.engine.rewind). A rotating cache trims
        # until it passes its window; a lone request past it is not handed over
        # (`can_hand_over`).
        cache = make_prompt_cache(generation.model.model)
        self.usable = rewindable(cache)
        self._trims = can_trim_prompt_cache(cache)
        """Every layer trims; else a lone request's recurrent layers go back by snapshots
        (runner.engine.rewind)."""

    def __len__(self) -> int:
        return 0 if self._lone is None else 1

    def requests(self) -> list[Request]:
        return [] if self._lone is None else [self._lone.request]

    @property
    def nbytes(self) -> int:
        """Bytes held by the lone request's KV cache."""
        lone = self._lone
        if lone is None or lone.request.cache is None:
            return 0
        return sum(c.nbytes for c in lone.request.cache)

    def start(self, request: Request) -> None:
        assert self._lone is None, "one request at a time"
        model = self._generation.model
        cache, reused = self._generation.take_cache(request)
        request.cache = cache
        guard = request.guard()
        request.first_step_at = time.perf_counter()
        lone = _Lone(request, None, reused, model.tokenizer_for(request).detokenizer, guard)
        lone.model = model.model
        if not self._trims:
            lone.rewinder = Rewinder(model.model, cache, reused)
            lone.model = lone.rewinder
        self._lone = lone

    def _prefill_or_start(self, lone: _Lone) -> bool:
        """Prefill one chunk of a long prompt (True: that was this step), or start decoding
        from the rest. A prompt is prefilled a chunk per step, as the batch does it, so that
        a request arriving meanwhile waits one chunk, not the whole prompt, to hand this one
        over and join it in the batch."""
        request = lone.request
        cache = request.cache
        assert cache is not None
        model = self._generation.model
        rest = request.prompt[lone.held :]
        if len(rest) > PREFILL_CHUNK + 1:  # generate_step would prefill it all at once
            lone.model(mx.array([rest[:PREFILL_CHUNK]]), cache=cache)
            mx.eval([c.state for c in cache])
            lone.held += PREFILL_CHUNK
            return True
        params = request.generate.sampling
        lone.sampler = make_sampler_for(params, model.vocab_size)
        draft = model.draft
        if draft is not None and lone.guard is None and lone.rewinder is None:
            # A constrained request's matcher cannot take a round's proposals back: it
            # decodes without the draft (runner.engine.speculative).
            lone.way = draft.choose()
        if draft is not None and lone.way in ("draft", "probe"):
            lone.draft_cache = draft.cache_for(request.prompt[: lone.held])
            lone.steps = speculative_steps(
                draft,
                model.model,
                rest,
                cache,
                lone.draft_cache,
                max_tokens=request.max_tokens,
                sampler=lone.sampler,
                logits_processors=make_logits_processors(params, 1, None) or None,
                kv_quantization=model.kv_quantization,
            )
            return False
        if lone.guard is not None and lone.guard.forcing:
            # The tokens its grammar forces go in together (runner.engine.fast_forward).
            lone.steps = forced_steps(
                lone.model,
                rest,
                cache,
                guard=lone.guard,
                max_tokens=request.max_tokens,
                sampler=lone.sampler,
                logits_processors=make_logits_processors(params, len(rest)) or None,
                eos=self._eos,
                kv_quantization=model.kv_quantization,
            )
            return False
        lone.steps = generate_step(
            mx.array(rest),
            lone.model,
            max_tokens=request.max_tokens,
            sampler=lone.sampler,
            # None, not [], when there are none: mlx-lm then skips the token bookkeeping.
            logits_processors=make_logits_processors(params, len(rest), lone.guard) or None,
            prompt_cache=cache,
            prefill_step_size=PREFILL_CHUNK,
            **model.kv_quantization,
        )
        return False

    def _stop_drafting(self, lone: _Lone) -> None:
        """A probe has drafted its `PROBE_TOKENS`: go on from its last token without the
        draft, the cache cut back to what `generate_step` is to be fed again."""
        request = lone.request
        assert lone.steps is not None
        _close(request, lone.steps)  # rewinds the cache to the tokens yielded (or one fewer)
        self._keep_draft_cache(lone)
        cache = request.cache
        assert cache is not None
        _hold_all_but_last(request, cache)
        prompt, tokens = request.prompt, request.tokens
        model = self._generation.model
        params = request.generate.sampling
        processors = make_logits_processors(params, 1, None) or None
        lone.steps = generate_step(
            mx.array(tokens[-1:]),
            model.model,
            max_tokens=request.max_tokens - len(tokens),
            sampler=lone.sampler,
            # What the speculative step's processors saw: the last prompt token and every
            # token generated before this one.
            logits_processors=with_context(processors, [prompt[-1], *tokens[:-1]]),
            prompt_cache=cache,
            **model.kv_quantization,
        )
        lone.way = "plain"
        lone.switched_at = time.perf_counter()
        lone.drafted_tokens = len(tokens)

    def step(self) -> None:
        """The lone request's next token (or the next chunk of its prompt)."""
        lone = self._lone
        if lone is None:
            return
        generation = self._generation
        request = lone.request
        try:
            if lone.steps is None and self._prefill_or_start(lone):
                return
            assert lone.steps is not None
            token, logprobs = next(lone.steps)
            token = int(token)
            if request.first_token_at is None:
                request.first_token_at = time.perf_counter()
            guard = lone.guard
            if guard is not None and guard.error is not None:
                raise RuntimeError(f"constraint: {guard.error}")
            finish: str | None = None
            detokenizer = lone.detokenizer
            # As stream_generate: an end-of-sequence token adds no text; the last token
            # flushes.
            if token in self._eos:
                finish = "stop"
                detokenizer.finalize()
            else:
                if len(request.tokens) + 1 >= request.max_tokens:
                    finish = "length"
                detokenizer.add_token(token)
                if finish is not None:
                    detokenizer.finalize()
            generation.token(request, token, detokenizer.last_segment, finish, logprobs)
            if (
                lone.way == "probe"
                and len(request.tokens) >= PROBE_TOKENS
                and generation.is_running(request)
            ):
                self._stop_drafting(lone)
        except Exception as exc:  # this request ends, alone
            if generation.is_running(request):
                generation.fail(request, exc)

    def can_hand_over(self) -> bool:
        """Whether the lone request's cache can go back to before its last token, as a
        batch row needs (`hand_over`). A rotating cache past its window cannot (a sliding
        window: gpt-oss, Gemma): that request goes on alone beside the batch."""
        lone = self._lone
        if lone is None:
            return False
        request = lone.request
        cache = request.cache
        return (
            not request.tokens
            or lone.rewinder is not None
            or (cache is not None and can_trim_prompt_cache(cache))
        )

    def hand_over(self) -> HandOver | None:
        """Stop the lone request between two tokens and give back what a batch row needs
        to go on from there; None when none runs."""
        lone, self._lone = self._lone, None
        if lone is None:
            return None
        request = lone.request
        if lone.steps is not None:
            _close(request, lone.steps)
        self._keep_draft_cache(lone)
        cache = request.cache
        assert cache is not None
        request.cache = None
        prompt, tokens = request.prompt, request.tokens
        if not tokens:
            # No token yet: its cache holds the prompt's first `held` tokens (from the prefix
            # cache and the chunks prefilled so far); the batch prefills the rest.
            held = lone.held
            return HandOver(
                request, cache, prompt[:held], prompt[held:], lone.detokenizer, lone.guard
            )
        # The batch feeds the last token again, or the last few: a forced group's forward
        # pass may not have run yet (runner.engine.fast_forward).
        if lone.rewinder is not None:
            held = lone.rewinder.rewind(len(prompt) + len(tokens) - 1)
        else:
            held = _hold_all_but_last(request, cache)
        guard = lone.guard
        if guard is not None and guard.started:
            # Its matcher goes back to before the last token, which the batch's mask
            # consumes again (it may have run ahead by the rest of a forced group).
            guard.rollback(guard.consumed - (len(tokens) - 1))
        context = prompt + tokens
        return HandOver(request, cache, context[:held], context[held:], lone.detokenizer, guard)

    def _keep_draft_cache(self, lone: _Lone) -> None:
        """The draft's cache, its step closed, kept for the conversation's next turn."""
        draft, cache = self._generation.model.draft, lone.draft_cache
        lone.draft_cache = None
        if draft is not None and cache is not None:
            request = lone.request
            draft.keep(request.prompt + request.tokens, cache)

    def snapshot(self, request: Request) -> list[Any] | None:
        return None if request.cache is None else compact(request.cache, len(request.prompt))

    def release(self, request: Request) -> None:
        lone = self._lone
        if lone is None or lone.request is not request:
            return
        self._lone = None
        # Its cache stays in request.cache: the prompt and every generated token (the step
        # that ran ahead has fed the last one), or fewer (a speculative step, a forced group
        # not yet fed), or more (a forced group cut by a stop string): cut back to them.
        if lone.steps is not None:
            _close(request, lone.steps)
        if request.cache is not None:
            cut_to_made(request, request.cache)
        self._keep_draft_cache(lone)
        draft = self._generation.model.draft
        started = request.first_token_at
        if draft is not None and lone.way is not None and started is not None:
            # Its decode rates, with the draft and without, for the next requests' ways.
            now, made = time.perf_counter(), len(request.tokens)
            switched = lone.switched_at
            if switched is not None:
                draft.observe(True, lone.drafted_tokens - 1, switched - started)
                draft.observe(False, made - lone.drafted_tokens, now - switched)
            else:
                draft.observe(lone.way != "plain", made - 1, now - started)

    def drop_all(self) -> None:
        lone, self._lone = self._lone, None
        if lone is not None and lone.steps is not None:
            _close(lone.request, lone.steps)


def cut_to_made(request: Request, cache: list[Any]) -> None:
    """Cut `cache` back to the request's prompt and the tokens it gave, where it holds more
    (a forced run fed past a stop string) and can be cut (a sliding window past its size
    cannot; the prefix cache then keeps nothing of it)."""
    if can_trim_prompt_cache(cache):
        made = len(request.prompt) + len(request.tokens)
        trim_prompt_cache(cache, max(cache_offset(cache) - made, 0))


def _hold_all_but_last(request: Request, cache: list[Any]) -> int:
    """Cut `cache` back to at most the prompt and every generated token but the last, and
    give the number of tokens it then holds: generate_step has fed the last one (it runs a
    step ahead), a closed speculative step holds it or not (runner.engine.speculative), a
    forced group holds all of it or none (runner.engine.fast_forward); whoever goes on feeds
    what it does not hold."""
    held = min(cache_offset(cache), len(request.prompt) + len(request.tokens) - 1)
    trim_prompt_cache(cache, cache_offset(cache) - held)
    return held


def _close(request: Request, steps: Generator[Any, None, None]) -> None:
    """Close the generator here, on the generation thread, not whenever it is collected."""
    try:
        steps.close()
    except Exception:
        log.exception("closing the generation steps of %s", request.request_id)
