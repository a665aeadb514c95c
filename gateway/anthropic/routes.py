"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The chat's path (gateway.openai.chat.routes) in Anthropic's shapes: the body is validated
(protocol.anthropic.request, the model first), the request goes to the pool, and the answer
is relayed by a `Relay` over SSE with `MessageWriter`'s events in the chat's
`CompletionStream` (protocol.anthropic.stream), or collected by a `CompletionBuilder` into a
`message`. Errors before the first byte are HTTP errors in Anthropic's shape (gateway.
http_errors picks the shape by path), after it an `error` event. Disconnects cancel the
request, the queue's 429/503 and API keys (`x-api-key` too) are the pool's and auth's, as for
the chat. The keep-alive is Anthropic's `ping` event.

count_tokens runs the request with `max_tokens` 0: a runner templates and tokenizes the
prompt, generates nothing, and answers with its usage, whose prompt_tokens is the count.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.anthropic.openapi import CountTokensOperation, MessagesOperation
from gateway.http_errors import api_error_for
from gateway.pool.pool import Pool
from gateway.streaming.relay import Relay, collect, first_item
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.sse import SseResponse, SseTransport, disconnected
from protocol.anthropic.request import (
    MessagesRequest,
    parse_count_request,
    parse_messages_request,
)
from protocol.anthropic.stream import ANTHROPIC_SSE, PING, MessageWriter, message_body
from protocol.core.errors import ApiError, invalid_request
from protocol.core.limits import CheckModel
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk


class PingTransport(SseTransport):
    """SSE whose silences are filled with Anthropic's `ping` event."""

    __slots__ = ()

    keepalive = PING


def _check_model(pool: Pool) -> CheckModel:
    """The parser's model check: an unknown model's 404 (or 503) before anything else."""

    def check_model(model: str) -> None:
        try:
            pool.check_model(model, "anthropic")
        except Exception as exc:
            raise api_error_for(exc) from exc

    return check_model


async def _submit(pool: Pool, parsed: MessagesRequest, request_id: str) -> RequestStream:
    try:
        return await pool.submit(parsed.to_generate(request_id), "anthropic")
    except Exception as exc:
        raise api_error_for(exc) from exc


def _thinking_error(err: ApiError) -> ApiError:
    """A runner's refusal of reasoning_effort is, in this dialect, a refusal of `thinking`."""
    if err.param == "reasoning_effort":
        return invalid_request(
            "thinking: this model has no think markers, so thinking cannot be turned on or off.",
            "thinking",
        )
    return err


@post("/v1/messages", status_code=200, operation_class=MessagesOperation)
async def create_message(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a message (Anthropic's Messages API; `stream: true` for SSE)."""
    pool: Pool = state.pool
    parsed = parse_messages_request(await request.body(), _check_model(pool))
    limit = pool.config.max_tokens_limit
    if parsed.max_tokens > limit:
        raise invalid_request(
            f"max_tokens: {parsed.max_tokens} is more than this gateway allows ({limit}).",
            "max_tokens",
        )
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    stream = await _submit(pool, parsed, message_id)
    if parsed.stream:
        response = await _streaming(pool, stream, parsed, message_id)
    else:
        response = await _non_streaming(request, pool, stream, parsed, message_id)
    response.headers["request-id"] = f"req_{uuid.uuid4().hex}"
    return response


async def _streaming(
    pool: Pool, stream: RequestStream, parsed: MessagesRequest, message_id: str
) -> Response[Any]:
    first = await first_item(stream, pool.config, pool.cancel)
    if first is not None and not isinstance(first, Chunk):
        raise _thinking_error(api_error_for(first))  # nothing sent yet: an HTTP error
    completion = CompletionStream(
        id=message_id,
        created=int(time.time()),
        model=parsed.model,
        framing=ANTHROPIC_SSE,
        writer=MessageWriter.factory,
    )
    transport = PingTransport()
    relay = Relay(stream, completion, transport, pool.config, pool.cancel)
    return SseResponse(relay, transport, first)


async def _collected(
    request: Request[Any, Any, Any], pool: Pool, stream: RequestStream
) -> CompletionBuilder | None:
    """The whole answer; None: the client left."""
    builder = CompletionBuilder()
    timeout = pool.config.stream_timeout
    if not await collect(stream, builder, timeout, pool.cancel, disconnected(request)):
        return None
    return builder


async def _non_streaming(
    request: Request[Any, Any, Any],
    pool: Pool,
    stream: RequestStream,
    parsed: MessagesRequest,
    message_id: str,
) -> Response[Any]:
    builder = await _collected(request, pool, stream)
    if builder is None:
        return Response(content=b"", status_code=499)  # the client is gone: never read
    try:
        choices, usage = builder.result()
    except ApiError as err:
        raise _thinking_error(err) from err
    body = message_body(choices[0], usage, id=message_id, model=parsed.model)
    return Response(content=orjson.dumps(body), media_type="application/json")


@post("/v1/messages/count_tokens", status_code=200, operation_class=CountTokensOperation)
async def count_tokens(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Count a request's input tokens (its prompt through the model's chat template)."""
    pool: Pool = state.pool
    parsed = parse_count_request(await request.body(), _check_model(pool))
    stream = await _submit(pool, parsed, f"count_{uuid.uuid4().hex[:24]}")
    builder = await _collected(request, pool, stream)
    if builder is None:
        return Response(content=b"", status_code=499)
    try:
        _, usage = builder.result()
    except ApiError as err:
        raise _thinking_error(err) from err
    response = Response(
        content=orjson.dumps({"input_tokens": usage.prompt_tokens}),
        media_type="application/json",
    )
    response.headers["request-id"] = f"req_{uuid.uuid4().hex}"
    return response


ROUTES: list[Any] = [create_message, count_tokens]
"""This dialect's route handlers, registered by gateway.app."""
