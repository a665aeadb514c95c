"""A constrained lone request that feeds the tokens its grammar forces in one step.

Much of a constrained answer is fixed by its grammar: a JSON Schema's keys, quotes, commas
and brackets, a forced call's name and markers. Sampling those one at a time costs a
forward pass and a mask each, for tokens the model has no say in. llguidance computes them
(`LLMatcher.compute_ff_tokens`: the forced text in the tokenizer's canonical tokenization),
so after each sampled token the lone request (`runner.engine.solo`) appends the forced ones
and feeds them all to the model in one call, as a prompt chunk is fed; the next token is
sampled from the last position's logits. On the built-in models' json_schema answers about
three tokens in four are forced (docs/benchmarks.md §6).

What the client sees is what a token-at-a-time decode gives:

- every token still comes out on its own, in order, counted in `completion_tokens`; stop
  strings and `max_tokens` cut where they would (no more forced tokens than `max_tokens`
  leaves, none past an end of sequence);
- the forced tokens are the ones the mask would have left: llguidance's mask allows forced
  text only in its canonical tokens (on the built-in models' answers every forced token was
  the only one its mask allowed). Batch rows are fed theirs the same way where they can
  be (runner.engine.batch_forward); elsewhere (`--engine mlx`, a batch row that is not fed)
  a forced token is a one-bit mask, with no mask to compute
  (`ConstraintProcessor.forced_next`). So a request writes the same tokens alone, in a
  batch or handed from one to the other (tests/runner/engine/test_fast_forward.py,
  test_batch_forward.py);
- a request that asks for logprobs, or sets a logit bias (a ban must hold even on text the
  grammar forces), is never forced (`Request.guard`): every token is sampled from its mask.

The generator runs a step ahead as `generate_step` does: a group's forward pass is started
(`mx.async_eval`) and the next mask computed while the group's tokens are yielded, so while
a group is being yielded the KV cache and the matcher already hold all of it. Whoever stops
it between two yields cuts both back to what was yielded (`SoloDecoder.hand_over`, `release`).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Generator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache

from runner.engine.masking import ConstraintProcessor


def forced_steps(
    model: Any,
    rest: Sequence[int],
    cache: list[Any],
    *,
    guard: ConstraintProcessor,
    max_tokens: int,
    sampler: Any,
    logits_processors: list[Any] | None,
    eos: Collection[int],
    kv_quantization: dict[str, Any],
) -> Generator[tuple[int, Any], None, None]:
    """Decode from `cache` (holding the prompt before `rest`) under `guard`: each token and,
    for a sampled one, the step's log-probabilities (None for a forced token).

    `logits_processors` (bias, penalties; not the constraint) see `rest` and then every
    token, as in `generate_step`. `guard` starts at the grammar's start.
    """
    quantize = functools.partial(
        maybe_quantize_kv_cache,
        quantized_kv_start=kv_quantization.get("quantized_kv_start", 0),
        kv_group_size=kv_quantization.get("kv_group_size", 64),
        kv_bits=kv_quantization.get("kv_bits"),
    )
    guard.started = True  # the prompt: nothing to consume
    context = mx.array(list(rest), dtype=mx.uint32) if logits_processors else None
    with mx.stream(generation_stream):
        if len(rest) > 1:  # the prompt but its last token, as generate_step prefills it
            model(mx.array([list(rest[:-1])]), cache=cache)
            quantize(cache)
            mx.eval([c.state for c in cache])
    # Text the grammar forces from its start goes in with the prompt's last token.
    forced = guard.forced(max_tokens)
    feed: list[int] = [*rest[-1:], *forced]
    group: list[tuple[int, Any]] = [(token, None) for token in forced]
    made = len(forced)
    while True:
        if group and (group[-1][0] in eos or made >= max_tokens):
            yield from group  # the last: nothing to run ahead
            return
        with mx.stream(generation_stream):
            logits = model(mx.array([feed]), cache=cache)[:, -1, :]
            quantize(cache)
        mx.async_eval(logits)  # type: ignore[no-untyped-call]  # mlx's stub lacks types
        bits = guard.bits()  # while the forward pass runs
        yield from group
        with mx.stream(generation_stream):
            if context is not None and logits_processors:
                if group:
                    context = mx.concatenate(
                        [context, mx.array([token for token, _ in group], dtype=mx.uint32)]
                    )
                for processor in logits_processors:
                    logits = processor(context, logits)
            logits = guard.masked(logits, bits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            token = int(sampler(logprobs).item())
        made += 1
        guard.consume(token)
        forced = [] if token in eos else guard.forced(max_tokens - made)
        made += len(forced)
        feed = [token, *forced]
        group = [(token, logprobs.squeeze(0)), *((f, None) for f in forced)]
