"""`POST /v1/chat/completions`: OpenAI Chat Completions over SSE and plain JSON.

The request is validated (protocol.openai.chat.request) and handed to the pool. A streamed answer
is relayed to the client by `gateway.streaming.relay.Relay` over
`gateway.streaming.sse.SseTransport`; a plain one is collected by
`protocol.core.stream.CompletionBuilder`. Errors that happen before the first byte (bad input,
unknown model, queue full, a runner refusing the request) are HTTP errors in OpenAI's shape; errors
after it are an SSE error event followed by `[DONE]`.

Every response has an `x-request-id` header, as OpenAI's; a `store: true` request's stored
completion (gateway.stores.chat) names it as its `request_id`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.config import GatewayConfig
from gateway.http_errors import api_error_for
from gateway.openai.chat.openapi import ChatCompletionsOperation
from gateway.pool.pool import Pool
from gateway.stores.chat import CompletionStore, Keeper, keepable
from gateway.streaming.relay import Relay, collect, first_item
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.sse import SseResponse, SseTransport, disconnected
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk
from protocol.openai.chat.request import (
    ChatRequest,
    check_choices,
    check_max_tokens,
    parse_chat_request,
)
from protocol.openai.chat.response import ChunkWriter, chat_completion_body
from protocol.openai.sse import SSE


def check_limits(chat: ChatRequest, config: GatewayConfig) -> ChatRequest:
    """Gateway-configured limits on top of the API's own validation."""
    check_max_tokens(chat, config.max_tokens_limit)
    check_choices(chat, config.max_choices)
    return chat


@post("/v1/chat/completions", status_code=200, operation_class=ChatCompletionsOperation)
async def chat_completions(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a chat completion (OpenAI wire format; `stream: true` for SSE)."""
    pool: Pool = state.pool
    store: CompletionStore = state.store

    def check_model(model: str) -> None:
        try:
            pool.check_model(model, "chat")
        except Exception as exc:
            raise api_error_for(exc) from exc

    body = await request.body()
    chat = check_limits(parse_chat_request(body, check_model, store=store.enabled), pool.config)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    request_id = f"req_{uuid.uuid4().hex}"
    try:
        stream = await pool.submit(chat.to_generate(completion_id), "chat")
    except Exception as exc:
        raise api_error_for(exc) from exc
    if chat.stream:
        response = await _streaming(
            pool, stream, chat, completion_id, store=store, request_id=request_id
        )
    else:
        response = await _non_streaming(
            request, pool, stream, chat, completion_id, store=store, request_id=request_id
        )
    response.headers["x-request-id"] = request_id
    return response


async def _streaming(
    pool: Pool,
    stream: RequestStream,
    chat: ChatRequest,
    completion_id: str,
    *,
    store: CompletionStore,
    request_id: str,
) -> Response[Any]:
    first = await first_item(stream, pool.config, pool.cancel)
    if first is not None and not isinstance(first, Chunk):
        raise api_error_for(first)  # nothing sent yet: a proper HTTP error
    created = int(time.time())
    fingerprint = pool.fingerprint(chat.model)
    completion = CompletionStream(
        id=completion_id,
        created=created,
        model=chat.model,
        include_usage=chat.include_usage,
        continuous_usage_stats=chat.continuous_usage_stats,
        logprobs=chat.logprobs,
        fingerprint=fingerprint,
        n=chat.n,
        framing=SSE,
        writer=ChunkWriter,
    )
    keeper = Keeper.of(
        store,
        chat,
        id=completion_id,
        created=created,
        fingerprint=fingerprint,
        request_id=request_id,
    )
    transport = SseTransport()
    relay = Relay(stream, completion, transport, pool.config, pool.cancel, keeper=keeper)
    return SseResponse(relay, transport, first)


async def _non_streaming(
    request: Request[Any, Any, Any],
    pool: Pool,
    stream: RequestStream,
    chat: ChatRequest,
    completion_id: str,
    *,
    store: CompletionStore,
    request_id: str,
) -> Response[Any]:
    builder = CompletionBuilder(logprobs=chat.logprobs, n=chat.n)
    timeout = pool.config.stream_timeout
    if not await collect(stream, builder, timeout, pool.cancel, disconnected(request)):
        return Response(content=b"", status_code=499)  # the client is gone: never read
    body = chat_completion_body(
        builder,
        id=completion_id,
        created=int(time.time()),
        model=chat.model,
        fingerprint=pool.fingerprint(chat.model),
    )
    if chat.store is not None and keepable(builder):
        store.keep(body, chat.store, request_id)
    return Response(content=orjson.dumps(body), media_type="application/json")
