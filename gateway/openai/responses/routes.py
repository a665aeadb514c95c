"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

The Responses dialect on the shared endpoint (gateway.streaming.endpoint): the body is
validated (protocol.openai.responses, the model first), the request goes to the pool, a
streamed answer is `ResponseEvents` over SSE (protocol.openai.responses.events: the writer and
its own framing), a plain one the response object of the collected chunks. So failover before
the first token, the queue's 429/503, the stream timeout and cancelling on disconnect are the
chat's. Errors before the first byte are HTTP errors in OpenAI's shape; after it,
`response.failed`.

Stored responses (gateway.stores.responses) live in the app's state, made with the app (with
the stored completions' limits; a response is kept as every answer is (gateway.streaming.
keeper): streamed, the object its last event carried. Background responses (`background:
true`) run without their client (gateway.openai.responses.background): the create answers
queued, `GET ?stream=true&starting_after=N` replays their events, `POST .../cancel` stops
them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any
from urllib.parse import parse_qsl

import attrs
import orjson
from litestar import Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.params import FromPath
from litestar.response import Stream

from gateway.openai.responses.background import Background
from gateway.openai.responses.openapi import (
    CreateResponseOperation,
    DeleteResponseOperation,
)
from gateway.openai.responses.openapi_resources import (
    CancelOperation,
    CompactOperation,
    GetResponseOperation,
    InputItemsOperation,
    InputTokensOperation,
)
from gateway.openai.responses.socket import responses_socket
from gateway.stores.responses import ResponseStore
from gateway.streaming.endpoint import Context, Dialect, Plan, serve
from gateway.streaming.sse import SSE_HEADERS
from protocol.core.fields import fail_unknown
from protocol.core.stream import CompletionBuilder
from protocol.frames import Message
from protocol.openai.responses.compaction import MAX_SUMMARY_TOKENS, compacted_output
from protocol.openai.responses.events import (
    ResponseEvents,
    new_id,
    output_messages,
    response_base,
    response_body,
    usage_object,
)
from protocol.openai.responses.items import (
    input_items,
    parse_input_items_query,
    parse_retrieve_query,
)
from protocol.openai.responses.request import (
    parse_compact_request,
    parse_input_tokens_request,
    parse_responses_request,
)


def response_store(state: State) -> ResponseStore:
    """The app's stored responses (gateway.app makes them, and fails what an earlier
    gateway left running)."""
    store: ResponseStore = state.responses
    return store


def background_of(state: State) -> Background:
    """The app's background responses (made on first use)."""
    background: Background | None = getattr(state, "background", None)
    if background is None:
        background = Background(state.pool, response_store(state))
        state.background = background
    return background


def _answered(builder: CompletionBuilder) -> dict[str, Any]:
    raise AssertionError("a background response is answered before it runs")


def plan(body: bytes, context: Context) -> Plan:
    store = response_store(context.state)
    parsed = parse_responses_request(body, context.check_model, store=store.enabled)
    parsed.check_ceilings(context.config.max_tokens_limit, context.config.max_choices)
    background = background_of(context.state)
    background.check_continuable(parsed.previous_response_id)
    history: tuple[Message, ...] = ()
    if parsed.previous_response_id is not None:
        history = store.conversation(parsed.previous_response_id)
    response_id = f"resp_{uuid.uuid4().hex}"
    base = response_base(parsed, id=response_id, created_at=int(time.time()), store=parsed.store)
    conversation = (*history, *parsed.input)
    events = ResponseEvents(base, clock=lambda: int(time.time()))
    headers = {"x-request-id": f"req_{uuid.uuid4().hex}"}
    if parsed.background:
        generate = parsed.to_generate(response_id, history)
        items = input_items(conversation, new_id)
        run = background.start(response_id, generate, events, conversation, items)
        early: Response[Any]
        if parsed.stream:  # its events from the first; the client may leave, it runs on
            replay = run.log.follow(-1, context.config.keepalive_interval)
            early = Stream(replay, media_type="text/event-stream", headers=SSE_HEADERS)
        else:
            early = Response(orjson.dumps(events.snapshot()), media_type="application/json")
        early.headers.update(headers)
        return Plan(response_id, parsed.model, (), parsed.stream, body=_answered, early=early)

    def answer(builder: CompletionBuilder) -> dict[str, Any]:
        choices, usage = builder.result()
        choice = choices[0]
        return response_body(
            base,
            reasoning="".join(choice.reasoning),
            text="".join(choice.content),
            tool_calls=choice.tool_calls,
            reason=choice.finish or "cancelled",
            usage=usage,
            completed_at=int(time.time()),
        )

    def streamed(builder: CompletionBuilder) -> dict[str, Any]:
        assert events.response is not None, "a finished stream has its response"
        return events.response

    def keep(response: dict[str, Any]) -> None:
        answered = (*conversation, *output_messages(response["output"]))
        store.keep(response, answered, input_items(conversation, new_id))

    return Plan(
        id=response_id,
        model=parsed.model,
        generates=(parsed.to_generate(response_id, history),),
        stream=parsed.stream,
        body=answer,
        writer=lambda: events,
        framing=events,
        keep=keep if parsed.store else None,
        kept=streamed,
        headers=headers,
    )


def plan_count(body: bytes, context: Context) -> Plan:
    """input_tokens: the request with `max_output_tokens` 0, answered with its prompt's
    tokens."""
    store = response_store(context.state)
    parsed = parse_input_tokens_request(body, context.check_model, store=store.enabled)
    history: tuple[Message, ...] = ()
    if parsed.previous_response_id is not None:
        history = store.conversation(parsed.previous_response_id)
    count_id = f"count_{uuid.uuid4().hex}"

    def answer(builder: CompletionBuilder) -> dict[str, Any]:
        _, usage = builder.result()
        return {"object": "response.input_tokens", "input_tokens": usage.prompt_tokens}

    return Plan(
        id=count_id,
        model=parsed.model,
        generates=(parsed.to_generate(count_id, history),),
        stream=False,
        body=answer,
        headers={"x-request-id": f"req_{uuid.uuid4().hex}"},
    )


def plan_compact(body: bytes, context: Context) -> Plan:
    """compact: the model's summary of the conversation, as a compaction item after the
    conversation's user messages (protocol.openai.responses.compaction)."""
    store = response_store(context.state)
    parsed = parse_compact_request(body, context.check_model, store=store.enabled)
    limit = min(parsed.max_output_tokens or MAX_SUMMARY_TOKENS, context.config.max_tokens_limit)
    parsed = attrs.evolve(parsed, max_output_tokens=limit)
    history: tuple[Message, ...] = ()
    if parsed.previous_response_id is not None:
        history = store.conversation(parsed.previous_response_id)
    conversation = (*history, *parsed.input[:-1])  # without the request for the summary
    compact_id = f"resp_{uuid.uuid4().hex}"
    created = int(time.time())

    def answer(builder: CompletionBuilder) -> dict[str, Any]:
        choices, usage = builder.result()
        summary = "".join(choices[0].content)
        return {
            "id": compact_id,
            "object": "response.compaction",
            "output": compacted_output(conversation, summary, new_id),
            "created_at": created,
            "usage": usage_object(usage),
        }

    return Plan(
        id=compact_id,
        model=parsed.model,
        generates=(parsed.to_generate(compact_id, history),),
        stream=False,
        body=answer,
        headers={"x-request-id": f"req_{uuid.uuid4().hex}"},
    )


RESPONSES = Dialect("responses", plan)
COMPACT = Dialect("responses", plan_compact)
INPUT_TOKENS = Dialect("responses", plan_count)


@post("/v1/responses", status_code=200, operation_class=CreateResponseOperation)
async def create_response(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a model response (OpenAI's Responses API; `stream: true` for SSE)."""
    return await serve(request, state, RESPONSES)


@post("/v1/responses/input_tokens", status_code=200, operation_class=InputTokensOperation)
async def count_input_tokens(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Count a request's input tokens (its prompt through the model's chat template)."""
    return await serve(request, state, INPUT_TOKENS)


@post("/v1/responses/compact", status_code=200, operation_class=CompactOperation)
async def compact(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Compact a conversation: its user messages and the model's summary of the rest."""
    return await serve(request, state, COMPACT)


def _no_query(request: Request[Any, Any, Any]) -> None:
    """A route that takes no query parameters refuses them."""
    for key in request.query_params:
        fail_unknown(key)


def _query(request: Request[Any, Any, Any]) -> list[tuple[str, str]]:
    return parse_qsl(
        request.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
    )


@get("/v1/responses/{response_id:str}", operation_class=GetResponseOperation)
async def get_response(
    request: Request[Any, Any, Any], state: State, response_id: FromPath[str]
) -> Response[Any]:
    """A stored response, or a background one as it stands; `stream=true`: a background
    response's events after `starting_after`, live ones included while it runs."""
    query = parse_retrieve_query(_query(request))
    background = background_of(state)
    if query.stream:
        replay = background.replay(response_id, query.starting_after)
        return Stream(replay, media_type="text/event-stream", headers=SSE_HEADERS)
    body = background.snapshot(response_id) or response_store(state).get(response_id).body
    return Response(content=body, media_type="application/json")


@post("/v1/responses/{response_id:str}/cancel", status_code=200, operation_class=CancelOperation)
async def cancel_response(
    request: Request[Any, Any, Any], state: State, response_id: FromPath[str]
) -> Response[bytes]:
    """Cancel a background response (the object once it ended)."""
    _no_query(request)
    body = await background_of(state).cancel(response_id)
    return Response(content=body, media_type="application/json")


@get("/v1/responses/{response_id:str}/input_items", operation_class=InputItemsOperation)
async def list_input_items(
    request: Request[Any, Any, Any], state: State, response_id: FromPath[str]
) -> Response[bytes]:
    """A stored response's input items, paged (newest first unless `order=asc`)."""
    query = parse_input_items_query(_query(request))
    body = response_store(state).input_items(response_id, query)
    return Response(content=body, media_type="application/json")


@delete("/v1/responses/{response_id:str}", status_code=200, operation_class=DeleteResponseOperation)
async def delete_response(
    request: Request[Any, Any, Any], state: State, response_id: FromPath[str]
) -> Response[bytes]:
    """Delete a stored response (a background one still running is cancelled first)."""
    _no_query(request)
    background = background_of(state)
    if response_id in background.runs:
        await background.cancel(response_id)
    response_store(state).delete(response_id)
    body = {"id": response_id, "object": "response", "deleted": True}
    return Response(content=orjson.dumps(body), media_type="application/json")


ROUTES: list[Any] = [
    create_response,
    count_input_tokens,
    compact,
    get_response,
    cancel_response,
    list_input_items,
    delete_response,
    responses_socket(RESPONSES),  # the WebSocket mode, on /v1/responses too
]
"""This dialect's route handlers, registered by gateway.app."""
