"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

The chat's path (gateway.openai.chat.routes) with the Responses objects: the body is validated
(protocol.openai.responses, the model first), the request goes to the pool, a streamed
answer is relayed by a `Relay` over SSE with `ResponseEvents` as the chat's
`CompletionStream`'s writer and framing (protocol.openai.responses.events), a plain one is
collected by a `CompletionBuilder`. So failover before the first token, the queue's 429/503,
the stream timeout and cancelling on disconnect are the chat's. Errors before the first byte
are HTTP errors in OpenAI's shape; after it, `response.failed`.

Stored responses (gateway.stores.responses) live in the app's state, made on first use with
the stored completions' limits.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from litestar import Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.params import FromPath

from gateway.http_errors import api_error_for
from gateway.openai.responses.openapi import (
    CreateResponseOperation,
    DeleteResponseOperation,
    GetResponseOperation,
)
from gateway.pool.pool import Pool
from gateway.stores.responses import ResponseStore
from gateway.streaming.relay import Relay, collect, first_item
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.sse import SseResponse, SseTransport, disconnected
from protocol.core.errors import invalid_request
from protocol.core.fields import fail_unknown
from protocol.core.stream import CompletionBuilder, CompletionStream
from protocol.frames import Chunk, Message
from protocol.openai.responses.events import (
    ResponseEvents,
    output_messages,
    response_base,
    response_body,
)
from protocol.openai.responses.request import parse_responses_request


def response_store(state: State) -> ResponseStore:
    """The app's stored responses (made on first use)."""
    store: ResponseStore | None = getattr(state, "responses", None)
    if store is None:
        store = ResponseStore.from_config(state.pool.config)
        state.responses = store
    return store


@post("/v1/responses", status_code=200, operation_class=CreateResponseOperation)
async def create_response(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a model response (OpenAI's Responses API; `stream: true` for SSE)."""
    pool: Pool = state.pool
    store = response_store(state)

    def check_model(model: str) -> None:
        try:
            pool.check_model(model, "responses")
        except Exception as exc:
            raise api_error_for(exc) from exc

    parsed = parse_responses_request(await request.body(), check_model, store=store.enabled)
    limit = pool.config.max_tokens_limit
    if parsed.max_output_tokens is not None and parsed.max_output_tokens > limit:
        raise invalid_request(
            f"max_output_tokens is {parsed.max_output_tokens}; this gateway allows at most "
            f"{limit}.",
            "max_output_tokens",
            "integer_above_max_value",
        )
    history: tuple[Message, ...] = ()
    if parsed.previous_response_id is not None:
        history = store.conversation(parsed.previous_response_id)
    response_id = f"resp_{uuid.uuid4().hex}"
    base = response_base(parsed, id=response_id, created_at=int(time.time()), store=parsed.store)
    conversation = (*history, *parsed.input)

    def keep(response: dict[str, Any]) -> None:
        if parsed.store:
            store.keep(response, (*conversation, *output_messages(response["output"])))

    try:
        stream = await pool.submit(parsed.to_generate(response_id, history), "responses")
    except Exception as exc:
        raise api_error_for(exc) from exc
    if parsed.stream:
        first = await first_item(stream, pool.config, pool.cancel)
        if first is not None and not isinstance(first, Chunk):
            raise api_error_for(first)  # nothing sent yet: a proper HTTP error
        events = ResponseEvents(base, clock=lambda: int(time.time()), on_finished=keep)
        completion = CompletionStream(
            id=response_id,
            created=base["created_at"],
            model=parsed.model,
            framing=events,
            writer=events.factory,
        )
        transport = SseTransport()
        relay = Relay(stream, completion, transport, pool.config, pool.cancel)
        response: Response[Any] = SseResponse(relay, transport, first)
    else:
        response = await _non_streaming(request, pool, stream, base, keep)
    response.headers["x-request-id"] = f"req_{uuid.uuid4().hex}"
    return response


async def _non_streaming(
    request: Request[Any, Any, Any],
    pool: Pool,
    stream: RequestStream,
    base: dict[str, Any],
    keep: Callable[[dict[str, Any]], None],
) -> Response[Any]:
    builder = CompletionBuilder()
    if not await collect(
        stream, builder, pool.config.stream_timeout, pool.cancel, disconnected(request)
    ):
        return Response(content=b"", status_code=499)  # the client is gone: never read
    choices, usage = builder.result()
    answer = choices[0]
    body = response_body(
        base,
        reasoning="".join(answer.reasoning),
        text="".join(answer.content),
        tool_calls=answer.tool_calls,
        reason=answer.finish or "cancelled",
        usage=usage,
        completed_at=int(time.time()),
    )
    keep(body)
    return Response(content=orjson.dumps(body), media_type="application/json")


def _no_query(request: Request[Any, Any, Any]) -> None:
    """Query parameters (include, stream, starting_after) are not implemented: refused."""
    for key in request.query_params:
        fail_unknown(key)


@get("/v1/responses/{response_id:str}", operation_class=GetResponseOperation)
async def get_response(
    request: Request[Any, Any, Any], state: State, response_id: FromPath[str]
) -> Response[bytes]:
    """A stored response."""
    _no_query(request)
    body = response_store(state).get(response_id).body
    return Response(content=body, media_type="application/json")


@delete("/v1/responses/{response_id:str}", status_code=200, operation_class=DeleteResponseOperation)
async def delete_response(
    request: Request[Any, Any, Any], state: State, response_id: FromPath[str]
) -> Response[bytes]:
    """Delete a stored response."""
    _no_query(request)
    response_store(state).delete(response_id)
    body = {"id": response_id, "object": "response", "deleted": True}
    return Response(content=orjson.dumps(body), media_type="application/json")


ROUTES: list[Any] = [create_response, get_response, delete_response]
"""This dialect's route handlers, registered by gateway.app."""
