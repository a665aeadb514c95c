"""Batched decoding: the running requests are rows of one mlx-lm `BatchGenerator`.

`step` is one `BatchGenerator.next()`: one forward pass decodes a token for every row, and
prompts inserted since the last step are prefilled in the same call, so a late request
starts its prefill at the next step. Each row is detokenized here, as `stream_generate` does,
and its token goes to `Generation.token`.

Requests with the same sampling settings share one sampler object, so the batch samples them
in one call. A sampled row's draws then depend on what runs alongside it: requests with a
seed must not come here (see `batched.needs_own_stream`).

With `--kv-bits` the rows still run on plain caches (mlx-lm's batch has no quantized one:
`runner.engine.kv_quant`): a quantized cache is dequantized as it joins, and a row's cache is
quantized as it leaves to be kept.

An error while handling one row's token fails that request alone. An error inside the batch's
own step (the forward pass) leaves the batch in an unknown state: every row of it fails, and a
fresh batch serves what comes next.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from protocol.frames import SamplingParams
from runner.engine.generation import Generation
from runner.engine.kv_quant import dequantized, quantized
from runner.engine.masking import BatchConstraints, ConstraintProcessor
from runner.engine.request import Request
from runner.engine.sampling import Sampler, make_logits_processors, make_sampler_for
from runner.engine.solo import HandOver, cut_to_made

log = logging.getLogger("runner.engine.batched")

PREFILL_MIN_CHUNK = 16
"""The fewest tokens of each prompt a step prefills, however many prompts share the budget."""
COST_WEIGHT = 0.2
"""The weight of the newest figure in the moving averages of step and token costs."""


@attrs.define(eq=False)
class _Row:
    """A request's place in the batch."""

    request: Request
    uid: int
    detokenizer: Any
    guard: ConstraintProcessor | None
    """Its constraint's logits processor, if it has one."""


class BatchDecoder:
    """Runs requests as the rows of one `BatchGenerator` (see the module docstring)."""

    def __init__(
        self,
        generation: Generation,
        *,
        max_concurrent: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        prefill_share: float | None = None,
    ) -> None:
        self._generation = generation
        self._model = generation.model
        self._eos = generation.model.eos_token_ids
        self._max_concurrent = max_concurrent
        self._prefill_batch_size = min(prefill_batch_size, max_concurrent)
        self._prefill_step_size = prefill_step_size
        self._prefill_share = prefill_share
        self._step_cost = 0.0
        """Seconds a decode step takes (a moving average over steps without prefill)."""
        self._token_cost = 0.0
        """Seconds a prompt token takes to prefill (a moving average)."""
        self.decoding_elsewhere = False
        """Set by the strategy: requests outside the batch are decoding (their pace counts
        too when the batch prefills)."""
        self._samplers: dict[tuple[float, float, float, int], Sampler] = {}
        self._rows: dict[str, _Row] = {}
        self._by_uid: dict[int, _Row] = {}
        self._constraints = BatchConstraints()
        self._masked_model = self._constraints.wrap(self._model.model)
        # Any: several of BatchGenerator's methods are unannotated.
        self._batch: Any = self._new_batch()

    def _new_batch(self) -> BatchGenerator:
        return BatchGenerator(
            self._masked_model,
            max_tokens=self._model.context_length,
            stop_tokens=[[t] for t in sorted(self._eos)],
            completion_batch_size=self._max_concurrent,
            prefill_batch_size=self._prefill_batch_size,
            prefill_step_size=self._prefill_step_size,
        )

    def __len__(self) -> int:
        return len(self._rows)

    def requests(self) -> list[Request]:
        """The requests in the batch, in the order they joined."""
        return [row.request for row in self._rows.values()]

    @property
    def nbytes(self) -> int:
        """Bytes held by the batch's KV caches (rows waiting for prefill included)."""
        return int(self._batch.prompt_cache_nbytes)

    def start(self, request: Request) -> None:
        """Insert a request: its prompt is prefilled in the next step."""
        cache, reused = self._generation.take_cache(request)
        guard = request.guard()
        request.first_step_at = time.perf_counter()
        detokenizer = self._model.tokenizer_for(request).detokenizer
        self._insert(
            request,
            cache,
            held=request.prompt[:reused],
            pending=request.prompt[reused:],
            detokenizer=detokenizer,
            guard=guard,
        )

    def join(self, handover: HandOver) -> None:
        """Go on with a request that ran alone (`solo.SoloDecoder.hand_over`): its cache,
        detokenizer and constraint state carry over, and the next step feeds its last
        token."""
        request = handover.request
        self._generation.moved(request, self)
        self._insert(
            request,
            handover.cache,
            held=handover.held,
            pending=handover.pending,
            detokenizer=handover.detokenizer,
            guard=handover.guard,
        )

    def _insert(
        self,
        request: Request,
        cache: list[Any],
        *,
        held: list[int],
        pending: list[int],
        detokenizer: Any,
        guard: ConstraintProcessor | None,
    ) -> None:
        """A row for `request`: `cache` holds the tokens `held`, `pending` go in next."""
        params = request.generate.sampling
        cache = dequantized(cache)  # mlx-lm's batch cannot merge a quantized cache
        # The batch's token context is the whole prompt (`held` + `pending`, then the
        # generated tokens), so the penalties skip the prompt. A constraint is not a
        # processor here: the batch's model call masks its rows (BatchConstraints).
        processors = make_logits_processors(params, len(request.prompt))
        (uid,) = self._batch.insert(
            [pending],
            max_tokens=[request.max_tokens - len(request.tokens)],
            caches=[cache],
            all_tokens=[list(held)],
            samplers=[self._shared_sampler(params)],
            logits_processors=[processors],
        )
        row = _Row(request, uid, detokenizer, guard)
        if guard is not None:
            self._constraints.add(uid, guard)
        self._rows[request.request_id] = row
        self._by_uid[uid] = row

    def _shared_sampler(self, params: SamplingParams) -> Sampler:
        """One sampler object per distinct setting: the batch then samples in one call."""
        key = (params.temperature, params.top_p, params.min_p, params.top_k)
        if params.temperature <= 0:
            key = (0.0, 0.0, 0.0, 0)
        sampler = self._samplers.get(key)
        if sampler is None:
            sampler = self._samplers[key] = make_sampler_for(params, self._model.vocab_size)
        return sampler

    def step(self) -> None:
        """One batch step: decode a token for every row, prefill what joined."""
        generation = self._generation
        self._budget_prefill()
        try:
            with self._batch.stats() as stats:
                _, responses = self._batch.next()
        except Exception as exc:
            self._fail_batch(exc)
            return
        self._learn_costs(stats)
        fed = self._constraints.fed
        if fed:
            self._record_fed(fed)
        now = time.perf_counter()
        by_uid = self._by_uid
        for response in responses:
            row = by_uid.get(response.uid)
            if row is None:
                continue
            request = row.request
            if request.first_token_at is None:
                request.first_token_at = now
            forced = fed.pop(row.uid, ())
            try:
                finish = response.finish_reason
                if finish is not None:
                    # The batch has dropped the row already and hands back its cache.
                    del self._rows[request.request_id], by_uid[row.uid]
                    if row.guard is not None:
                        self._constraints.remove(row.uid)
                    request.cache = self._kept(response.prompt_cache)
                if row.guard is not None and row.guard.error is not None:
                    raise RuntimeError(f"constraint: {row.guard.error}")
                self._emit(row, int(response.token), finish, response.logprobs)
                # The forced tokens fed after it (runner.engine.batch_forward), one by one;
                # a stop string may end the request among them.
                for token in forced:
                    if not generation.is_running(request):
                        break
                    self._emit(row, token, None, None)
            except Exception as exc:
                # One row's failure (detokenizer, accounting) ends that request only; the
                # other rows of this step still get their tokens.
                if generation.is_running(request):
                    generation.fail(request, exc)
        fed.clear()

    def _emit(self, row: _Row, token: int, finish: str | None, logprobs: Any) -> None:
        """One token of a row to its request, detokenized as `stream_generate` does: an
        end-of-sequence token adds no text; the last token flushes."""
        detokenizer = row.detokenizer
        if token in self._eos:
            detokenizer.finalize()
        else:
            detokenizer.add_token(token)
            if finish is not None:
                detokenizer.finalize()
        self._generation.token(row.request, token, detokenizer.last_segment, finish, logprobs)

    def _record_fed(self, fed: dict[int, list[int]]) -> None:
        """Add the forced tokens fed in the last step to the batch's record of what each
        row's cache holds (mlx-lm added the sampled token before them)."""
        batch = self._batch._generation_batch
        for index, uid in enumerate(batch.uids):
            run = fed.get(uid)
            if run:
                batch.tokens[index].extend(run)

    def _budget_prefill(self) -> None:
        """Bound this step's prefill while requests decode, so that a burst of arrivals
        costs running streams many slightly longer steps, not a few long stalls: a step's
        prefill gets a token budget worth `prefill_share` decode steps, from the measured
        costs of both (`_learn_costs`). With nothing decoding, prompts are prefilled as
        configured (up to `prefill_batch_size` together, `prefill_step_size` tokens each
        per step: the fewest steps to their first tokens).

        mlx-lm's batch prefills up to its `prefill_batch_size` prompts together, at most its
        `prefill_step_size` tokens of each per step; both are set here, each step: as many
        prompts as the budget has room for at `PREFILL_MIN_CHUNK` tokens each, sharing it."""
        share = self._prefill_share
        if share is None:
            return
        batch = self._batch
        waiting = sum(1 for row in self._rows.values() if row.request.first_token_at is None)
        decoding = self.decoding_elsewhere or len(self._rows) > waiting
        if waiting and decoding and self._step_cost > 0 and self._token_cost > 0:
            budget = max(PREFILL_MIN_CHUNK, int(share * self._step_cost / self._token_cost))
            prompts = max(1, min(waiting, budget // PREFILL_MIN_CHUNK, self._prefill_batch_size))
            batch.prefill_batch_size = prompts
            batch.prefill_step_size = min(
                self._prefill_step_size, max(PREFILL_MIN_CHUNK, budget // prompts)
            )
        else:
            batch.prefill_batch_size = self._prefill_batch_size
            batch.prefill_step_size = self._prefill_step_size

    def _learn_costs(self, stats: Any) -> None:
        """Update the moving averages of a decode step's and a prompt token's cost from one
        step's figures (mlx-lm's `BatchStats`)."""
        if stats.prompt_tokens >= PREFILL_MIN_CHUNK:
            cost = stats.prompt_time / stats.prompt_tokens
            self._token_cost = _average(self._token_cost, cost)
        elif stats.generation_steps and not stats.prompt_tokens:
            self._step_cost = _average(self._step_cost, stats.decode_time)

    def _fail_batch(self, exc: Exception) -> None:
        """The batch's own step failed: its state is unknown, so fail every row of it and
        start a fresh batch."""
        log.exception("batch step failed")
        failed = [row.request for row in self._rows.values()]
        self._rows.clear()
        self._by_uid.clear()
        self._constraints.clear()
        self._batch.close()
        self._batch = self._new_batch()
        for request in failed:
            self._generation.fail(request, exc)

    def snapshot(self, request: Request) -> list[Any] | None:
        row = self._rows.get(request.request_id)
        if row is None:
            return None
        try:
            # A copy of the row's part of the batch's caches (mlx-lm's extract copies).
            cache, _ = self._batch.extract_cache([row.uid])[row.uid]
        except Exception:
            log.exception("copying the prompt cache of %s", request.request_id)
            return None
        extra = (getattr(cache[0], "offset", 0) if cache else 0) - len(request.prompt)
        if extra < 0 or not can_trim_prompt_cache(cache):
            return None
        if extra:
            trim_prompt_cache(cache, extra)
        return self._kept(list(cache))

    def _kept(self, cache: list[Any] | None) -> list[Any] | None:
        """A row's cache as the prefix cache is to keep it: quantized as a lone request's
        would be (`--kv-bits`)."""
        if cache is None:
            return None
        return quantized(cache, self._model.kv_quantization)

    def release(self, request: Request) -> None:
        """Take a request's row out of the batch (if still there), keeping its KV cache."""
        row = self._rows.pop(request.request_id, None)
        if row is None:
            return
        del self._by_uid[row.uid]
        self._constraints.remove(row.uid)
        try:
            caches = self._batch.remove([row.uid], return_prompt_caches=True)
        except Exception:
            # A row with nothing prefilled yet has no cache to extract; drop it without one.
            self._batch.remove([row.uid])
            caches = {}
        cache, _ = caches.get(row.uid, (None, None))
        if cache:
            cut_to_made(request, cache)  # forced tokens fed past a stop string
        request.cache = self._kept(cache)

    def drop_all(self) -> None:
        self._rows.clear()
        self._by_uid.clear()
        self._constraints.clear()
        self._batch.close()


def _average(mean: float, value: float) -> float:
    """An exponential moving average's next value (the first value as it is)."""
    return value if mean <= 0 else mean + COST_WEIGHT * (value - mean)
