"""Cache-aware routing: the runner most likely to hold a request's prefix, weighed against
the prefill each runner has waiting.

What a runner holds, per model: the prefix hashes (`protocol.prefix`) its KV caches report
(`CacheHeld` frames: memory and disk tiers alike), kept until it reports them gone or
leaves; and the hashes of the requests in flight on it, which it holds as soon as their
prefill is done (a request that arrives meanwhile and shares them waits on the runner for
that prefill rather than computing it again: `runner.engine.generation`).

The rule. For a request whose hashes h1..hn cover c1..cn prompt characters, each runner with
a free slot is given an estimate of the request's time to first token there:

    held    = c_k for the deepest h_k the runner holds (0 when none)
    tokens  = (c_n - held) / chars_per_token      its prompt tokens the runner must prefill
    ttft    = (waiting + tokens) / prefill_rate   waiting: the prefill of its requests that
                                                  have not produced a token yet

`chars_per_token` is measured per model (its tokenizer's), `prefill_rate` per runner and model
(moving averages of usage and of `GenerationStats.prompt_tps`; a runner not measured yet is
taken for the average of those that are). When no runner holds any of the prompt the request
goes by free slots, as without a cache; otherwise to the least estimate, estimates within
`TIE` of it counting as equal and going by free slots, then at random. So a conversation goes
back to the runner that holds it unless that runner has more prefill waiting than the
conversation saves there (a busy runner against an idle one), and conversations that share
nothing (or only what every runner holds) spread by load. A runner with no free slot is not
waited for: its prefix is prefilled elsewhere. A runner that claims what it does not hold
costs a prefill, never a request.

Each decision is counted (`orchard_routing_decisions_total`): "affinity" (the runner holding
the longest prefix got it), "load" (another did: the holder was full or had more waiting),
"miss" (no runner held any of it).
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Sequence
from typing import Final, Literal

import attrs

from protocol.frames import CacheHeld, Chunk
from protocol.prefix import PrefixChain

log = logging.getLogger("gateway.affinity")

Decision = Literal["affinity", "load", "miss"]

MAX_HELD: Final = 200_000
"""Prefix hashes kept per runner and model at most (a runner reporting more is believed for
the first this many)."""
DEFAULT_CHARS_PER_TOKEN: Final = 4.0
DEFAULT_PREFILL_RATE: Final = 1000.0
"""Prompt tokens per second assumed of runners before any has been measured."""
AVERAGE_WEIGHT: Final = 0.2
"""The weight of the newest figure in the moving averages."""
MIN_RATE_TOKENS: Final = 256
"""A request's prefill speed counts once it prefilled at least this many tokens: a short
prefill's speed is mostly the step's fixed cost, and on runners of one kind it made the
measured speeds differ by more than a held prefix saves."""
TIE: Final = 0.1
"""Estimates within this share of the best, or within `TIE_SECONDS`, are equal."""
TIE_SECONDS: Final = 0.02


class Holdings:
    """What one runner holds and has waiting, and its measured prefill speed."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = collections.defaultdict(set)
        """Reported prefix hashes, by model."""
        self.in_flight: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        """Prefix hashes of the requests in flight, by model."""
        self.waiting: dict[str, float] = {}
        """Estimated prefill (prompt tokens) of each request in flight without a token yet."""
        self.prefill_rate: dict[str, float] = {}
        """Prompt tokens per second, by model (`Rates.learn`)."""
        self._warned = False

    def report(self, frame: CacheHeld) -> None:
        """Apply what the runner said it holds now of one model."""
        held = self.held[frame.model]
        if frame.reset:
            held.clear()
        held.difference_update(frame.removed)
        room = MAX_HELD - len(held)
        if len(frame.added) > room and not self._warned:
            self._warned = True
            log.warning("a runner reports more than %d prefixes of %s", MAX_HELD, frame.model)
        held.update(frame.added[: max(room, 0)])

    def held_chars(self, model: str, chain: PrefixChain) -> int:
        """The prompt characters of `chain` this runner holds (or is about to)."""
        held = self.held.get(model, ())
        flying = self.in_flight.get(model)
        for k in range(len(chain.hashes) - 1, -1, -1):
            h = chain.hashes[k]
            if h in held or (flying is not None and flying[h] > 0):
                return chain.chars[k]
        return 0

    def start(self, request_id: str, model: str, chain: PrefixChain, prefill: float) -> None:
        """A request was given to this runner: its prefill waits, its prefix is coming."""
        self.in_flight[model].update(chain.hashes)
        self.waiting[request_id] = prefill

    def first_token(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def end(self, request_id: str, model: str, chain: PrefixChain) -> None:
        """A request ended here (its cache, if kept, was reported before its last chunk)."""
        self.waiting.pop(request_id, None)
        flying = self.in_flight.get(model)
        if flying is not None:
            flying.subtract(chain.hashes)
            for h in chain.hashes:
                if flying[h] <= 0:
                    del flying[h]


class Rates:
    """What the pool measured: prompt characters per token by model (its tokenizer's), and
    each runner's prefill speed (in its `Holdings`)."""

    def __init__(self) -> None:
        self.chars_per_token: dict[str, float] = {}

    def learn(self, holdings: Holdings, model: str, chain: PrefixChain, chunk: Chunk) -> None:
        """Take in a request's figures as it ended on the runner of `holdings`."""
        usage, stats = chunk.usage, chunk.stats
        if usage.prompt_tokens > 0 and chain.total_chars > 0:
            self.chars_per_token[model] = _average(
                self.chars_per_token.get(model), chain.total_chars / usage.prompt_tokens
            )
        prefilled = usage.prompt_tokens - usage.cached_tokens
        if stats is not None and stats.prompt_tps > 0 and prefilled >= MIN_RATE_TOKENS:
            holdings.prefill_rate[model] = _average(
                holdings.prefill_rate.get(model), stats.prompt_tps
            )

    def tokens(self, model: str, chars: float) -> float:
        """Prompt characters of `model` as its tokens."""
        return chars / self.chars_per_token.get(model, DEFAULT_CHARS_PER_TOKEN)

    def prefill(self, holdings: Holdings, model: str, chain: PrefixChain) -> float:
        """The prompt tokens of `chain` the runner of `holdings` would prefill."""
        return self.tokens(model, chain.total_chars - holdings.held_chars(model, chain))


@attrs.frozen
class Choice:
    index: int
    """Of the candidate chosen."""
    decision: Decision


def choose(
    model: str,
    chain: PrefixChain,
    candidates: Sequence[tuple[Holdings, int]],
    rates: Rates,
    others: Sequence[Holdings] = (),
) -> Choice:
    """Which of `candidates` (each runner's holdings and free slots, all with a free slot)
    gets the request (see the module docstring); `others`: the runners serving the model
    with no free slot (a holder among them makes the decision "load")."""
    held = [holdings.held_chars(model, chain) for holdings, _ in candidates]
    longest = max(held + [h.held_chars(model, chain) for h in others], default=0)
    pool = list(range(len(candidates)))
    if max(held, default=0) > 0:
        known = [r for h, _ in candidates if (r := h.prefill_rate.get(model)) is not None]
        default = sum(known) / len(known) if known else DEFAULT_PREFILL_RATE
        times = [
            (sum(holdings.waiting.values()) + rates.tokens(model, chain.total_chars - chars))
            / holdings.prefill_rate.get(model, default)
            for (holdings, _), chars in zip(candidates, held, strict=True)
        ]
        best = min(times)
        bound = max(best * (1 + TIE), best + TIE_SECONDS)
        pool = [i for i, t in enumerate(times) if t <= bound]
    most_free = max(candidates[i][1] for i in pool)
    index = random.choice([i for i in pool if candidates[i][1] == most_free])
    if longest <= 0:
        decision: Decision = "miss"
    elif held[index] >= longest:
        decision = "affinity"
    else:
        decision = "load"
    return Choice(index, decision)


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else mean + AVERAGE_WEIGHT * (value - mean)
