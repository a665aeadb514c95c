"""`POST /v1/completions`: OpenAI's legacy text completions over SSE and plain JSON.

The same path as chat (gateway.openai.chat.routes): the body is validated
(protocol.openai.completions, the model first), each prompt goes to the pool as its own request, and
the answer is relayed by a `Relay` over SSE with the text_completion objects (`TextCompletionWriter`
in the chat's `CompletionStream`), or collected by a `CompletionBuilder`. Several prompts are merged
into one stream (gateway.streaming.fanin). Errors before the first byte are HTTP errors in OpenAI's
shape; after it an SSE error event and `[DONE]`. A client that goes away cancels every prompt.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.http_errors import api_error_for
from gateway.openai.completions.openapi import CompletionsOperation
from gateway.pool.pool import Pool
from gateway.streaming.fanin import FanIn
from gateway.streaming.relay import Relay, collect, first_item
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.sse import SseResponse, SseTransport, disconnected
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk
from protocol.openai.completions.request import (
    CompletionRequest,
    check_limits,
    parse_completion_request,
)
from protocol.openai.completions.response import TextCompletionWriter, text_completion_body
from protocol.openai.sse import SSE

Cancel = Callable[[RequestStream], None]


@post("/v1/completions", status_code=200, operation_class=CompletionsOperation)
async def completions(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a text completion (OpenAI's legacy API; `stream: true` for SSE)."""
    pool: Pool = state.pool

    def check_model(model: str) -> None:
        try:
            pool.check_model(model, "completions")
        except Exception as exc:
            raise api_error_for(exc) from exc

    parsed = parse_completion_request(await request.body(), check_model)
    check_limits(parsed, pool.config.max_tokens_limit, pool.config.max_choices)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    try:
        stream, cancel = await _submit(pool, completion_id, parsed)
    except Exception as exc:
        raise api_error_for(exc) from exc
    if parsed.stream:
        response = await _streaming(pool, stream, cancel, parsed, completion_id)
    else:
        response = await _non_streaming(
            request, pool, stream, cancel=cancel, parsed=parsed, completion_id=completion_id
        )
    response.headers["x-request-id"] = f"req_{uuid.uuid4().hex}"
    return response


async def _submit(
    pool: Pool, completion_id: str, parsed: CompletionRequest
) -> tuple[RequestStream, Cancel]:
    """Give every prompt to the pool; one stream to read and how to cancel it. If one cannot
    be placed (queue full, no runner), those placed already are cancelled."""
    generates = parsed.to_generates(completion_id)
    if len(generates) == 1:
        return await pool.submit(generates[0], "completions"), pool.cancel
    tasks = [asyncio.ensure_future(pool.submit(generate, "completions")) for generate in generates]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                pool.cancel(task.result())
        raise
    fan_in = FanIn(completion_id, [task.result() for task in tasks], parsed.n, pool.cancel)
    return fan_in.stream, fan_in.cancel


async def _streaming(
    pool: Pool,
    stream: RequestStream,
    cancel: Cancel,
    parsed: CompletionRequest,
    completion_id: str,
) -> Response[Any]:
    first = await first_item(stream, pool.config, cancel)
    if first is not None and not isinstance(first, Chunk):
        raise api_error_for(first)  # nothing sent yet: a proper HTTP error
    completion = CompletionStream(
        id=completion_id,
        created=int(time.time()),
        model=parsed.model,
        include_usage=parsed.include_usage,
        continuous_usage_stats=parsed.continuous_usage_stats,
        logprobs=parsed.logprobs is not None,
        fingerprint=pool.fingerprint(parsed.model),
        n=parsed.choices,
        framing=SSE,
        writer=TextCompletionWriter.factory(echo=parsed.echo),
    )
    transport = SseTransport()
    relay = Relay(stream, completion, transport, pool.config, cancel)
    return SseResponse(relay, transport, first)


async def _non_streaming(
    request: Request[Any, Any, Any],
    pool: Pool,
    stream: RequestStream,
    *,
    cancel: Cancel,
    parsed: CompletionRequest,
    completion_id: str,
) -> Response[Any]:
    builder = CompletionBuilder(n=parsed.choices)
    timeout = pool.config.stream_timeout
    if not await collect(stream, builder, timeout, cancel, disconnected(request)):
        return Response(content=b"", status_code=499)  # the client is gone: never read
    body = text_completion_body(
        builder,
        id=completion_id,
        created=int(time.time()),
        model=parsed.model,
        echo=parsed.echo,
        logprobs=parsed.logprobs is not None,
        fingerprint=pool.fingerprint(parsed.model),
    )
    return Response(content=orjson.dumps(body), media_type="application/json")
