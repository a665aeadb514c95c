"""The Ollama API: `POST /api/chat` and `POST /api/generate` on Orchard's streaming core, and
the model endpoints of gateway.ollama.models.

The request is validated (protocol.ollama.request; the model first) and handed to the pool,
on the shared endpoint (gateway.streaming.endpoint). Ollama streams unless `"stream": false`:
the answer is NDJSON lines (protocol.ollama.stream's `OllamaWriter`) over the SSE transport's
response with Ollama's content type and no keep-alives (a comment line is no JSON); a plain
answer is collected by a `TimedBuilder`. Errors
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

from gateway.ollama import models as ollama_models
from gateway.ollama.openapi import ChatOperation, GenerateOperation
from gateway.streaming.endpoint import Context, Dialect, Plan, serve
from protocol.core.limits import CheckModel
from protocol.core.stream import CompletionBuilder
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
Parse = Callable[[bytes, CheckModel], OllamaRequest]


def planner(parse: Parse) -> Callable[[bytes, Context], Plan]:
    """The plan of `/api/chat` or `/api/generate` (`parse` reads which)."""

    def plan(body: bytes, context: Context) -> Plan:
        parsed = parse(body, context.check_model)
        parsed.check_ceilings(context.config.max_tokens_limit, context.config.max_choices)
        request_id = f"ollama-{uuid.uuid4().hex}"
        timings = Timings(context.arrived, context.arrived)

        def placed() -> None:
            timings.dispatched = time.perf_counter_ns()

        def writer() -> OllamaWriter:
            placed()
            return OllamaWriter(
                parsed.endpoint,
                parsed.model,
                timings,
                wall=time.time_ns,
                mono=time.perf_counter_ns,
                suffix=NDJSON.chunk_suffix,
            )

        def builder() -> TimedBuilder:
            placed()
            return TimedBuilder(timings, time.perf_counter_ns)

        def answer(collected: CompletionBuilder) -> dict[str, Any]:
            assert isinstance(collected, TimedBuilder)
            return answer_body(
                collected,
                parsed.endpoint,
                parsed.model,
                wall=time.time_ns,
                mono=time.perf_counter_ns,
            )

        return Plan(
            id=request_id,
            model=parsed.model,
            generates=(parsed.to_generate(request_id),),
            stream=parsed.stream,
            body=answer,
            writer=writer,
            framing=NDJSON,
            builder=builder,
            early=_loaded(parsed) if parsed.load_only else None,
        )

    return plan


def _loaded(parsed: OllamaRequest) -> Response[Any]:
    """The answer to a request that only loads its model (it always is loaded)."""
    body = orjson.dumps(load_body(parsed.endpoint, parsed.model, time.time_ns()))
    if parsed.stream:
        return Response(content=body + b"\n", media_type=NDJSON_TYPE)
    return Response(content=body, media_type="application/json")


CHAT = Dialect(
    "ollama", planner(parse_chat), keepalive=None, media_type=NDJSON_TYPE, terms=in_ollama_terms
)
GENERATE = Dialect(
    "ollama",
    planner(parse_generate),
    keepalive=None,
    media_type=NDJSON_TYPE,
    terms=in_ollama_terms,
)


@post("/api/chat", status_code=200, operation_class=ChatOperation)
async def chat(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Chat with a model (Ollama's API; streams NDJSON unless `"stream": false`)."""
    return await serve(request, state, CHAT)


@post("/api/generate", status_code=200, operation_class=GenerateOperation)
async def generate(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Complete a prompt (Ollama's API; streams NDJSON unless `"stream": false`)."""
    return await serve(request, state, GENERATE)


ROUTES: list[Any] = [chat, generate, *ollama_models.ROUTES]
"""This dialect's route handlers, mounted by gateway.ollama."""
