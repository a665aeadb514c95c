"""A request as the mlx engines' generation thread tracks it, from intake to its terminal event.

`mlx_model.MlxModel.prepare_choices` makes them (one `Request` per choice, a `ChoiceGroup` for
a request with n > 1); `generation.Generation` runs them on its decoders. Plain records, read
and written on the generation thread only.
"""

from __future__ import annotations

from typing import Any

import attrs

from protocol.frames import Echo, Generate, Usage
from runner.accounting import RequestAccounting
from runner.engine.constraint import Constraint
from runner.engine.logprobs import LogprobMaker
from runner.engine.masking import ConstraintProcessor


@attrs.define(eq=False)
class Request:
    """A request as the generation thread tracks it, from intake to its terminal event."""

    generate: Generate
    submitted_at: float
    prompt: list[int]
    """The templated prompt's token ids."""
    max_tokens: int
    accounting: RequestAccounting
    tokens: list[int] = attrs.field(factory=list)
    """Generated so far."""
    cache: list[Any] | None = None
    """Its KV cache, while the generation thread holds it outside a batch."""
    prefill_tokens: int = 0
    """Prompt tokens actually processed (those not reused from the prefix cache)."""
    first_step_at: float | None = None
    first_token_at: float | None = None
    logprobs: LogprobMaker | None = None
    """Set when the request asks for logprobs."""
    constraint: Constraint | None = None
    """Its compiled grammar (response format, forced tool calls), if it has one."""
    index: int = 0
    """Which choice of a request with n > 1 this is."""
    group: ChoiceGroup | None = None
    """The choices of a request with n > 1, this one among them."""
    echo: Echo | None = None
    """The prompt to send back with the request's first output (`Generate.echo`), once known;
    None again once sent."""
    echo_text: str | None = None
    """With `Generate.echo`: the raw prompt's text."""
    continues_text: bool = False
    """Its prompt is raw text (a legacy completion), which its output goes on from."""
    echo_skip: int = 0
    """Leading prompt tokens that are not part of that text (a beginning-of-text token the
    tokenizer added): the echo's logprobs leave them out."""
    waits_for: Any = None
    """While waiting: what it waits for before it can start, to reuse more of its prompt: a
    prefix-cache entry being read back from disk, or a running request still prefilling a
    prefix they share (`generation.Generation.admit`)."""
    followers: int = 0
    """Waiting requests that wait for this one's prefill (it keeps its prompt's cache for
    them as soon as its first token is out)."""
    disk_tokens: int = 0
    """Prompt tokens reused from a prefix read back from disk for it."""

    def guard(self) -> ConstraintProcessor | None:
        """A fresh processor of its constraint (None without one). Text its grammar forces is
        written in the tokenizer's canonical tokens (runner.engine.fast_forward), unless it
        asks for logprobs (the model's own choice among spellings is what they report) or
        sets a logit bias (a ban must hold on forced text too)."""
        if self.constraint is None:
            return None
        forcing = self.logprobs is None and not self.generate.sampling.logit_bias
        return self.constraint.processor(forcing=forcing)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The echo needs the prompt's logprobs, which only a pass over the prompt gives."""
        return self.echo_text is not None and self.generate.prompt_logprobs

    @property
    def request_id(self) -> str:
        """Unique among running requests: the wire id, and "#i" for choice i > 0."""
        rid = self.generate.request_id
        return rid if self.index == 0 else f"{rid}#{self.index}"

    def usage(self) -> Usage:
        """The usage to report: the whole request's, all its choices together."""
        if self.group is None:
            return self.accounting.usage()
        return self.group.usage()


@attrs.define(eq=False)
class ChoiceGroup:
    """The choices of one request with n > 1: they share one prefill of the prompt, and
    the request ends when the last of them does."""

    requests: list[Request]
    open: int
    """Choices not ended yet."""
    shared: tuple[list[Any], int] | None = None
    """After the one prefill: the prompt's KV cache (all but the last token) and how many
    tokens it holds, copied for each choice that starts after it."""
    started: int = 0
    echo: Echo | None = None
    """The echo with the prompt's logprobs, once the first choice to start worked it out."""

    def usage(self) -> Usage:
        """The prompt once, every choice's completion tokens."""
        first = self.requests[0].accounting
        return Usage(
            prompt_tokens=first.prompt_tokens,
            completion_tokens=sum(r.accounting.completion_tokens for r in self.requests),
            cached_tokens=first.cached_tokens,
            reasoning_tokens=sum(r.accounting.usage().reasoning_tokens for r in self.requests),
        )
