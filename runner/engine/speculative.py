"""Speculative decoding: a small draft model proposes tokens, the served model checks them.

`orchard runner --draft-model D --num-draft-tokens K` loads D beside the model. A request
decoded on its own stream (the lone request of the batched engine, a seeded one beside the
batch, every request of the interleaved engine) then runs mlx-lm's `speculative_generate_step`:
each round D proposes K tokens, the model scores them in one forward pass of K + 1 positions,
and the proposals are kept up to the first one the model's own sampler would not have drawn,
plus the model's token there. Every token is the served model's choice given the tokens before
it, so greedy output is the same as without a draft and sampled output follows the served
model's distribution; logprobs are the served model's. Rows of the batch decode without a draft
(`docs/operations.md` says why), and so does a constrained request: its grammar's matcher is
advanced token by token and cannot take a round's proposals back.

The draft has its own KV cache per request, holding the prompt tokens the served model's cache
already holds (reused from the prefix cache, or prefilled chunk by chunk), so that both caches
stand at the same position when mlx-lm's step starts. Finished requests' draft caches are kept
in a prefix cache of the draft's own (`Draft.kept`, a quarter of the model's prefix-cache
budget), so that a conversation's next turn prefills the draft with its new tokens only.

A draft must tokenize as the model does (the proposals are token ids): `vocabulary_mismatch`
says how two tokenizers differ, and the runner refuses such a pair at start.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any, Literal

import attrs
import mlx.core as mx
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from runner.engine.prefix_cache import PrefixCache

PREFILL_CHUNK = 512
"""Tokens of the prompt the draft prefills per forward pass."""


PROBE_EVERY = 8
"""Of the requests a draft could serve, every this many goes the way measured slower, so
that the estimate of both ways stays current."""
PROBE_TOKENS = 32
"""A probe of the draft drafts this many tokens of a request, then decodes without it: both
rates measured in one request, at a small cost when the draft does not pay."""
MIN_TOKENS = 16
"""A stretch of decoding counts for the choice once it made this many tokens."""
WEIGHT = 0.3
"""Of a new decode rate in a way's running estimate (an exponentially weighted mean)."""

Way = Literal["draft", "probe", "plain"]
"""How a request the draft could serve decodes: with the draft, with it for its first
`PROBE_TOKENS` tokens only, or without it."""


@attrs.define(eq=False)
class Draft:
    """A loaded draft model and what it has done (written by the generation thread).

    Whether a draft pays depends on how often it agrees and on what it costs beside the model,
    neither known before it runs. `choose` decides request by request: the first request is a
    probe (drafting its first `PROBE_TOKENS` tokens, then not: both decode rates measured);
    later ones go the way whose measured rate is higher, every `PROBE_EVERY`-th the other way
    (a probe, or a request without the draft), so that both estimates stay current. `always`
    drafts every request.
    """

    name: str
    model: Any
    num_tokens: int
    """Tokens proposed per round (`--num-draft-tokens`)."""
    always: bool = False
    drafted: int = 0
    """Tokens the draft proposed, over every request."""
    accepted: int = 0
    """Of those, the ones the served model kept."""
    kept: PrefixCache | None = None
    """The draft's caches of finished requests, so that a conversation's next turn does not
    prefill the draft with all of it again (set once the engine has warmed up)."""
    prefilled: int = 0
    """Prompt tokens the draft prefilled, over every request."""
    rates: dict[bool, float] = attrs.field(factory=dict)
    """Decode tokens/s with the draft (True) and without (False): running estimates."""
    chosen: int = 0
    """Requests `choose` has chosen for."""

    def choose(self, *, can_stop: bool = True) -> Way:
        """How the next request the draft can serve decodes. A decoder that cannot stop
        drafting midway (`can_stop` False) gets "draft" or "plain" for a whole request where
        a probe is due: the way not yet measured, or the draft."""
        self.chosen += 1
        if self.always:
            return "draft"
        if True in self.rates and False in self.rates:
            pays = self.rates[True] >= self.rates[False]
            if self.chosen % PROBE_EVERY == 0:  # the other way, to keep its figure current
                return "plain" if pays else ("probe" if can_stop else "draft")
            return "draft" if pays else "plain"
        if can_stop:
            return "probe"
        return "plain" if True in self.rates else "draft"

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A stretch of decoding that went one way made `tokens` tokens in `seconds`."""
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.rates.get(drafted)
        self.rates[drafted] = rate if old is None else old + WEIGHT * (rate - old)

    def reset(self) -> None:
        """Forget what was counted and measured (after the engine's warm-up)."""
        self.drafted = self.accepted = self.chosen = self.prefilled = 0
        self.rates.clear()

    def cache_for(self, tokens: Sequence[int]) -> list[Any]:
        """A draft cache holding `tokens` (what the served model's cache holds): the longest
        prefix of them the draft's kept caches hold, and the rest prefilled."""
        cache, held = self.kept.take(tokens) if self.kept is not None else (None, 0)
        if cache is None:
            cache = make_prompt_cache(self.model)
        for start in range(held, len(tokens), PREFILL_CHUNK):
            self.model(mx.array([list(tokens[start : start + PREFILL_CHUNK])]), cache=cache)
            mx.eval([c.state for c in cache])
        self.prefilled += len(tokens) - held
        return cache

    def keep(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep a request's draft cache, which holds `tokens` or a prefix of them, for the
        next turn of its conversation (given up: nothing writes to it again)."""
        if self.kept is None:
            return
        excess = cache_offset(cache) - len(tokens)
        if excess > 0:  # proposals past the tokens kept (a round cut short)
            trim_prompt_cache(cache, excess)
        self.kept.put(tokens, cache)


@attrs.define(eq=False)
class _Rounds:
    """Counts a request's drafted and accepted tokens on its draft, token by token."""

    draft: Draft
    max_tokens: int
    made: int = 0
    in_round: bool = False

    def count(self, from_draft: bool) -> None:
        draft = self.draft
        if not self.in_round:
            # mlx-lm drafts this many each round: K, or what max_tokens leaves.
            draft.drafted += min(self.max_tokens - self.made, draft.num_tokens)
            self.in_round = True
        if from_draft:
            draft.accepted += 1
        else:
            self.in_round = False  # a round ends with the served model's own token
        self.made += 1


def vocabulary_mismatch(model_tokenizer: Any, draft_tokenizer: Any) -> str | None:
    """How the draft's tokenizer differs from the model's (None: they agree on every id)."""
    ours, theirs = model_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours == theirs:
        return None
    if len(ours) != len(theirs):
        return f"its vocabulary has {len(theirs)} tokens, the model's {len(ours)}"
    differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    return f"{len(differ)} tokens have other ids (e.g. {differ[0]!r})"


def speculative_steps(
    draft: Draft,
    model: Any,
    rest: Sequence[int],
    cache: list[Any],
    draft_cache: list[Any],
    *,
    max_tokens: int,
    sampler: Any,
    logits_processors: list[Any] | None,
    kv_quantization: dict[str, Any],
) -> Generator[tuple[int, Any], None, None]:
    """mlx-lm's speculative step from `cache` and `draft_cache` (both holding the same
    prompt tokens, `Draft.cache_for`), going on with `rest`: each token and the model's
    log-probabilities for it, as `generate_step` yields them.

    The logits processors see the last prompt token and the tokens generated (mlx-lm's
    speculative step keeps no more context): a penalty's prompt length is 1. Closing the
    generator rewinds both caches to the tokens yielded (mlx-lm's `finally`): `cache` then
    holds the prompt and every token yielded, or every one but the last (`cache_offset` says
    which); `draft_cache` at most as many.
    """
    steps = speculative_generate_step(
        mx.array(list(rest)),
        model,
        draft.model,
        num_draft_tokens=draft.num_tokens,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=[*cache, *draft_cache],
        prefill_step_size=PREFILL_CHUNK,
        **kv_quantization,
    )
    rounds = _Rounds(draft, max_tokens)
    try:
        for token, logprobs, from_draft in steps:
            rounds.count(from_draft)
            yield int(token), logprobs
    finally:
        steps.close()


def counted(draft: Draft, responses: Iterator[Any], max_tokens: int) -> Iterator[Any]:
    """`stream_generate`'s responses with a draft, counted on `draft` as `speculative_steps`
    counts them (`response.from_draft`)."""
    rounds = _Rounds(draft, max_tokens)
    try:
        for response in responses:
            rounds.count(bool(response.from_draft))
            yield response
    finally:
        close = getattr(responses, "close", None)
        if close is not None:
            close()


def with_context(processors: list[Any] | None, earlier: Sequence[int]) -> list[Any] | None:
    """`processors` seeing `earlier` before the tokens mlx-lm gives them: a request that stops
    drafting goes on in `generate_step` from its last token, and its penalties must still count
    every token generated before (`earlier`: what the speculative step's context held)."""
    if not processors:
        return processors
    before = mx.array(list(earlier), dtype=mx.uint32)

    def prefixed(processor: Any) -> Any:
        def call(tokens: Any, logits: Any) -> Any:
            return processor(mx.concatenate([before, tokens.astype(mx.uint32)]), logits)

        return call

    return [prefixed(p) for p in processors]


def cache_offset(cache: list[Any]) -> int:
    """Tokens a (trimmable, plain or quantized) KV cache holds."""
    return int(cache[0].offset)
