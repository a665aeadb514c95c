"""A loaded mlx-lm model, and the intake of a request for it: template, checks, accounting.

Intake runs on the generation thread as soon as a request arrives, before it waits for a
slot, so that an invalid request fails at once and a cancelled queued one still reports its
real prompt usage. It raises `RequestError` for anything the request itself gets wrong.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import attrs
import mlx_lm

from protocol.frames import Generate, Message
from runner.accounting import RequestAccounting, prompt_opens_reasoning
from runner.demo_model import resolve_model
from runner.engine.constraint import Constraint, constraint_for
from runner.engine.logprobs import LogprobMaker, TokenBytes
from runner.errors import RequestError
from runner.tool_calls import ToolCallSplitter

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
    logprobs: LogprobMaker | None = None
    """Set when the request asks for logprobs."""
    constraint: Constraint | None = None
    """Its compiled grammar (response format, forced tool calls), if it has one."""

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
        self._token_bytes: TokenBytes | None = None

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
        tools = self._tools(generate)
        try:
            prompt = [
                int(token)
                for token in self.tokenizer.apply_chat_template(
                    [_message_dict(message) for message in generate.messages],
                    add_generation_prompt=True,
                    tokenize=True,
                    **({"tools": tools} if tools else {}),
                    **self._template_kwargs(generate),
                )
            ]
        except Exception as exc:
            raise RequestError(
                "invalid_request", f"The chat template rejected the messages: {exc}", "messages"
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
                    "logit_bias",
                )
        in_reasoning = prompt_opens_reasoning(prompt, self._think_start_id, self._think_end_id)
        # Compiled here, at intake, so that a schema that cannot be enforced fails at once.
        constraint = constraint_for(
            generate, self.tokenizer, vocab_size=self.vocab_size, starts_in_reasoning=in_reasoning
        )
        accounting = RequestAccounting(
            prompt_tokens=len(prompt),
            stop=generate.stop,
            think_start_id=self._think_start_id,
            think_end_id=self._think_end_id,
            think_start_text=self.tokenizer.think_start or "<think>",
            think_end_text=self.tokenizer.think_end or "</think>",
            starts_in_reasoning=in_reasoning,
            tool_calls=self._tool_call_splitter(tools),
        )
        request = Request(generate, submitted_at, prompt, max_tokens, accounting)
        request.constraint = constraint
        if generate.logprobs:
            if self._token_bytes is None:
                self._token_bytes = TokenBytes(self.tokenizer)
            request.logprobs = LogprobMaker(self._token_bytes, generate.top_logprobs)
        return request

    def _tools(self, generate: Generate) -> list[dict[str, Any]]:
        """The request's tools as chat templates take them (none with tool_choice "none": the
        model is not told about tools it may not call)."""
        if not generate.tools or generate.tool_choice == "none":
            return []
        if not self.tokenizer.has_tool_calling:
            raise RequestError(
                "invalid_request",
                f"The model {self.name} does not support tool calling (its tokenizer has no "
                "tool-call markup mlx-lm recognises).",
                "tools",
            )
        tools = []
        for tool in generate.tools:
            function: dict[str, Any] = {"name": tool.name}
            if tool.description is not None:
                function["description"] = tool.description
            if tool.parameters is not None:
                function["parameters"] = json.loads(tool.parameters)
            tools.append({"type": "function", "function": function})
        return tools

    def _tool_call_splitter(self, tools: list[dict[str, Any]]) -> ToolCallSplitter | None:
        if not tools:
            return None
        tokenizer = self.tokenizer
        return ToolCallSplitter(
            tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools
        )

    def _template_kwargs(self, generate: Generate) -> dict[str, Any]:
        """chat_template_kwargs, and reasoning_effort as the template's `enable_thinking`."""
        kwargs: dict[str, Any] = {}
        if generate.chat_template_kwargs is not None:
            kwargs = json.loads(generate.chat_template_kwargs)
            for reserved in ("messages", "tools", "add_generation_prompt", "tokenize"):
                if reserved in kwargs:
                    raise RequestError(
                        "invalid_request",
                        f"chat_template_kwargs may not set {reserved!r}.",
                        "chat_template_kwargs",
                    )
        effort = generate.reasoning_effort
        if effort is not None:
            if not self.tokenizer.has_thinking:
                raise RequestError(
                    "invalid_request",
                    f"reasoning_effort is for reasoning models; {self.name} has no think markers.",
                    "reasoning_effort",
                )
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
        return kwargs


def _message_dict(message: Message) -> dict[str, Any]:
    """A message as chat templates take it (transformers' convention: a tool call's arguments
    are a dict, which templates render with `tojson`)."""
    # Chat templates know "system"; OpenAI's "developer" role is its newer name.
    role = "system" if message.role == "developer" else message.role
    data: dict[str, Any] = {"role": role, "content": message.content}
    if message.name is not None:
        data["name"] = message.name
    if message.tool_calls:
        data["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        data["tool_call_id"] = message.tool_call_id
    return data


def _arguments(text: str) -> Any:
    """A tool call's arguments as the template should render them: the parsed JSON object, or
    the text itself when it is not one (a model's malformed call, sent back as it was)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _think_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """The single-token think markers, or (None, None): multi-token markers are not split."""
    if not tokenizer.has_thinking:
        return None, None
    try:
        return int(tokenizer.think_start_id), int(tokenizer.think_end_id)
    except ValueError:
        log.warning("think markers span several tokens; reasoning is not split out")
        return None, None
