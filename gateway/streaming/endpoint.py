"""One endpoint for every dialect: parse, submit, then relay or collect.

A dialect (chat, legacy completions, Responses, Anthropic's Messages, Ollama's chat and
generate) is a `Dialect`: its name (the pool's and the metrics' label), its keep-alive and
media type, how its errors read in its own terms, and `plan`, which parses a request body into
a `Plan`. The plan is everything the endpoint needs to answer that request:

- the runner requests (`generates`: one, or one per prompt of a legacy completion, whose
  streams are merged by `FanIn`), and whether the answer is streamed;
- streamed: the dialect's writer (made when the request is placed, as the dialect builds it)
  and the transport's framing, handed to a `CompletionStream` that a `Relay` writes;
- not streamed: the builder that collects the answer and the body it becomes;
- `keep`: where a finished answer goes (gateway.streaming.keeper), streamed or not;
- the response headers (the request id), or an `early` answer that needs no runner.

`serve` runs it: submit → first item (an error before it is a proper HTTP error, in the
dialect's terms) → a relay over SSE, or collect (a client that left gets a 499 nobody reads).
`relay_from_first` is the one place that takes a stream's first item and makes its relay; the
browser socket (gateway.browser.routes) starts its requests through it too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import orjson
from litestar import Request, Response
from litestar.datastructures import State

from gateway.config import GatewayConfig
from gateway.http_errors import api_error_for
from gateway.pool.pool import Pool
from gateway.streaming.fanin import FanIn
from gateway.streaming.keeper import Body, Keep, Keeper, keepable
from gateway.streaming.relay import Relay, Transport, collect, first_item
from gateway.streaming.request_stream import RequestStream, StreamItem
from gateway.streaming.sse import KEEPALIVE, SseResponse, SseTransport, disconnected
from protocol.core.errors import ApiError
from protocol.core.limits import CheckModel
from protocol.core.stream import ChoiceWriter, CompletionBuilder, CompletionStream, Framing
from protocol.frames import Chunk, Generate

Cancel = Callable[[RequestStream], None]
Terms = Callable[[ApiError, str], ApiError]
"""An error as the dialect says it, for a request to `model`."""


def as_is(err: ApiError, model: str) -> ApiError:
    return err


@attrs.frozen
class Context:
    """What a dialect's `plan` may use: the pool, the app's state (its stores), and the model
    check its parser runs first (an unknown model's 404 before anything else)."""

    pool: Pool
    state: State
    check_model: CheckModel
    arrived: int
    """When the request came in (`time.perf_counter_ns`)."""

    @property
    def config(self) -> GatewayConfig:
        return self.pool.config


@attrs.define
class Plan:
    """How to answer one parsed request (see the module docstring)."""

    id: str
    """The answer's id (a legacy completion's several prompts are merged under it)."""
    model: str
    generates: Sequence[Generate]
    stream: bool
    body: Body
    """The non-streamed answer's body, from the collected chunks (raises the request's
    `ApiError` if it failed)."""
    writer: Callable[[], ChoiceWriter] | None = None
    """The streamed answer's writer, made once the request is placed; None: never streamed."""
    framing: Framing | None = None
    n: int = 1
    builder: Callable[[], CompletionBuilder] = CompletionBuilder
    keep: Keep | None = None
    """Stores the finished answer's body (`store: true`); None: nothing is kept."""
    kept: Body | None = None
    """A streamed answer's body to keep, when it is not `body` of its chunks (the Responses
    events' own final object, with the ids they streamed)."""
    headers: Mapping[str, str] = attrs.Factory(dict)
    early: Response[Any] | None = None
    """An answer that needs no runner (Ollama's load-a-model request)."""


@attrs.frozen
class Dialect:
    """One API's request and answer on the shared endpoint."""

    name: str
    """The pool's label for it (model checks, metrics)."""
    plan: Callable[[bytes, Context], Plan]
    keepalive: bytes | None = KEEPALIVE
    """Sent on a streamed answer's silences; None: none (an NDJSON line must be an object)."""
    media_type: str = "text/event-stream"
    terms: Terms = as_is


def model_check(pool: Pool, dialect: Dialect) -> CheckModel:
    """The parser's model check: an unknown model's 404 (or 503), in the dialect's terms."""

    def check_model(model: str) -> None:
        try:
            pool.check_model(model, dialect.name)
        except Exception as exc:
            raise dialect.terms(api_error_for(exc), model) from exc

    return check_model


async def serve(request: Request[Any, Any, Any], state: State, dialect: Dialect) -> Response[Any]:
    """Answer one request of `dialect`."""
    arrived = time.perf_counter_ns()
    pool: Pool = state.pool
    context = Context(pool, state, model_check(pool, dialect), arrived)
    plan = dialect.plan(await request.body(), context)
    if plan.early is not None:
        return plan.early
    try:
        stream, cancel = await submit(pool, plan.id, plan.generates, dialect.name)
    except Exception as exc:
        raise dialect.terms(api_error_for(exc), plan.model) from exc
    if plan.stream:
        response = await _streamed(pool, stream, cancel, plan, dialect)
    else:
        response = await _collected(request, pool, stream, cancel, plan=plan, dialect=dialect)
    response.headers.update(plan.headers)
    return response


async def submit(
    pool: Pool, id: str, generates: Sequence[Generate], label: str
) -> tuple[RequestStream, Cancel]:
    """Give every runner request to the pool; one stream to read and how to cancel it. If one
    cannot be placed (queue full, no runner), those placed already are cancelled."""
    if len(generates) == 1:
        return await pool.submit(generates[0], label), pool.cancel
    tasks = [asyncio.ensure_future(pool.submit(generate, label)) for generate in generates]
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
    fan_in = FanIn(id, [task.result() for task in tasks], generates[0].n, pool.cancel)
    return fan_in.stream, fan_in.cancel


async def relay_from_first(
    stream: RequestStream,
    completion: CompletionStream,
    transport: Transport,
    config: GatewayConfig,
    cancel: Cancel,
    *,
    keeper: Keeper | None = None,
    refuse: Callable[[ApiError], ApiError] | None = None,
) -> tuple[Relay, StreamItem | None]:
    """Wait for the stream's first item (gateway.streaming.relay.first_item), then make the
    relay that writes it and the rest. With `refuse`, a first item that is an error is raised
    as `refuse` makes it (nothing was sent yet: an HTTP error) instead of being relayed."""
    first = await first_item(stream, config, cancel)
    if refuse is not None and first is not None and not isinstance(first, Chunk):
        raise refuse(api_error_for(first))
    return Relay(stream, completion, transport, config, cancel, keeper=keeper), first


async def _streamed(
    pool: Pool, stream: RequestStream, cancel: Cancel, plan: Plan, dialect: Dialect
) -> Response[Any]:
    assert plan.writer is not None, "a streamed plan has a writer"
    assert plan.framing is not None, "and a framing"
    completion = CompletionStream(plan.writer(), plan.framing, n=plan.n)
    keeper = None
    if plan.keep is not None:
        keeper = Keeper(plan.builder(), plan.kept or plan.body, plan.keep)
    transport = SseTransport(dialect.keepalive)
    relay, first = await relay_from_first(
        stream,
        completion,
        transport,
        pool.config,
        cancel,
        keeper=keeper,
        refuse=lambda err: dialect.terms(err, plan.model),
    )
    return SseResponse(relay, transport, first, media_type=dialect.media_type)


async def _collected(
    request: Request[Any, Any, Any],
    pool: Pool,
    stream: RequestStream,
    cancel: Cancel,
    *,
    plan: Plan,
    dialect: Dialect,
) -> Response[Any]:
    builder = plan.builder()
    timeout = pool.config.stream_timeout
    if not await collect(stream, builder, timeout, cancel, disconnected(request)):
        return Response(content=b"", status_code=499)  # the client is gone: never read
    try:
        body = plan.body(builder)
    except ApiError as err:
        raise dialect.terms(err, plan.model) from None
    if plan.keep is not None and keepable(builder):
        plan.keep(body)
    return Response(content=orjson.dumps(body), media_type="application/json")
