"""A loaded mlx-lm model, and the intake of a request for it: template, checks, accounting.

Intake runs on the generation thread as soon as a request arrives, before it waits for a
slot, so that an invalid request fails at once and a cancelled queued one still reports its
real prompt usage. It raises `RequestError` for anything the request itself gets wrong.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import attrs
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from protocol.frames import Echo, Generate, Message
from runner import adapter, download
from runner.accounting import RequestAccounting, prompt_opens_reasoning
from runner.demo_model import resolve_model
from runner.engine.constraint import constraint_for
from runner.engine.logprobs import LogprobMaker, TokenBytes
from runner.engine.request import ChoiceGroup, Request
from runner.engine.sampling import with_defaults
from runner.engine.speculative import Draft, vocabulary_mismatch
from runner.errors import RequestError
from runner.harmony import CALL, HarmonySplitter, harmony_markers
from runner.model_options import ModelOptions, head_width, kv_group_problem
from runner.tool_calls import ToolCallSplitter
from runner.tool_formats import format_for

log = logging.getLogger("runner.engine")

DEFAULT_CONTEXT_LENGTH = 4096
"""Used when the model config names no `max_position_embeddings`."""
_SEED_STRIDE = 0x9E3779B97F4A7C15
"""Choice i of a seeded request draws from seed + i * this (mod 2**64): far apart seeds."""


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
        self._harmony = harmony_markers(tokenizer.get_vocab())
        """Harmony's marker ids where the model writes that format (gpt-oss), else None."""
        if self._harmony is not None:
            # gpt-oss ends a turn that calls a tool with <|call|>, which its configuration
            # does not list as an end of sequence (vLLM adds it too).
            tokenizer.add_eos_token(CALL)
        self.eos_token_ids = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.directory: str | None = None
        """Where its files are (set by `load`): what its disk cache is keyed by."""
        self.adapter_directory: str | None = None
        """Where its adapter's files are (set by `load`), if it has one: its disk cache is
        keyed by them too."""
        self.options = ModelOptions()
        """What it was loaded with (set by `load`): its template's default arguments, its
        sampling defaults, its draft model and KV quantization."""
        self.draft: Draft | None = None
        """The draft model it decodes a lone request with (`--draft-model`), if any."""
        self._think_start_id, self._think_end_id = _think_ids(tokenizer)
        self._token_bytes: TokenBytes | None = None
        self._continuation_tokenizer: Any = None

    @classmethod
    def load(
        cls,
        name: str,
        *,
        path: str | None = None,
        context_length: int | None = None,
        options: ModelOptions | None = None,
    ) -> MlxModel:
        """Load `name` (a local MLX directory, a Hugging Face id or "orchard-demo"), from
        `path` when its files are there, with `options`' adapter, template and remote code."""
        options = options if options is not None else ModelOptions()
        base = options.base(name)  # `name` may be MODEL:ADAPTER
        source = path if path is not None and Path(path).exists() else _files_of(base)
        adapter_dir = None
        if options.adapter_path is not None:
            # mlx_lm.load takes a directory only: a Hub id downloads here; the files are
            # checked first, so that a broken adapter is one clear line.
            adapter_dir = adapter.locate(options.adapter_path)
            assert adapter_dir is not None
            adapter.check_files(adapter_dir)
        tokenizer_config: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
        if options.chat_template is not None:
            tokenizer_config["chat_template"] = options.chat_template
        # mlx-lm annotates load() as returning a 2- or 3-tuple; return_config picks the 3.
        loaded: Any = mlx_lm.load(
            source,
            tokenizer_config=tokenizer_config,
            return_config=True,
            trust_remote_code=options.trust_remote_code,
        )
        model, tokenizer, config = loaded
        if adapter_dir is not None:
            adapter.apply(model, adapter_dir, base)
        made = cls(name, model, tokenizer, config, context_length=context_length)
        made.directory = source
        made.adapter_directory = None if adapter_dir is None else str(adapter_dir)
        made.options = options
        width = head_width(config)
        if options.kv_bits is not None and width is not None:
            problem = kv_group_problem(name, width, options)
            if problem is not None:
                raise ValueError(problem)
        if options.speculative:
            assert options.draft_model is not None
            made.draft = load_draft(made, options.draft_model, options)
        return made

    @property
    def kv_quantization(self) -> dict[str, Any]:
        """mlx-lm's generate_step arguments that quantize a request's KV cache as the
        options say (`--kv-bits`; none without it)."""
        options = self.options
        if options.kv_bits is None:
            return {}
        return {
            "kv_bits": options.kv_bits,
            "kv_group_size": options.kv_group_size,
            "quantized_kv_start": options.quantized_kv_start,
        }

    def weights_bytes(self) -> int:
        """What the model's parameters take in memory."""
        leaves: list[tuple[str, Any]] = tree_flatten(self.model.parameters())  # type: ignore[assignment]
        return sum(int(array.nbytes) for _, array in leaves)

    def prepare_choices(self, generate: Generate, submitted_at: float) -> list[Request]:
        """The requests of each of `generate.n` choices (one without n > 1). A seeded request's
        choices draw from seeds derived from it: they differ, and repeat."""
        first = self.prepare(generate, submitted_at)
        if generate.n <= 1:
            return [first]
        choices = [first]
        seed = generate.sampling.seed
        for index in range(1, generate.n):
            sampling = generate.sampling
            if seed is not None:
                sampling = attrs.evolve(sampling, seed=(seed + index * _SEED_STRIDE) % 2**64)
            choice = self.prepare(attrs.evolve(generate, sampling=sampling), submitted_at)
            choice.index = index
            choices.append(choice)
        group = ChoiceGroup(choices, open=len(choices))
        for choice in choices:
            choice.group = group
        return choices

    def prepare(self, generate: Generate, submitted_at: float) -> Request:
        """Template and check a request; `RequestError` if it cannot be served."""
        if generate.model != self.name:
            raise RequestError(
                "model_not_found", f"This engine serves {self.name}, not {generate.model}."
            )
        # The runner's defaults for what the client left out: every engine reads them here.
        sampling = with_defaults(generate.sampling, self.options.sampling)
        if sampling is not generate.sampling:
            generate = attrs.evolve(generate, sampling=sampling)
        raw = generate.prompt is not None or generate.prompt_tokens is not None
        tools: list[dict[str, Any]] = []
        echo_skip = 0
        if raw:
            prompt, echo_skip = self._raw_prompt(generate)
        else:
            tools = self._tools(generate)
            prompt = self._templated(generate, tools)
        # What the client sent: a chat's messages or a raw prompt (OpenAI's names for them).
        param, what = ("prompt", "the prompt") if raw else ("messages", "the messages")
        limit = self.context_length
        if len(prompt) >= limit:
            raise RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens; "
                f"{what} take{'s' if raw else ''} {len(prompt)}.",
                param,
            )
        max_tokens = generate.max_tokens
        if max_tokens is None:
            # The runner's --max-tokens, within what the context leaves.
            default = self.options.sampling.max_tokens
            max_tokens = limit - len(prompt)
            if default is not None:
                max_tokens = min(default, max_tokens)
        elif max_tokens < 0:
            raise RequestError("invalid_request", f"max_tokens must be at least 0: {max_tokens}")
        elif len(prompt) + max_tokens > limit:
            raise RequestError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens; you requested "
                f"{len(prompt) + max_tokens} ({len(prompt)} in {what}, {max_tokens} "
                "in the completion).",
                param,
            )
        for bias in generate.sampling.logit_bias:
            if not 0 <= bias.token < self.vocab_size:
                raise RequestError(
                    "invalid_request",
                    f"logit_bias names token {bias.token}, outside this model's vocabulary "
                    f"of {self.vocab_size}.",
                    "logit_bias",
                )
        # A raw completion is all text: the model's think markers are text there too.
        think_start_id, think_end_id = (
            (None, None) if raw else (self._think_start_id, self._think_end_id)
        )
        harmony = HarmonySplitter(self._harmony) if self._harmony and not raw else None
        in_reasoning = prompt_opens_reasoning(prompt, think_start_id, think_end_id)
        # Compiled here, at intake, so that a schema that cannot be enforced fails at once.
        constraint = constraint_for(
            generate, self.tokenizer, vocab_size=self.vocab_size, starts_in_reasoning=in_reasoning
        )
        accounting = RequestAccounting(
            prompt_tokens=len(prompt),
            stop=generate.stop,
            think_start_id=think_start_id,
            think_end_id=think_end_id,
            think_start_text=self.tokenizer.think_start or "<think>",
            think_end_text=self.tokenizer.think_end or "</think>",
            starts_in_reasoning=in_reasoning,
            tool_calls=None if harmony else self._tool_call_splitter(tools),
            harmony=harmony,
        )
        request = Request(generate, submitted_at, prompt, max_tokens, accounting)
        request.continues_text = raw
        request.constraint = constraint
        if generate.logprobs:
            request.logprobs = LogprobMaker(self.token_bytes, generate.top_logprobs)
        if raw and generate.echo:
            text = generate.prompt
            if text is None:
                text = str(self.tokenizer.decode(prompt))
            request.echo_text = text
            request.echo_skip = echo_skip
            if not generate.prompt_logprobs:
                request.echo = Echo(text)
        return request

    def tokenizer_for(self, request: Request) -> Any:
        """The tokenizer whose detokenizer writes `request`'s text.

        mlx-lm's detokenizers drop a leading space of the first token, which suits an answer
        to a chat. The continuation of a raw prompt keeps it, as OpenAI's completions do:
        "The capital of France is" goes on with " Paris".
        """
        if not request.continues_text:
            return self.tokenizer
        if self._continuation_tokenizer is None:
            self._continuation_tokenizer = _keeping_leading_space(self.tokenizer)
        return self._continuation_tokenizer

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token id's string and raw bytes (made on first use)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes

    def _templated(self, generate: Generate, tools: list[dict[str, Any]]) -> list[int]:
        """A chat's prompt: its messages through the model's chat template."""
        try:
            return [
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

    def _raw_prompt(self, generate: Generate) -> tuple[list[int], int]:
        """A raw prompt's tokens, and how many of the first ones the tokenizer added (not part
        of the text). Text is tokenized as mlx-lm's `stream_generate` does: with the special
        tokens the tokenizer adds (a beginning-of-text token), unless it starts with one."""
        if generate.messages or generate.tools or generate.chat_template_kwargs is not None:
            raise RequestError(
                "invalid_request", "A raw prompt takes no messages, tools or chat template."
            )
        if generate.prompt_tokens is not None:
            if generate.prompt is not None:
                raise RequestError("invalid_request", "Give prompt text or token ids, not both.")
            tokens = list(generate.prompt_tokens)
            for token in tokens:
                if not 0 <= token < self.vocab_size:
                    raise RequestError(
                        "invalid_request",
                        f"The prompt holds token {token}, outside this model's vocabulary of "
                        f"{self.vocab_size}.",
                        "prompt",
                    )
            skip = 0
        else:
            text = generate.prompt or ""
            bos = self.tokenizer.bos_token
            special = bos is None or not text.startswith(bos)
            tokens = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=special)]
            skip = 0
            if special and generate.echo:
                plain = self.tokenizer.encode(text, add_special_tokens=False)
                added = len(tokens) - len(plain)
                if added > 0 and tokens[added:] == [int(t) for t in plain]:
                    skip = added
        if not tokens:
            raise RequestError(
                "invalid_request",
                f"The prompt is empty, and {self.name}'s tokenizer adds no beginning-of-text "
                "token to start from.",
                "prompt",
            )
        return tokens, skip

    def _tools(self, generate: Generate) -> list[dict[str, Any]]:
        """The request's tools as chat templates take them (none with tool_choice "none": the
        model is not told about tools it may not call)."""
        if not generate.tools or generate.tool_choice == "none":
            return []
        if not self.tokenizer.has_tool_calling and self._harmony is None:
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
        format = format_for(self.tokenizer)
        return None if format is None else ToolCallSplitter(format, tools)

    def _template_kwargs(self, generate: Generate) -> dict[str, Any]:
        """chat_template_kwargs, and reasoning_effort as the template's `enable_thinking` (a
        Harmony model's template takes the level itself, as `reasoning_effort`), over the
        runner's `--chat-template-args`: what the request asks wins."""
        kwargs: dict[str, Any] = {}
        if generate.chat_template_kwargs is not None:
            asked = json.loads(generate.chat_template_kwargs)
            kwargs.update(asked)
            for reserved in ("messages", "tools", "add_generation_prompt", "tokenize"):
                if reserved in asked:
                    raise RequestError(
                        "invalid_request",
                        f"chat_template_kwargs may not set {reserved!r}.",
                        "chat_template_kwargs",
                    )
        effort = generate.reasoning_effort
        if effort is not None and self._harmony is not None:
            # Harmony's system message states one of three levels.
            level = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}
            kwargs.setdefault("reasoning_effort", level.get(effort, effort))
        elif effort is not None:
            if not self.tokenizer.has_thinking:
                raise RequestError(
                    "invalid_request",
                    f"reasoning_effort is for reasoning models; {self.name} has no think markers.",
                    "reasoning_effort",
                )
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
        return {**self.options.chat_template_args, **kwargs}


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
    if message.reasoning is not None:
        # Templates read it under either name: `reasoning_content` (Qwen3, GLM, MiniMax,
        # Kimi, Gemma) or `thinking` (gpt-oss's Harmony template, Ollama's).
        data["reasoning_content"] = data["thinking"] = message.reasoning
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


def _files_of(name: str) -> str:
    """Where `name`'s files are: a built-in model (built on first use), a local directory, or
    a Hub id, downloaded here with progress in the log and clear errors rather than by
    mlx_lm.load."""
    source = resolve_model(name)
    return source if Path(source).exists() else str(download.fetch(name))


def load_draft(model: MlxModel, name: str, options: ModelOptions) -> Draft:
    """`name` loaded as `model`'s draft; `ValueError` if it tokenizes otherwise."""
    loaded: Any = mlx_lm.load(
        _files_of(name),
        tokenizer_config={"trust_remote_code": options.trust_remote_code},
        trust_remote_code=options.trust_remote_code,
    )
    draft_model, draft_tokenizer = loaded[0], loaded[1]
    mismatch = vocabulary_mismatch(model.tokenizer, draft_tokenizer)
    if mismatch is not None:
        raise ValueError(
            f"the draft model {name} does not tokenize as {model.name}: {mismatch}; "
            "a draft must share the model's tokenizer"
        )
    return Draft(name, draft_model, options.num_draft_tokens, always=options.draft_always)


def _keeping_leading_space(tokenizer: Any) -> Any:
    """A copy of an mlx-lm `TokenizerWrapper` whose detokenizer keeps a leading space of the
    first token (SPM and BPE detokenizers; the naive one decodes as the tokenizer does)."""
    detokenizer = copy.copy(tokenizer._detokenizer)
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        detokenizer.trim_space = False
    elif isinstance(detokenizer, BPEStreamingDetokenizer):
        # Its trimming is this one method; an instance attribute survives the copy each
        # request's detokenizer is made from.
        detokenizer._maybe_trim_space = _as_is  # type: ignore[method-assign]
    wrapper = copy.copy(tokenizer)
    wrapper._detokenizer = detokenizer
    return wrapper


def _as_is(text: str) -> str:
    return text
