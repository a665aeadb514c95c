"""The OpenAPI description of `POST /v1/completions` (OpenAI's legacy text completions), as
gateway.openapi describes the chat endpoint: the request body with the parser's own limits
(protocol.openai.completions), and the `text_completion` objects it answers (`TEXT_COMPLETION`
for both the body and each streamed event; OpenAI uses one shape for both), exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import attrs
from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, Operation, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType

from gateway.config import GatewayConfig
from gateway.openapi import _ERROR, _closed, _error, _EventStream, _number, _only
from gateway.openapi_responses import _FINGERPRINT, _USAGE
from protocol.openai.completions import (
    DEFAULT_MAX_TOKENS,
    MAX_BEST_OF,
    MAX_LOGPROBS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
)
from protocol.openai.request import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_MODEL_CHARS,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOKEN_ID,
    SAMPLING_RANGES,
    TOP_K_MIN,
)

_STRING = Schema(type=OpenAPIType.STRING)
_BOOLEAN = Schema(type=OpenAPIType.BOOLEAN)
_INTEGER = Schema(type=OpenAPIType.INTEGER)
_NULL = Schema(type=OpenAPIType.NULL)

# --- the request ----------------------------------------------------------------------------

_TOKEN = Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=MAX_TOKEN_ID)
_TOKENS = Schema(type=OpenAPIType.ARRAY, items=_TOKEN, min_items=1, max_items=MAX_PROMPT_TOKEN_IDS)
_PROMPT = Schema(
    one_of=[
        Schema(type=OpenAPIType.STRING, max_length=MAX_PROMPT_CHARS),
        Schema(
            type=OpenAPIType.ARRAY,
            items=Schema(type=OpenAPIType.STRING, max_length=MAX_PROMPT_CHARS),
            min_items=1,
            max_items=MAX_PROMPTS,
        ),
        _TOKENS,
        Schema(type=OpenAPIType.ARRAY, items=_TOKENS, min_items=1, max_items=MAX_PROMPTS),
        _NULL,
    ],
    description="A string, strings, token ids or lists of token ids (each of several prompts "
    "gets n choices, numbered prompt_index * n + choice); null is the start of a document. "
    f"At most {MAX_PROMPT_CHARS} characters and {MAX_PROMPT_TOKEN_IDS} token ids in all.",
)
_STOP_STRING = Schema(type=OpenAPIType.STRING, min_length=1, max_length=MAX_STOP_CHARS)


def _limit(name: str) -> int:
    """A gateway setting's default (a gateway may be started with another)."""
    value: int = getattr(attrs.fields(GatewayConfig), name).default
    return value


_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    required=["model", "prompt"],
    properties={
        "model": Schema(type=OpenAPIType.STRING, max_length=MAX_MODEL_CHARS),
        "prompt": _PROMPT,
        "stream": _BOOLEAN,
        "stream_options": _closed(
            [],
            include_usage=_BOOLEAN,
            include_obfuscation=_BOOLEAN,
            continuous_usage_stats=_BOOLEAN,
        ),
        "max_tokens": Schema(
            type=OpenAPIType.INTEGER,
            minimum=0,
            maximum=_limit("max_tokens_limit"),
            default=DEFAULT_MAX_TOKENS,
            description="0: no token (with echo, the prompt alone).",
        ),
        **{name: _number(name) for name in SAMPLING_RANGES},
        "top_k": Schema(type=OpenAPIType.INTEGER, minimum=TOP_K_MIN, maximum=INT64_MAX),
        "seed": Schema(type=OpenAPIType.INTEGER, minimum=INT64_MIN, maximum=INT64_MAX),
        "stop": Schema(
            one_of=[
                _STOP_STRING,
                Schema(type=OpenAPIType.ARRAY, items=_STOP_STRING, max_items=MAX_STOP),
            ]
        ),
        "logit_bias": Schema(
            type=OpenAPIType.OBJECT,
            property_names=Schema(type=OpenAPIType.STRING, pattern="^[0-9]{1,10}$"),
            additional_properties=Schema(type=OpenAPIType.NUMBER, minimum=-100, maximum=100),
            max_properties=MAX_LOGIT_BIAS,
            description=f"Token ids (at most {MAX_TOKEN_ID}) and their biases.",
        ),
        "logprobs": Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=MAX_LOGPROBS),
        "echo": _BOOLEAN,
        "n": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=_limit("max_choices")),
        "best_of": Schema(
            type=OpenAPIType.INTEGER,
            minimum=1,
            maximum=MAX_BEST_OF,
            description="Only n itself (choosing the best of more is not implemented), and "
            "not with stream past 1.",
        ),
        "suffix": Schema(type=OpenAPIType.NULL, description="Not implemented: only null."),
        "user": _STRING,
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
        _NULL,
        _closed(
            ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            tokens=Schema(type=OpenAPIType.ARRAY, items=_STRING),
            token_logprobs=Schema(
                type=OpenAPIType.ARRAY, items=Schema(type=[OpenAPIType.NUMBER, OpenAPIType.NULL])
            ),
            top_logprobs=Schema(
                type=OpenAPIType.ARRAY,
                items=Schema(
                    one_of=[
                        _NULL,
                        Schema(
                            type=OpenAPIType.OBJECT,
                            additional_properties=Schema(type=OpenAPIType.NUMBER),
                        ),
                    ]
                ),
            ),
            text_offset=Schema(
                type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.INTEGER, minimum=0)
            ),
        ),
    ],
    description="Null unless the request asked for logprobs; with echo the prompt's first "
    "token has null logprobs.",
)

TEXT_COMPLETION = _closed(
    ["id", "object", "created", "model", "system_fingerprint", "choices"],
    id=_STRING,
    object=_only("text_completion"),
    created=_INTEGER,
    model=_STRING,
    system_fingerprint=_FINGERPRINT,
    choices=Schema(
        type=OpenAPIType.ARRAY,
        items=_closed(
            ["text", "index", "logprobs", "finish_reason"],
            text=_STRING,
            index=Schema(type=OpenAPIType.INTEGER, minimum=0),
            logprobs=_LOGPROBS,
            finish_reason=Schema(
                type=[OpenAPIType.STRING, OpenAPIType.NULL], enum=["stop", "length", None]
            ),
        ),
        description="Every choice in a body; one per event of a stream, none in its last "
        "event with include_usage.",
    ),
    usage=Schema(
        one_of=[_NULL, _USAGE],
        description="Always in a body; in a stream only with stream_options.include_usage.",
    ),
)
"""A text_completion: the body, or one event of a stream (OpenAI uses one shape for both)."""


@dataclass
class CompletionsOperation(Operation):
    """Operation for the text completions endpoint, with its body and every status."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True, content={"application/json": MediaType(schema=_REQUEST)}
        )
        responses: dict[str, Any] = {
            "200": OpenAPIResponse(
                description="A text_completion, or with stream=true a text/event-stream of "
                "`data:` events (x-itemSchema: a text_completion, or an error that ends the "
                "stream), the last of them data: [DONE].",
                content={
                    "application/json": MediaType(schema=TEXT_COMPLETION),
                    "text/event-stream": _EventStream(
                        schema=_STRING, item_schema=Schema(one_of=[TEXT_COMPLETION, _ERROR])
                    ),
                },
            ),
            "400": _error("Invalid request (the error names the parameter)."),
            "401": _error("Missing or wrong API key."),
            "403": _error("Origin not allowed."),
            "404": _error("No runner serves the model."),
            "413": _error("Body too large."),
            "429": _error("Every runner is busy and the model's queue is full or timed out."),
            "502": _error("The runner was lost."),
            "503": _error("The model's runners are reconnecting, or the gateway is stopping."),
            "504": _error("The runner sent nothing for the stream timeout."),
        }
        self.responses = responses
