"""A constrained request's masks at decode time: its processor (the matcher of one run, the
tokens its grammar forces) and a batch's constrained rows, masked together, with llguidance.

    ConstraintProcessor(tokens, logits)        an mlx-lm logits processor, run after all others
                                               (a lone `stream_generate`); also the state of a
                                               batch row and of a lone request's forced steps
                                               (runner.engine.fast_forward)
    BatchConstraints                           the batch decoder's: its constrained rows,
                                               masked together once a step, inside the model
                                               call (`wrap`), and fed their forced tokens
                                               there (runner.engine.batch_forward)

A request's grammar is compiled at intake (runner.engine.constraint); each run decodes on a
copy of its matcher (`Constraint.processor`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationBatch

from runner.engine import batch_forward


class ConstraintProcessor:
    """The mlx-lm logits processor of one constrained run: masks every disallowed token.

    mlx-lm calls it once per generated token, with the token context so far: on the first
    call the prompt (or only its part after the prefix cache), then with the token just
    sampled appended, which the matcher consumes before the next mask is computed. The
    token is read before this step's forward pass is started (`mx.async_eval`), so the mask
    is computed while the forward pass runs. A row of a batch is not called: its
    `BatchConstraints` advances and masks it with the batch's other rows.

    Neither raises (an exception inside a batch step would fail every row of the batch): if
    the matcher refuses a token, `error` says why and only end-of-sequence tokens are allowed
    from then on; the decoder then fails this request alone.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos: list[int],
        *,
        forcing: bool = True,
    ) -> None:
        self.error: str | None = None
        self.matcher = matcher
        self.eos = eos
        self.started = False
        """Past its first call (the one on the prompt)."""
        self.consumed = 0
        """Tokens the matcher has consumed (sampled and forced), less those rolled back."""
        self.words = (vocab_size + 31) // 32
        """32-bit words in a mask."""
        self._bitmask = np.zeros((1, self.words), dtype=np.int32)
        self._queue: list[int] = []
        """Forced tokens still to come, in order (see `forced_next`)."""
        self._run: list[int] = []
        """The forced tokens consumed since the last sampled one."""
        self._fresh = True
        """At the start or just past a sampled token: the forced tokens are to be looked up."""
        self.forcing = forcing
        """Whether forced text is written in canonical tokens (else the model spells it)."""

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if not self.started:
            self.started = True
        else:
            # Read the new token first: evaluated after the forward pass, it would wait for it.
            self.consume(int(tokens[-1].item()))
            mx.async_eval(logits)  # type: ignore[no-untyped-call]  # mlx's stub lacks types
        return self.masked(logits, self.bits())

    def bits(self) -> np.ndarray[Any, Any] | None:
        """The next token's mask (1, words), computed on the host; None once the matcher has
        failed (`error` says why)."""
        if self.error is None:
            bitmask = self._bitmask
            token = self.forced_next()
            if token is not None:
                bitmask[:] = 0
                bitmask.view(np.uint32)[0, token // 32] = np.uint32(1 << (token % 32))
                return bitmask
            self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            if not self.matcher.is_error():
                return bitmask
            self.error = self.matcher.get_error()
        return None

    def masked(self, logits: Any, bits: np.ndarray[Any, Any] | None) -> Any:
        """`logits` (1, vocab) keeping what `bits` allow (only end of sequence for None)."""
        return _only(logits, self.eos) if bits is None else apply_bitmask(logits, bits)

    def forced_next(self) -> int | None:
        """The next token when the grammar forces it, else None (the model chooses).

        Forced text is written in the tokenizer's canonical tokens (llguidance's fast-forward
        tokens), looked up once past each sampled token: the same rule as a lone request
        feeding them in one step (`forced`, runner.engine.fast_forward), so that a request
        writes the same tokens alone, in a batch row or handed from one to the other.
        """
        if self.error is not None:
            return None
        if self._fresh:
            self._fresh = False
            self._queue = self._lookup(None)
        return self._queue[0] if self._queue else None

    def upcoming(self) -> list[int]:
        """The forced tokens after the one its last mask forced (none if that mask forced
        nothing): what a batch row may be fed with that token."""
        return [] if self._fresh or self.error is not None else self._queue[1:]

    def consume(self, token: int) -> None:
        """Advance the matcher by the token just sampled (or forced)."""
        if self.error is None:
            if self.matcher.consume_token(token):
                self.consumed += 1
            else:
                self.error = f"the grammar refused token {token}: {self.matcher.get_error()}"
        if self._queue and self._queue[0] == token:
            self._run.append(self._queue.pop(0))
        else:
            self._queue, self._run, self._fresh = [], [], True

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (at most `limit`; see `forced_next`), consumed
        at once: a lone request feeds them to the model in one step."""
        tokens = self._queue if not self._fresh else self._lookup(limit)
        tokens = tokens[:limit]
        self._fresh, self._queue = False, []
        if self.error is not None or not tokens:
            return []
        if not self.matcher.consume_tokens(tokens):
            self.error = f"the grammar refused its forced tokens: {self.matcher.get_error()}"
            return []
        self.consumed += len(tokens)
        self._run.extend(tokens)
        return tokens

    def _lookup(self, limit: int | None) -> list[int]:
        """llguidance's fast-forward tokens here, none past an end of sequence."""
        if self.error is not None or limit == 0 or not self.forcing:
            return []
        tokens = self.matcher.compute_ff_tokens()
        for i, token in enumerate(tokens):
            if token in self.eos:
                return tokens[:i]
        return tokens

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` consumed (a request going on elsewhere feeds them again).
        Forced tokens rolled back are forced again; past a sampled token, the model chooses
        again."""
        if self.error is not None or tokens <= 0:
            return
        self.matcher.rollback(tokens)
        self.consumed -= tokens
        run = self._run
        if tokens <= len(run):
            self._queue = run[len(run) - tokens :] + self._queue
            self._run = run[: len(run) - tokens]
            self._fresh = False
        else:  # back before the last sampled token: looked up again once it is consumed
            self._queue, self._run, self._fresh = [], [], False


class BatchConstraints:
    """The constrained rows of one mlx-lm `BatchGenerator`, masked together, once a step.

    The generator is built on `wrap(model)`. Its prefill calls pass through untouched; a
    generation step's call (from mlx-lm's `GenerationBatch._step`, found by its caller's
    code object) starts the forward pass (`mx.async_eval`), reads the tokens the step was
    given (the rows' tokens just sampled: scheduled by the previous step, the read waits
    for that step, not for this one), advances every constrained row's matcher by its
    token, computes their masks while the forward pass runs (on llguidance's threads, given
    4 cores or more), and returns the logits with one `mx.where` over the whole batch: a
    constrained row keeps only what its grammar allows, any other row keeps everything.

    When a row can be fed the tokens its grammar forces (runner.engine.batch_forward), the
    step reads the sampled tokens first instead: the forced ones go into this forward pass,
    after them, and the masks are those past the forced text.

    So the constraint needs no per-row logits processor, and a batch of requests without
    bias or penalties steps without mlx-lm's per-row slicing, token contexts and
    concatenation. The mask comes before those processors (logit bias, penalties): they
    move finite logits and leave -inf where it is, so the result is the same as masking
    after them. The step's rows are the calling batch's `uids`, in order, and their tokens
    its `_current_tokens`; a row's count of tokens is its `_num_tokens` (mlx-lm 0.32's
    names, checked by the tests).
    """

    def __init__(self) -> None:
        self._rows: dict[int, ConstraintProcessor] = {}
        self.fed: dict[int, list[int]] = {}
        """The forced tokens each row (by uid) was fed after its sampled one in the last
        step, for the decoder to emit after that token."""

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, uid: int, processor: ConstraintProcessor) -> None:
        self._rows[uid] = processor

    def remove(self, uid: int) -> None:
        self._rows.pop(uid, None)
        self.fed.pop(uid, None)

    def clear(self) -> None:
        self._rows.clear()
        self.fed.clear()

    def wrap(self, model: Any) -> _MaskedModel:
        """`model` as the batch generator is to call it."""
        return _MaskedModel(model, self)

    def step(
        self, model: Any, batch: Any, inputs: Any, kwargs: dict[str, Any], *, own: bool
    ) -> Any:
        """A generation step's model call for `batch` (an mlx-lm `GenerationBatch`; `own`:
        called by its `next`, not a joining row's first step): the logits of its rows, the
        constrained ones masked. A row whose token in this step is one its grammar forced
        is fed the rest of that forced run with it (runner.engine.batch_forward), which is
        known without waiting for the step before; what each row was fed is in `fed`."""
        uids = batch.uids
        found = self._found(uids)
        cache = kwargs.get("cache")
        runs: dict[int, list[int]] = {}
        if not isinstance(cache, list):
            cache = []  # not the batch's own call (its caches are a list): nothing is fed
        if found and own and batch_forward.padded_steps(cache):
            feedable = [(i, p) for i, p in found if batch_forward.feedable(batch, i, p)]
            runs = batch_forward.plan(batch, feedable) if feedable else {}
        if not runs:
            return self.mask(uids, batch._current_tokens, model(inputs, **kwargs))
        extras = [runs.get(i, []) for i in range(len(uids))]
        logits = batch_forward.forward(model, inputs, extras, cache)
        mx.async_eval(logits)  # type: ignore[no-untyped-call]  # mlx's stub lacks types
        try:
            self._advance(found, batch._current_tokens.tolist())
            for i, run in runs.items():
                processor = self._rows[uids[i]]
                if processor.forced(len(run)) != run:  # the step's token was not the forced one
                    processor.error = (
                        processor.error or "the batch fed text the grammar did not force"
                    )
                batch._num_tokens[i] += len(run)
                self.fed[uids[i]] = run
        except Exception as exc:  # e.g. mlx-lm's internals changed: end the rows, loudly
            self._fail(found, exc)
        return self._apply(uids, found, logits)

    def mask(self, uids: list[int], tokens: Any, logits: Any) -> Any:
        """A generation step's `logits` (rows, 1, vocab) for the rows `uids`, with the
        constrained rows masked. `tokens` (rows,) are the tokens the step was given, as the
        previous step scheduled them: not the model's input, which is part of this step's
        graph (reading it would wait for this whole forward pass)."""
        found = self._found(uids)
        if not found:
            return logits
        # Start this step's forward pass first: it takes the new tokens as they are, on the
        # device; reading them then only waits for the previous step.
        mx.async_eval(logits)  # type: ignore[no-untyped-call]  # mlx's stub lacks types
        try:
            self._advance(found, tokens.tolist())
        except Exception as exc:  # e.g. mlx-lm's internals changed: end the rows, loudly
            self._fail(found, exc)
        return self._apply(uids, found, logits)

    def _found(self, uids: list[int]) -> list[tuple[int, ConstraintProcessor]]:
        """The constrained rows among `uids`: (index, processor)."""
        rows = self._rows
        return [(i, rows[uid]) for i, uid in enumerate(uids) if uid in rows]

    @staticmethod
    def _advance(found: list[tuple[int, ConstraintProcessor]], given: list[int]) -> None:
        """Advance each row's matcher by its token of this step."""
        for i, processor in found:
            if processor.started:
                processor.consume(given[i])
            else:  # its first token: the matcher is at the grammar's start
                processor.started = True

    @staticmethod
    def _fail(found: list[tuple[int, ConstraintProcessor]], exc: Exception) -> None:
        for _, processor in found:
            processor.error = processor.error or f"masking the batch's rows failed: {exc!r}"

    def _apply(
        self, uids: list[int], found: list[tuple[int, ConstraintProcessor]], logits: Any
    ) -> Any:
        """`logits` with each constrained row keeping what its grammar allows next."""
        processors = [processor for _, processor in found]
        try:
            masks = _masks(processors)
        except Exception as exc:
            self._fail(found, exc)
            masks = _masks(processors)
        allowed = _unpack(masks, logits.shape[-1])
        if len(found) < len(uids):
            # Rows without a constraint allow every token (past the masks' width too).
            every = np.ones((len(uids), logits.shape[-1]), dtype=np.bool_)
            every[[i for i, _ in found]] = allowed
            allowed = every
        return mx.where(mx.array(allowed[:, None, :]), logits, -mx.inf)


def _masks(processors: list[ConstraintProcessor]) -> np.ndarray[Any, Any]:
    """The processors' next-token masks, a row each (only end-of-sequence tokens for a
    processor whose matcher failed)."""
    words = max(p.words for p in processors)
    bitmask = np.zeros((len(processors), words), dtype=np.int32)
    work = []
    for i, processor in enumerate(processors):
        if processor.error is None:
            token = processor.forced_next()
            if token is None:
                work.append((processor.matcher, i))
            else:  # the grammar forces it: one bit, no mask to compute
                bitmask.view(np.uint32)[i, token // 32] = np.uint32(1 << (token % 32))
    if len(work) > 1 and _PARALLEL_MASKS:
        _executor().unsafe_compute_mask_ptr(work, bitmask.ctypes.data, words * 4, len(bitmask))
    else:
        for matcher, i in work:
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * words * 4, words * 4)
    for i, processor in enumerate(processors):
        if processor.error is None and processor.matcher.is_error():
            processor.error = processor.matcher.get_error()
        if processor.error is not None:
            bits = bitmask.view(np.uint32)
            bits[i] = 0
            for token in processor.eos:
                bits[i, token // 32] |= np.uint32(1 << (token % 32))
    return bitmask


_GENERATION_STEP = GenerationBatch._step.__code__
"""The code of mlx-lm's batch generation step, whose model call `_MaskedModel` masks."""


class _MaskedModel:
    """A model whose generation steps in a `BatchGenerator` return masked logits (see
    `BatchConstraints`); every other use (prefill, attributes) is the model's own."""

    def __init__(self, model: Any, constraints: BatchConstraints) -> None:
        self.model = model
        self._constraints = constraints

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        constraints = self._constraints
        if constraints and not args:
            caller = sys._getframe(1)
            if caller.f_code is _GENERATION_STEP:  # else a prefill chunk, not sampled
                batch = caller.f_locals["self"]
                own = caller.f_back is not None and caller.f_back.f_code is batch_forward.BATCH_NEXT
                return constraints.step(self.model, batch, inputs, kwargs, own=own)
        return self.model(inputs, *args, **kwargs)


_PARALLEL_MASKS = (os.cpu_count() or 1) >= 4
"""Compute a batch's masks on llguidance's thread pool. On 2 cores (bench.grammars, §6 of
docs/benchmarks.md) its batch call was no faster than one mask after another, and up to 3x
slower while the forward pass and other processes wanted the same cores."""
_executors: list[llguidance.LLExecutor] = []


def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool, made on first use."""
    if not _executors:
        _executors.append(llguidance.LLExecutor())
    return _executors[0]


def _unpack(bitmask: np.ndarray[Any, Any], vocab: int) -> np.ndarray[Any, Any]:
    """A (rows, vocab) bool array from (rows, words) bits, little-endian within each word;
    tokens past the mask are refused."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little").view(np.bool_)
    if allowed.shape[-1] >= vocab:
        return allowed[:, :vocab]
    return np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[-1])))


def apply_bitmask(logits: Any, bitmask: np.ndarray[Any, Any]) -> Any:
    """`logits` (1, vocab) with every token whose bit is 0 set to -inf.

    The bits are unpacked on the host (numpy, ~1 ns a token) and applied with one `mx.where`,
    which keeps the logits' dtype. A vocabulary wider than the mask (a model's padded
    embedding) has its extra tokens disallowed.
    """
    return mx.where(mx.array(_unpack(bitmask, logits.shape[-1])), logits, -mx.inf)


def _only(logits: Any, tokens: list[int]) -> Any:
    allowed = np.zeros((1, logits.shape[-1]), dtype=np.bool_)
    allowed[0, [t for t in tokens if t < logits.shape[-1]]] = True
    return mx.where(mx.array(allowed), logits, -mx.inf)
