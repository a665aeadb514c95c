"""`POST /v1/chat/completions`: OpenAI Chat Completions over SSE and plain JSON.

The chat dialect on the shared endpoint (gateway.streaming.endpoint): the body is validated
(protocol.openai.chat.request, the model first) and checked against the gateway's ceilings; a
streamed answer is `ChunkWriter`'s chunks over SSE, a plain one the `chat.completion` body of
the collected chunks. Errors before the first byte (bad input, unknown model, queue full, a
runner refusing the request) are HTTP errors in OpenAI's shape; after it an SSE error event
and `[DONE]`.

Every response has an `x-request-id` header, as OpenAI's; a `store: true` request's stored
completion (gateway.stores.chat) names it as its `request_id`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.openai.chat.openapi import ChatCompletionsOperation
from gateway.stores.chat import CompletionStore
from gateway.streaming.endpoint import Context, Dialect, Plan, serve
from gateway.streaming.keeper import Keeper
from protocol.core.stream import CompletionBuilder
from protocol.openai.chat.request import ChatRequest, parse_chat_request
from protocol.openai.chat.response import chat_completion_body, chat_writer
from protocol.openai.sse import SSE


def answer_of(
    chat: ChatRequest, *, id: str, created: int, fingerprint: str | None
) -> Callable[[CompletionBuilder], dict[str, Any]]:
    """The `chat.completion` body of a request's collected chunks."""

    def answer(builder: CompletionBuilder) -> dict[str, Any]:
        return chat_completion_body(
            builder, id=id, created=created, model=chat.model, fingerprint=fingerprint
        )

    return answer


def keep_of(
    store: CompletionStore, chat: ChatRequest, request_id: str
) -> Callable[[dict[str, Any]], object] | None:
    """Where a `store: true` request's finished completion goes; None for the others."""
    if chat.store is None:
        return None
    return partial(store.keep, request=chat.store, request_id=request_id)


def keeper_of(
    store: CompletionStore,
    chat: ChatRequest,
    *,
    id: str,
    created: int,
    fingerprint: str | None,
    request_id: str,
) -> Keeper | None:
    """The keeper of a streamed request (the browser socket's); None unless it asked for
    `store: true`."""
    keep = keep_of(store, chat, request_id)
    if keep is None:
        return None
    answer = answer_of(chat, id=id, created=created, fingerprint=fingerprint)
    return Keeper(CompletionBuilder(logprobs=chat.logprobs, n=chat.n), answer, keep)


def plan(body: bytes, context: Context) -> Plan:
    store: CompletionStore = context.state.store
    chat = parse_chat_request(body, context.check_model, store=store.enabled)
    chat.check_ceilings(context.config.max_tokens_limit, context.config.max_choices)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    request_id = f"req_{uuid.uuid4().hex}"
    created = int(time.time())
    fingerprint = context.pool.fingerprint(chat.model)
    return Plan(
        id=completion_id,
        model=chat.model,
        generates=(chat.to_generate(completion_id),),
        stream=chat.stream,
        body=answer_of(chat, id=completion_id, created=created, fingerprint=fingerprint),
        writer=lambda: chat_writer(
            chat, id=completion_id, created=created, fingerprint=fingerprint, framing=SSE
        ),
        framing=SSE,
        n=chat.n,
        builder=lambda: CompletionBuilder(logprobs=chat.logprobs, n=chat.n),
        keep=keep_of(store, chat, request_id),
        headers={"x-request-id": request_id},
    )


CHAT = Dialect("chat", plan)


@post("/v1/chat/completions", status_code=200, operation_class=ChatCompletionsOperation)
async def chat_completions(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a chat completion (OpenAI wire format; `stream: true` for SSE)."""
    return await serve(request, state, CHAT)
