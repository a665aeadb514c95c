"""A loaded mlx-lm model, and the intake of a request for it: template, checks, accounting.

Intake runs on the generation thread as soon as a request arrives, before it waits for a
slot, so that an invalid request fails at once and a cancelled queued one still reports its
real prompt usage. It raises `RequestError` for anything the request itself gets wrong.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import mlx_lm

from protocol.frames import Generate, Message
from runner.accounting import RequestAccounting, prompt_opens_reasoning
from runner.demo_model import resolve_model
from runner.errors import RequestError

if TYPE_CHECKING:
    from runner.engine.generation import Decoder

log = logging.getLogger("runner.engine")

DEFAULT_CONTEXT_LENGTH = 4096
"""Used when the model config names no `max_position_embeddings`."""


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
    decoder: Decoder | None = None
    """What runs it, once it has a slot."""
    cache: list[Any] | None = None
    """Its KV cache, while the generation thread holds it outside a batch."""
    prefill_tokens: int = 0
    """Prompt tokens actually processed (those not reused from the prefix cache)."""
    first_step_at: float | None = None
    first_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.generate.request_id


class MlxModel:
    """An mlx-lm model and tokenizer, with what intake needs to know about them.

    Attributes: `name` (as requests name it), `model`, `tokenizer`, `context_length`,
    `vocab_size`, `eos_token_ids`.
    """

    def __init__(
        self,
        name: str,
        model: Any,
        tokenizer: Any,
        config: dict[str, Any],
        *,
        context_length: int | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        text_config = config.get("text_config") or {}
        self.context_length = int(
            context_length
            or config.get("max_position_embeddings")
            or text_config.get("max_position_embeddings")
            or DEFAULT_CONTEXT_LENGTH
        )
        self.vocab_size = int(
            config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer)
        )
        self.eos_token_ids = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._think_start_id, self._think_end_id = _think_ids(tokenizer)

    @classmethod
    def load(cls, name: str, *, context_length: int | None = None) -> MlxModel:
        """Load `name` (a local MLX directory, a Hugging Face id or "orchard-demo")."""
        # mlx-lm annotates load() as returning a 2- or 3-tuple; return_config picks the 3.
        loaded: Any = mlx_lm.load(resolve_model(name), return_config=True)
        model, tokenizer, config = loaded
        return cls(name, model, tokenizer, config, context_length=context_length)

    def prepare(self, generate: Generate, submitted_at: float) -> Request:
        """Template and check a request; `RequestError` if it cannot be served."""
        if generate.model != self.name:
            raise RequestError(
                "model_not_found", f"This engine serves {self.name}, not {generate.model}."
            )
        try:
            prompt = [
                int(token)
                for token in self.tokenizer.apply_chat_template(
                    [_message_dict(message) for message in generate.messages],
                    add_generation_prompt=True,
                    tokenize=True,
                )
            ]
        except Exception as exc:
            raise RequestError(
                "invalid_request", f"The chat template rejected the messages: {exc}"
            ) from exc
        limit = self.context_length
        if len(prompt) >= limit:
            raise RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens; "
                f"the messages take {len(prompt)}.",
            )
        max_tokens = generate.max_tokens
        if max_tokens is None:
            max_tokens = limit - len(prompt)
        elif max_tokens < 1:
            raise RequestError("invalid_request", f"max_tokens must be at least 1: {max_tokens}")
        elif len(prompt) + max_tokens > limit:
            raise RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens; you requested "
                f"{len(prompt) + max_tokens} ({len(prompt)} in the messages, {max_tokens} "
                "in the completion).",
            )
        for bias in generate.sampling.logit_bias:
            if not 0 <= bias.token < self.vocab_size:
                raise RequestError(
                    "invalid_request",
                    f"logit_bias names token {bias.token}, outside this model's vocabulary "
                    f"of {self.vocab_size}.",
                )
        accounting = RequestAccounting(
            prompt_tokens=len(prompt),
            stop=generate.stop,
            think_start_id=self._think_start_id,
            think_end_id=self._think_end_id,
            think_start_text=self.tokenizer.think_start or "<think>",
            think_end_text=self.tokenizer.think_end or "</think>",
            starts_in_reasoning=prompt_opens_reasoning(
                prompt, self._think_start_id, self._think_end_id
            ),
        )
        return Request(generate, submitted_at, prompt, max_tokens, accounting)


def _message_dict(message: Message) -> dict[str, str]:
    # Chat templates know "system"; OpenAI's "developer" role is its newer name.
    role = "system" if message.role == "developer" else message.role
    data = {"role": role, "content": message.content}
    if message.name is not None:
        data["name"] = message.name
    return data


def _think_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """The single-token think markers, or (None, None): multi-token markers are not split."""
    if not tokenizer.has_thinking:
        return None, None
    try:
        return int(tokenizer.think_start_id), int(tokenizer.think_end_id)
    except ValueError:
        log.warning("think markers span several tokens; reasoning is not split out")
        return None, None
