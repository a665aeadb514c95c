"""OpenAI's legacy text completions (`POST /v1/completions`): the request and the objects.

The request is parsed as strictly as the chat one (openapi.yaml's CreateCompletionRequest,
the same readers and 400s): `prompt` is a string, a list of strings, a list of token ids or a
list of token-id lists; each of several prompts is its own runner request (`to_generates`),
whose choices are numbered `prompt_index * n + choice`, as OpenAI numbers them. Legacy
defaults: `max_tokens` 16 (0 is allowed: with `echo`, the prompt and nothing else),
`logprobs` an integer 0..5. `suffix` is refused, and `best_of` other than `n` (choosing the
best of more completions is not implemented). `top_k` and `min_p` are vLLM's extensions, as
in chat.

The objects are `text_completion`s, streamed or not: each choice `{text, index, logprobs,
finish_reason}`, its logprobs `{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}`. A token's `top_logprobs` holds the `logprobs` most likely tokens and the chosen
one (so up to logprobs + 1 entries). `text_offset` counts characters from the start of the
prompt, echoed or not (the runner sends the prompt's text back whenever logprobs are asked
for); with `echo` the prompt's tokens come first, the first of them with a null logprob.
`TextCompletionWriter` renders the streamed objects for `CompletionStream` (whose order,
errors, cancel and usage chunk are the chat's); `text_completion_body` builds the
non-streaming one from a `CompletionBuilder`.
"""

from __future__ import annotations

from typing import Any

import attrs

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    check_range,
    fail_array_too_long,
    fail_empty_array,
    fail_type,
    fail_unsupported,
    fail_unsupported_value,
    read_bool,
    read_int,
    read_json,
    read_required,
    read_str,
)
from protocol.core.limits import (
    INT64_MAX,
    MAX_PROMPT_CHARS,
    CheckModel,
    check_ceiling,
    read_model_first,
)
from protocol.frames import (
    Generate,
    SamplingParams,
)
from protocol.openai.params import (
    MAX_N,
    MAX_TOKEN_ID,
    parse_sampling,
    parse_stop,
    parse_stream_options,
)

MAX_PROMPTS = 32
"""Prompts in one request (each is its own runner request)."""
MAX_PROMPT_TOKEN_IDS = 256 * 1024
"""Token ids of all the prompts together (the real bound is the model's context)."""
MAX_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16
MAX_BEST_OF = 20

Prompt = str | tuple[int, ...]

# fmt: off
_KNOWN = frozenset((
    "model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p",
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed", "stop", "logit_bias",
    "logprobs", "echo", "n", "best_of", "suffix", "user",
))
# fmt: on


@attrs.frozen
class CompletionRequest:
    """A validated text completion request."""

    model: str
    prompts: tuple[Prompt, ...]
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    """How many likely tokens to list at each position (0..5); None: no logprobs."""

    @property
    def choices(self) -> int:
        """Choices in the response: n for each prompt."""
        return len(self.prompts) * self.n

    def check_ceilings(self, max_tokens: int, choices: int) -> None:
        """The gateway's own ceilings (`--max-tokens-limit`, `--max-choices`), on top of the
        API's validation."""
        check_ceiling(self.max_tokens, max_tokens, "max_tokens")
        check_ceiling(self.n, choices, "n", " choices per prompt")

    def to_generates(self, request_id: str) -> list[Generate]:
        """The runner requests, one per prompt (ids `request_id`, or `request_id-k` with
        several prompts)."""
        several = len(self.prompts) > 1
        return [
            Generate(
                request_id=f"{request_id}-{k}" if several else request_id,
                model=self.model,
                messages=(),
                max_tokens=self.max_tokens,
                stop=self.stop,
                sampling=self.sampling,
                logprobs=self.logprobs is not None,
                top_logprobs=self.logprobs or 0,
                n=self.n,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_tokens=None if isinstance(prompt, str) else prompt,
                # The prompt's text gives text_offset its start, echoed or not.
                echo=self.echo or self.logprobs is not None,
                prompt_logprobs=self.echo and self.logprobs is not None,
            )
            for k, prompt in enumerate(self.prompts)
        ]


def parse_completion_request(
    body: bytes, check_model: CheckModel | None = None
) -> CompletionRequest:
    """Validate a `POST /v1/completions` body; raise `ApiError` (400) on any problem."""
    return parse_completion_object(read_json(body), check_model)


def parse_completion_object(data: Any, check_model: CheckModel | None = None) -> CompletionRequest:
    """Validate an already-decoded body. The model is examined first, as for chat."""
    model = read_model_first(data, _KNOWN, check_model)
    prompts = _prompts(read_required(data, "prompt", ""))
    stream = read_bool(data, "stream") or False
    include_usage, continuous = parse_stream_options(data.get("stream_options"), stream)
    max_tokens = read_int(data, "max_tokens", 0, INT64_MAX)
    sampling = parse_sampling(data)
    stop = parse_stop(data.get("stop"))
    logprobs = read_int(data, "logprobs", 0, MAX_LOGPROBS)
    echo = read_bool(data, "echo") or False
    n = read_int(data, "n", 1, MAX_N) or 1
    _best_of(read_int(data, "best_of", 0, MAX_BEST_OF), n, stream)
    if data.get("suffix") is not None:
        read_str(data, "suffix")
        fail_unsupported(
            "suffix", "inserting text (a suffix after the completion) is not implemented"
        )
    read_str(data, "user")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        stop=stop,
        sampling=sampling,
        n=n,
        echo=echo,
        logprobs=logprobs,
    )


# --- prompt ---------------------------------------------------------------------------------

_PROMPT_TYPES = (
    "one of a string, array of strings, array of integers, or array of arrays of integers"
)


def _prompts(value: Any) -> tuple[Prompt, ...]:
    if value is None:
        # OpenAI's default, the document separator: the start of a new document, which is
        # the tokenizer's beginning-of-text token on its own.
        return ("",)
    if type(value) is str:
        prompts: tuple[Prompt, ...] = (value,)
    elif type(value) is not list:
        fail_type("prompt", _PROMPT_TYPES, value)
    elif not value:
        fail_empty_array("prompt")
    elif type(value[0]) is int:
        prompts = (_token_ids(value, "prompt"),)
    else:
        if len(value) > MAX_PROMPTS:
            fail_array_too_long("prompt", MAX_PROMPTS, len(value))
        if type(value[0]) is str:
            prompts = tuple(_string(item, f"prompt[{i}]") for i, item in enumerate(value))
        elif type(value[0]) is list:
            prompts = tuple(_token_list(item, f"prompt[{i}]") for i, item in enumerate(value))
        else:
            fail_type("prompt[0]", "one of a string, an integer or an array of integers", value[0])
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    if chars > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"Invalid 'prompt': the prompt is too long ({chars} characters; at most "
            f"{MAX_PROMPT_CHARS} are accepted).",
            "prompt",
            "string_above_max_length",
        )
    ids = sum(len(p) for p in prompts if not isinstance(p, str))
    if ids > MAX_PROMPT_TOKEN_IDS:
        raise invalid_request(
            f"Invalid 'prompt': too many token ids ({ids}; at most {MAX_PROMPT_TOKEN_IDS} "
            "are accepted).",
            "prompt",
            "array_above_max_length",
        )
    return prompts


def _string(value: Any, param: str) -> str:
    if type(value) is not str:
        fail_type(param, "a string", value)
    return value


def _token_list(value: Any, param: str) -> tuple[int, ...]:
    if type(value) is not list:
        fail_type(param, "an array of integers", value)
    if not value:
        fail_empty_array(param)
    return _token_ids(value, param)


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    if len(value) > MAX_PROMPT_TOKEN_IDS:
        fail_array_too_long(param, MAX_PROMPT_TOKEN_IDS, len(value))
    for i, token in enumerate(value):
        if type(token) is not int:  # a bool is not a token id
            fail_type(f"{param}[{i}]", "an integer", token)
        check_range(f"{param}[{i}]", "integer", token, 0, MAX_TOKEN_ID)
    return tuple(value)


def _best_of(best_of: int | None, n: int, stream: bool) -> None:
    """best_of is honoured where it means n choices: OpenAI's constraint (at least n), and no
    streaming past 1; choosing the best of more than n is not implemented."""
    if best_of is None:
        return
    if best_of < n:
        raise invalid_request(
            f"Invalid value for 'best_of': {best_of} is less than n ({n}); best_of must be "
            "greater than or equal to n.",
            "best_of",
            "invalid_value",
        )
    if best_of > n:
        fail_unsupported_value("best_of", best_of, f"{n}, the value of n")
    if stream and best_of > 1:
        raise invalid_request(
            "Invalid value for 'best_of': results cannot be streamed with best_of greater than 1.",
            "best_of",
            "invalid_parameter_combination",
        )


# --- the objects ----------------------------------------------------------------------------
