"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The Messages dialect on the shared endpoint (gateway.streaming.endpoint), in Anthropic's
shapes: the body is validated (protocol.anthropic.request, the model first), the request goes
to the pool, and the answer is `MessageWriter`'s events over SSE (protocol.anthropic.stream),
or the `message` of the collected chunks. Errors before the first byte are HTTP errors in
Anthropic's shape (this API's router: gateway.anthropic), after it an `error` event. Disconnects
cancel the request, the queue's 429/503 and API keys (`x-api-key` too) are the pool's and auth's, as
for the chat. The keep-alive is Anthropic's `ping` event.

count_tokens runs the request with `max_tokens` 0: a runner templates and tokenizes the
prompt, generates nothing, and answers with its usage, whose prompt_tokens is the count.
"""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.anthropic.openapi import CountTokensOperation, MessagesOperation
from gateway.streaming.endpoint import Context, Dialect, Plan, serve
from protocol.anthropic.request import parse_count_request, parse_messages_request
from protocol.anthropic.stream import ANTHROPIC_SSE, PING, MessageWriter, message_body
from protocol.core.errors import ApiError, invalid_request
from protocol.core.stream import CompletionBuilder


def thinking_terms(err: ApiError, model: str) -> ApiError:
    """A runner's refusal of reasoning_effort is, in this dialect, a refusal of `thinking`."""
    if err.param == "reasoning_effort":
        return invalid_request(
            "thinking: this model has no think markers, so thinking cannot be turned on or off.",
            "thinking",
        )
    return err


def plan_message(body: bytes, context: Context) -> Plan:
    parsed = parse_messages_request(body, context.check_model)
    parsed.check_ceilings(context.config.max_tokens_limit, context.config.max_choices)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"

    def answer(builder: CompletionBuilder) -> dict[str, Any]:
        choices, usage = builder.result()
        return message_body(choices[0], usage, id=message_id, model=parsed.model)

    return Plan(
        id=message_id,
        model=parsed.model,
        generates=(parsed.to_generate(message_id),),
        stream=parsed.stream,
        body=answer,
        writer=lambda: MessageWriter(message_id, parsed.model),
        framing=ANTHROPIC_SSE,
        headers={"request-id": f"req_{uuid.uuid4().hex}"},
    )


def plan_count(body: bytes, context: Context) -> Plan:
    """count_tokens: the request with `max_tokens` 0, answered with its prompt's tokens."""
    parsed = parse_count_request(body, context.check_model)
    count_id = f"count_{uuid.uuid4().hex[:24]}"

    def answer(builder: CompletionBuilder) -> dict[str, Any]:
        _, usage = builder.result()
        return {"input_tokens": usage.prompt_tokens}

    return Plan(
        id=count_id,
        model=parsed.model,
        generates=(parsed.to_generate(count_id),),
        stream=False,
        body=answer,
        headers={"request-id": f"req_{uuid.uuid4().hex}"},
    )


MESSAGES = Dialect("anthropic", plan_message, keepalive=PING, terms=thinking_terms)
COUNT_TOKENS = Dialect("anthropic", plan_count, terms=thinking_terms)


@post("/v1/messages", status_code=200, operation_class=MessagesOperation)
async def create_message(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a message (Anthropic's Messages API; `stream: true` for SSE)."""
    return await serve(request, state, MESSAGES)


@post("/v1/messages/count_tokens", status_code=200, operation_class=CountTokensOperation)
async def count_tokens(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Count a request's input tokens (its prompt through the model's chat template)."""
    return await serve(request, state, COUNT_TOKENS)


ROUTES: list[Any] = [create_message, count_tokens]
"""This dialect's route handlers, mounted by gateway.anthropic."""
