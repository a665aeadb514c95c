"""`POST /v1/completions`: OpenAI's legacy text completions over SSE and plain JSON.

The legacy dialect on the shared endpoint (gateway.streaming.endpoint): the body is validated
(protocol.openai.completions, the model first), each prompt goes to the pool as its own
request, merged into one stream (gateway.streaming.fanin), and the answer is
`TextCompletionWriter`'s text_completion objects over SSE, or the body of the collected
chunks. Errors before the first byte are HTTP errors in OpenAI's shape; after it an SSE error
event and `[DONE]`. A client that goes away cancels every prompt.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.openai.completions.openapi import CompletionsOperation
from gateway.streaming.endpoint import Context, Dialect, Plan, serve
from protocol.core.stream import CompletionBuilder
from protocol.openai.completions.request import parse_completion_request
from protocol.openai.completions.response import TextCompletionWriter, text_completion_body
from protocol.openai.sse import SSE


def plan(body: bytes, context: Context) -> Plan:
    parsed = parse_completion_request(body, context.check_model)
    parsed.check_ceilings(context.config.max_tokens_limit, context.config.max_choices)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    logprobs = parsed.logprobs is not None
    fingerprint = context.pool.fingerprint(parsed.model)

    def answer(builder: CompletionBuilder) -> dict[str, Any]:
        return text_completion_body(
            builder,
            id=completion_id,
            created=created,
            model=parsed.model,
            echo=parsed.echo,
            logprobs=logprobs,
            fingerprint=fingerprint,
        )

    def writer() -> TextCompletionWriter:
        return TextCompletionWriter(
            completion_id,
            created,
            parsed.model,
            parsed.include_usage,
            parsed.continuous_usage_stats,
            logprobs=logprobs,
            fingerprint=fingerprint,
            prefix=SSE.chunk_prefix,
            suffix=SSE.chunk_suffix,
            echo=parsed.echo,
        )

    return Plan(
        id=completion_id,
        model=parsed.model,
        generates=parsed.to_generates(completion_id),
        stream=parsed.stream,
        body=answer,
        writer=writer,
        framing=SSE,
        n=parsed.choices,
        builder=lambda: CompletionBuilder(n=parsed.choices),
        headers={"x-request-id": f"req_{uuid.uuid4().hex}"},
    )


COMPLETIONS = Dialect("completions", plan)


@post("/v1/completions", status_code=200, operation_class=CompletionsOperation)
async def completions(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a text completion (OpenAI's legacy API; `stream: true` for SSE)."""
    return await serve(request, state, COMPLETIONS)
