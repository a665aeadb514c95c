"""The OpenAPI description of `POST /v1/completions` (OpenAI's legacy text completions), as
gateway.openai.chat.openapi describes the chat endpoint: the request body with the parser's own
limits (protocol.openai.completions), and the `text_completion` objects it answers
(`TEXT_COMPLETION` for both the body and each streamed event; OpenAI uses one shape for both),
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from litestar.openapi.spec import Operation, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.openai.chat.openapi_answers import USAGE, openai_object
from gateway.openapi import (
    BOOLEAN,
    COUNT,
    DECODING,
    MODEL,
    NULL,
    PROMPT_TEXT,
    STRING,
    UNIMPLEMENTED_NULL,
    closed,
    generation_responses,
    json_body,
    limit,
    only_or_null,
)
from protocol.core.limits import MAX_PROMPT_CHARS
from protocol.openai.completions.request import (
    DEFAULT_MAX_TOKENS,
    MAX_BEST_OF,
    MAX_LOGPROBS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
)
from protocol.openai.params import MAX_LOGIT_BIAS, MAX_TOKEN_ID

# --- the request ----------------------------------------------------------------------------

_TOKEN = Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=MAX_TOKEN_ID)
_TOKENS = Schema(type=OpenAPIType.ARRAY, items=_TOKEN, min_items=1, max_items=MAX_PROMPT_TOKEN_IDS)
_PROMPT = Schema(
    one_of=[
        PROMPT_TEXT,
        Schema(type=OpenAPIType.ARRAY, items=PROMPT_TEXT, min_items=1, max_items=MAX_PROMPTS),
        _TOKENS,
        Schema(type=OpenAPIType.ARRAY, items=_TOKENS, min_items=1, max_items=MAX_PROMPTS),
        NULL,
    ],
    description="A string, strings, token ids or lists of token ids (each of several prompts "
    "gets n choices, numbered prompt_index * n + choice); null is the start of a document. "
    f"At most {MAX_PROMPT_CHARS} characters and {MAX_PROMPT_TOKEN_IDS} token ids in all.",
)

_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "prompt"],
    properties={
        "model": MODEL,
        "prompt": _PROMPT,
        "stream": BOOLEAN,
        "stream_options": closed(
            [],
            include_usage=BOOLEAN,
            include_obfuscation=BOOLEAN,
            continuous_usage_stats=BOOLEAN,
        ),
        "max_tokens": Schema(
            type=OpenAPIType.INTEGER,
            minimum=0,
            maximum=limit("max_tokens_limit"),
            default=DEFAULT_MAX_TOKENS,
            description="0: no token (with echo, the prompt alone).",
        ),
        **DECODING,
        "logit_bias": Schema(
            type=OpenAPIType.OBJECT,
            property_names=Schema(type=OpenAPIType.STRING, pattern="^[0-9]{1,10}$"),
            additional_properties=Schema(type=OpenAPIType.NUMBER, minimum=-100, maximum=100),
            max_properties=MAX_LOGIT_BIAS,
            description=f"Token ids (at most {MAX_TOKEN_ID}) and their biases.",
        ),
        "logprobs": Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=MAX_LOGPROBS),
        "echo": BOOLEAN,
        "n": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=limit("max_choices")),
        "best_of": Schema(
            type=OpenAPIType.INTEGER,
            minimum=1,
            maximum=MAX_BEST_OF,
            description="Only n itself (choosing the best of more is not implemented), and "
            "not with stream past 1.",
        ),
        "suffix": UNIMPLEMENTED_NULL,
        "user": STRING,
    },
    additional_properties=False,
    dependent_schemas={
        "stream_options": Schema(required=["stream"], properties={"stream": Schema(const=True)}),
    },
    description="OpenAI's CreateCompletionRequest, the subset Orchard implements (see README).",
)

# --- the answers ----------------------------------------------------------------------------

_LOGPROBS = Schema(
    one_of=[
        NULL,
        closed(
            ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            tokens=Schema(type=OpenAPIType.ARRAY, items=STRING),
            token_logprobs=Schema(
                type=OpenAPIType.ARRAY, items=Schema(type=[OpenAPIType.NUMBER, OpenAPIType.NULL])
            ),
            top_logprobs=Schema(
                type=OpenAPIType.ARRAY,
                items=Schema(
                    one_of=[
                        NULL,
                        Schema(
                            type=OpenAPIType.OBJECT,
                            additional_properties=Schema(type=OpenAPIType.NUMBER),
                        ),
                    ]
                ),
            ),
            text_offset=Schema(type=OpenAPIType.ARRAY, items=COUNT),
        ),
    ],
    description="Null unless the request asked for logprobs; with echo the prompt's first "
    "token has null logprobs.",
)

TEXT_COMPLETION = openai_object(
    "text_completion",
    ["choices"],
    choices=Schema(
        type=OpenAPIType.ARRAY,
        items=closed(
            ["text", "index", "logprobs", "finish_reason"],
            text=STRING,
            index=COUNT,
            logprobs=_LOGPROBS,
            finish_reason=only_or_null("stop", "length"),
        ),
        description="Every choice in a body; one per event of a stream, none in its last "
        "event with include_usage.",
    ),
    usage=Schema(
        one_of=[NULL, USAGE],
        description="Always in a body; in a stream only with stream_options.include_usage.",
    ),
)
"""A text_completion: the body, or one event of a stream (OpenAI uses one shape for both)."""


@dataclass
class CompletionsOperation(Operation):
    """Operation for the text completions endpoint, with its body and every status."""

    def __post_init__(self) -> None:
        self.request_body = json_body(_REQUEST)
        self.responses = generation_responses(
            TEXT_COMPLETION, "text_completion", TEXT_COMPLETION, "text_completion"
        )
