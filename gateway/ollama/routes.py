"""The Ollama API: `POST /api/chat` and `POST /api/generate` on Orchard's streaming core, and
the model endpoints of gateway.ollama.models.

The request is validated (protocol.ollama.request; the model first) and handed to the pool,
as for Chat Completions (gateway.openai.chat.routes). Ollama streams unless `"stream": false`: the
answer is relayed by a `Relay` writing NDJSON lines (protocol.ollama.stream's `OllamaWriter` in the
chat's `CompletionStream`) over the SSE transport's response with Ollama's content type and no
keep-alives (a comment line is no JSON); a plain answer is collected by a `TimedBuilder`. Errors
before the first line (bad input, unknown model, queue full, a runner refusing) are HTTP errors in
Ollama's shape; after it the line `{"error": ...}` ends the stream. A client that goes away cancels
the request on its runner.

The routes are described in the OpenAPI document (`/schema`) by gateway.ollama.openapi.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.http_errors import api_error_for
from gateway.ollama import models as ollama_models
from gateway.ollama.openapi import ChatOperation, GenerateOperation
from gateway.pool.pool import Pool
from gateway.streaming.relay import Relay, collect, first_item
from gateway.streaming.request_stream import RequestStream, StreamItem
from gateway.streaming.sse import SseResponse, SseTransport, disconnected
from protocol.core.errors import ApiError, invalid_request
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk
from protocol.ollama.request import OllamaRequest, in_ollama_terms, parse_chat, parse_generate
from protocol.ollama.stream import (
    NDJSON,
    OllamaWriter,
    TimedBuilder,
    Timings,
    answer_body,
    load_body,
)

NDJSON_TYPE = "application/x-ndjson"
Parse = Callable[[bytes, Callable[[str], None]], OllamaRequest]


class NdjsonTransport(SseTransport):
    """The SSE transport's writer with no keep-alive: every NDJSON line must be an object."""

    __slots__ = ()

    keepalive = None  # type: ignore[assignment]  # the relay then only keeps the timeout


class NdjsonResponse(SseResponse):
    """A relayed response body of NDJSON lines."""

    def __init__(self, relay: Relay, transport: NdjsonTransport, first: StreamItem | None) -> None:
        super().__init__(relay, transport, first)
        self.media_type = NDJSON_TYPE


@post("/api/chat", status_code=200, operation_class=ChatOperation)
async def chat(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Chat with a model (Ollama's API; streams NDJSON unless `"stream": false`)."""
    return await _answer(request, state.pool, parse_chat)


@post("/api/generate", status_code=200, operation_class=GenerateOperation)
async def generate(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Complete a prompt (Ollama's API; streams NDJSON unless `"stream": false`)."""
    return await _answer(request, state.pool, parse_generate)


async def _answer(request: Request[Any, Any, Any], pool: Pool, parse: Parse) -> Response[Any]:
    arrived = time.perf_counter_ns()

    def check_model(model: str) -> None:
        try:
            pool.check_model(model, "ollama")
        except Exception as exc:
            raise in_ollama_terms(api_error_for(exc), model) from exc

    parsed = parse(await request.body(), check_model)
    limit = pool.config.max_tokens_limit
    if parsed.max_tokens is not None and parsed.max_tokens > limit:
        raise invalid_request(
            f"options.num_predict is {parsed.max_tokens}; this gateway allows at most {limit}.",
            "options.num_predict",
            "integer_above_max_value",
        )
    if parsed.load_only:
        body = orjson.dumps(load_body(parsed.endpoint, parsed.model, time.time_ns()))
        if parsed.stream:
            return Response(content=body + b"\n", media_type=NDJSON_TYPE)
        return Response(content=body, media_type="application/json")
    try:
        stream = await pool.submit(parsed.to_generate(f"ollama-{uuid.uuid4().hex}"), "ollama")
    except Exception as exc:
        raise api_error_for(exc) from exc
    timings = Timings(arrived, time.perf_counter_ns())
    if parsed.stream:
        return await _streaming(pool, stream, parsed, timings)
    return await _non_streaming(request, pool, stream, parsed, timings)


async def _streaming(
    pool: Pool, stream: RequestStream, parsed: OllamaRequest, timings: Timings
) -> Response[Any]:
    first = await first_item(stream, pool.config, pool.cancel)
    if first is not None and not isinstance(first, Chunk):
        # Nothing sent yet: a proper HTTP error.
        raise in_ollama_terms(api_error_for(first), parsed.model)
    completion = CompletionStream(
        id=stream.request_id,
        created=0,
        model=parsed.model,
        framing=NDJSON,
        writer=OllamaWriter.factory(
            parsed.endpoint, parsed.model, timings, wall=time.time_ns, mono=time.perf_counter_ns
        ),
    )
    transport = NdjsonTransport()
    relay = Relay(stream, completion, transport, pool.config, pool.cancel)
    return NdjsonResponse(relay, transport, first)


async def _non_streaming(
    request: Request[Any, Any, Any],
    pool: Pool,
    stream: RequestStream,
    parsed: OllamaRequest,
    timings: Timings,
) -> Response[Any]:
    builder = TimedBuilder(timings, time.perf_counter_ns)
    timeout = pool.config.stream_timeout
    if not await collect(stream, builder, timeout, pool.cancel, disconnected(request)):
        return Response(content=b"", status_code=499)  # the client is gone: never read
    try:
        body = answer_body(
            builder, parsed.endpoint, parsed.model, wall=time.time_ns, mono=time.perf_counter_ns
        )
    except ApiError as err:
        raise in_ollama_terms(err, parsed.model) from None
    return Response(content=orjson.dumps(body), media_type="application/json")


ROUTES: list[Any] = [chat, generate, *ollama_models.ROUTES]
"""This dialect's route handlers, registered by gateway.app."""
