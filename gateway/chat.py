"""`POST /v1/chat/completions`: OpenAI Chat Completions over SSE and plain JSON.

The request is validated (protocol.openai.request), handed to the pool, and the runner's
chunks are relayed as `chat.completion.chunk` events. Errors that happen before the first
byte (bad input, unknown model, queue full, a runner refusing the request) are HTTP errors
in OpenAI's shape; errors after it are an SSE error event followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson
from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.config import GatewayConfig
from gateway.errors import StreamTimeout
from gateway.http_errors import openai_error_for
from gateway.openapi import ChatCompletionsOperation
from gateway.pool import Pool
from gateway.sse import SseRelay, SseResponse
from gateway.stream import Failed, RequestStream, StreamItem, next_item
from protocol.frames import Chunk, Usage
from protocol.openai.request import ChatRequest, check_max_tokens, parse_chat_request
from protocol.openai.response import ChunkWriter, completion


def check_limits(chat: ChatRequest, config: GatewayConfig) -> ChatRequest:
    """Gateway-configured limits on top of the API's own validation."""
    check_max_tokens(chat, config.max_tokens_limit)
    return chat


@post("/v1/chat/completions", status_code=200, operation_class=ChatCompletionsOperation)
async def chat_completions(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a chat completion (OpenAI wire format; `stream: true` for SSE)."""
    pool: Pool = state.pool
    chat = check_limits(parse_chat_request(await request.body()), pool.config)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        stream = await pool.submit(chat.to_generate(completion_id))
    except Exception as exc:
        raise openai_error_for(exc) from exc
    if chat.stream:
        return await _streaming(pool, stream, chat, completion_id)
    return await _non_streaming(request, pool, stream, chat, completion_id)


async def _streaming(
    pool: Pool, stream: RequestStream, chat: ChatRequest, completion_id: str
) -> Response[Any]:
    config = pool.config
    try:
        first = await next_item(stream, min(config.first_token_wait, config.stream_timeout))
    except asyncio.CancelledError:
        pool.cancel(stream)
        raise
    if first is None and config.first_token_wait >= config.stream_timeout:
        first = Failed(StreamTimeout(config.stream_timeout))
    if first is not None and not isinstance(first, Chunk):
        # Nothing sent yet: a failure before the first token is a proper HTTP error.
        if not stream.done:
            pool.cancel(stream)  # timed out: the runner may still be working on it
        raise openai_error_for(first)
    writer = ChunkWriter(
        id=completion_id,
        created=int(time.time()),
        model=chat.model,
        include_usage=chat.include_usage,
        continuous_usage_stats=chat.continuous_usage_stats,
    )
    return SseResponse(SseRelay(pool.cancel, stream, writer, first, config))


async def _non_streaming(
    request: Request[Any, Any, Any],
    pool: Pool,
    stream: RequestStream,
    chat: ChatRequest,
    completion_id: str,
) -> Response[Any]:
    collector = asyncio.ensure_future(_collect(stream, pool.config.stream_timeout))
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collector, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collector.done():
            collector.cancel()
        if not stream.done:
            pool.cancel(stream)  # client gone, or the runner timed out: stop generating
    if not collector.done() or collector.cancelled():
        # The client is gone; this response is never read.
        return Response(content=b"", status_code=499)
    text, reasoning, last = collector.result()
    if not isinstance(last, Chunk):
        raise openai_error_for(last)
    usage: Usage = last.usage
    body = completion(
        id=completion_id,
        created=int(time.time()),
        model=chat.model,
        content=text,
        reasoning=reasoning,
        finish_reason=last.finish_reason or "stop",
        usage=usage,
    )
    return Response(content=orjson.dumps(body), media_type="application/json")


async def _collect(stream: RequestStream, seconds: float) -> tuple[str, str, StreamItem]:
    text: list[str] = []
    reasoning: list[str] = []
    while True:
        item = await next_item(stream, seconds)
        if item is None:
            item = Failed(StreamTimeout(seconds))
        if not isinstance(item, Chunk):
            return "".join(text), "".join(reasoning), item
        text.append(item.text)
        reasoning.append(item.reasoning)
        if item.finish_reason is not None:
            return "".join(text), "".join(reasoning), item


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
