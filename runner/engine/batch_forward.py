"""Forced text in a batch step: a constrained row is fed the tokens its grammar forces in
one forward pass, as a lone request is (runner.engine.fast_forward).

mlx-lm's `BatchGenerator` steps one token a row, and runs a step ahead: a step's forward
pass is started before the tokens of the step before are read on the host. Past a sampled
token the grammar's forced run f1…fn is looked up while the next forward pass runs, and that
step's mask allows f1 alone (`ConstraintProcessor.forced_next`). So at the next step the row's
token is known to be f1 without reading it, and f2…fn go into the same forward pass, after
it; the next token is sampled from the logits at the row's last real position. A run costs
two steps instead of n, and the step ahead is kept (reading the sampled token first would
stall every step: 0.76 of free text's rate on glm47 at 8 streams, against 0.89 masking a
token at a time).

Rows fed runs of different lengths go in one call as mlx-lm's prompt processing feeds prompts
of different lengths: right-padded, then each layer's cache rolls the padding to its left
(`prepare(right_padding=…)`, `finalize()`), where the attention mask hides it; a recurrent
layer is told each row's length. Every token
still comes out on its own (`BatchDecoder.step` emits a row's fed tokens after its token of
the step), counted, cut by stop strings; `max_tokens` leaves room for the sampled token after
them.

A row is fed only where the result is the token-at-a-time decode's:

- its processor forces (`ConstraintProcessor.forcing`: no logprobs, no logit bias) and it
  has no logits processors (penalties see the token context, which the batch builds a
  token a step);
- the step is the batch's own (`GenerationBatch.next`), not a joining row's first step,
  whose tokens the batch does not hand back;
- every layer's cache is one mlx-lm's prompt processing pads (`FEEDABLE_CACHES`): plain
  attention, a sliding window, a recurrent state.

Feeding costs padding: a row fed fewer tokens than the widest (a free row: none) computes
padding positions, and the step's caches are rolled. The width is cut until at least
`MIN_REAL` of the step's inputs are real tokens (most of them on a CPU), and a step that
would pad caches over `ROLL_BYTES` feeds nothing (docs/benchmarks.md §6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

MAX_FED = 16
"""The most forced tokens a row is fed in one step."""
MIN_REAL = 0.9 if mx.default_device() == mx.cpu else 0.5
"""The least share of a step's inputs (rows times width) that are real tokens, not padding.
On a CPU a forward pass costs about its tokens, padding included: fed at 0.6 real,
qwen3-coder's json_schema rows at 8 streams ran at 0.81 of free text, at 0.95 real 1.13
(docs/benchmarks.md §6). On a GPU a decode step reads the weights once for all its tokens,
so padding costs little there (not measured yet: no GPU lent to this project so far)."""
ROLL_BYTES = 256 * 2**20
"""The most KV-cache bytes a padded step rolls (a copy of every layer's keys and values)."""

BATCH_NEXT = GenerationBatch.next.__code__
"""The code of mlx-lm's `GenerationBatch.next`: the caller of a step whose tokens come back."""


class Forcing(Protocol):
    """What a row's processor tells about feeding it (`masking.ConstraintProcessor`)."""

    forcing: bool
    started: bool
    error: str | None

    def upcoming(self) -> list[int]: ...


def feedable(batch: Any, index: int, processor: Forcing) -> bool:
    """Whether row `index` of `batch` (a `GenerationBatch`) may be fed forced tokens."""
    return (
        processor.forcing
        and processor.started
        and processor.error is None
        and not (batch.logits_processors and batch.logits_processors[index])
    )


def plan(batch: Any, rows: Sequence[tuple[int, Forcing]]) -> dict[int, list[int]]:
    """The tokens to feed each row (by batch index; none where absent) after its token of
    this step: the rest of its forced run, at most `MAX_FED` and two fewer than its
    `max_tokens` leave (this step's token and the sampled one after), cut to a width worth
    its padding."""
    runs = {}
    for index, processor in rows:
        room = batch.max_tokens[index] - batch._num_tokens[index] - 2
        if room > 0:
            run = processor.upcoming()[: min(MAX_FED, room)]
            if run:
                runs[index] = run
    if not runs:
        return {}
    size = len(batch.uids)
    width = 1 + max(len(run) for run in runs.values())
    while width > 1 and size + sum(min(len(run), width - 1) for run in runs.values()) < (
        MIN_REAL * size * width
    ):
        width -= 1
    if width == 1:
        return {}
    fed = {index: run[: width - 1] for index, run in runs.items()}
    padded = len(fed) < size or any(len(run) < width - 1 for run in fed.values())
    if padded and _kv_bytes(batch.prompt_cache) > ROLL_BYTES:
        return {}
    return fed


FEEDABLE_CACHES = (BatchKVCache, BatchRotatingKVCache, ArraysCache)
"""The batch caches a padded multi-token step is checked on: plain attention, a sliding
window (gpt-oss, Gemma), recurrent states (LFM2), as mlx-lm's prompt processing pads them."""


def padded_steps(cache: list[Any]) -> bool:
    """Every layer's cache takes a padded multi-token step (`FEEDABLE_CACHES`)."""
    return bool(cache) and all(type(layer) in FEEDABLE_CACHES for layer in cache)


def forward(model: Any, inputs: Any, extras: list[list[int]], cache: list[Any]) -> Any:
    """One forward pass over each row's token of the step (`inputs`, (rows, 1), on the
    device) and its `extras`, right-padded to the longest: the logits (rows, 1, vocab) at
    each row's last token."""
    width = 1 + max(len(extra) for extra in extras)
    padding = [width - 1 - len(extra) for extra in extras]
    rest = mx.array([extra + [0] * pad for extra, pad in zip(extras, padding, strict=True)])
    tokens = mx.concatenate([inputs, rest.astype(inputs.dtype)], axis=1)
    if any(padding):
        lengths = [1 + len(extra) for extra in extras]
        for layer in cache:
            layer.prepare(right_padding=padding, lengths=lengths)
    logits = model(tokens, cache=cache)
    if any(padding):
        for layer in cache:
            layer.finalize()
    last = mx.array([len(extra) for extra in extras])
    return logits[mx.arange(len(extras)), last][:, None, :]


def _kv_bytes(cache: list[Any]) -> int:
    """Bytes of the keys and values a padded step rolls."""
    total = 0
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and values is not None:
            total += keys.nbytes + values.nbytes
    return total
