"""The Responses API's WebSocket mode: `/v1/responses` upgraded to a WebSocket (OpenAI's SDK:
`client.responses.connect()`). One socket carries many responses, each `response.create`
on its `stream_id` lane: a lane's creates run one after another, lanes at once.

This module only acts on the session's events. What each message means, every refusal and
the steer rules are `protocol.openai.responses.socket.ResponsesSocket`'s; the pump (reader,
single writer, outbox bound, auth deadline, origin and socket limits) is every client
socket's (gateway.streaming.socket). A create is planned by the dialect's own `plan`
(gateway.openai.responses.routes: the same validation, `previous_response_id` chains and
stored responses as `POST /v1/responses`), its events are `ResponseEvents` in the socket's
framing (protocol.openai.responses.framing: one message per event, with its `stream_id`), and
it runs through `relay_on_socket` (submit, then relay). See docs/responses-websocket.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import orjson
from litestar import WebSocket, websocket
from litestar.datastructures import State
from litestar.handlers import WebsocketRouteHandler

from gateway.pool.pool import Pool
from gateway.streaming.endpoint import Cancel, Context, Dialect, Plan, model_check
from gateway.streaming.keeper import Keeper
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.socket import ClientSocket, relay_on_socket, serve_socket
from protocol.client_socket import CloseSocket, Reply
from protocol.core.errors import ApiError, server_error
from protocol.core.stream import CompletionStream
from protocol.openai.responses.events import ResponseEvents
from protocol.openai.responses.framing import SocketEvents, split_events
from protocol.openai.responses.socket import Event, Interrupt, ResponsesSocket, Run, Ticket

log = logging.getLogger("gateway.responses_ws")

RESPONSES_WS_PATH = "/v1/responses"
"""The same path as `POST /v1/responses`: the SDK upgrades `{base_url}/responses`."""


class _Response:
    """One create running on the socket (the session's handle)."""

    __slots__ = ("cancel", "completion", "events", "plan", "stream", "task", "ticket")

    def __init__(self, ticket: Ticket, plan: Plan, events: ResponseEvents) -> None:
        self.ticket = ticket
        self.plan = plan
        self.events = events
        self.completion = CompletionStream(events, events, n=plan.n)
        self.task: asyncio.Task[None] | None = None
        self.stream: RequestStream | None = None
        """Set once a runner has it: a steer or the socket's close cancels it there."""
        self.cancel: Cancel | None = None

    def placed(self, stream: RequestStream, cancel: Cancel) -> None:
        self.stream, self.cancel = stream, cancel
        if self.events.steered:
            cancel(stream)  # steered while it waited for a runner

    def interrupt(self) -> None:
        """A steer waits for it: stop it at its runner, now or as soon as it has one. Its
        runner's last chunk then ends it `response.incomplete`, reason `steered`."""
        self.events.steered = True
        if self.stream is not None and self.cancel is not None:
            self.cancel(self.stream)

    def stop(self) -> None:
        """The socket closes: stop it at its runner, or while it waits for one."""
        if self.stream is not None and self.cancel is not None:
            self.cancel(self.stream)
        if self.task is not None:
            self.task.cancel()


class ResponsesApi:
    """The WebSocket mode on one client socket (gateway.streaming.socket's `SocketApi`), and
    the `Transport` of its responses' relays: each event rendered is one message."""

    def __init__(self, socket: ClientSocket, state: State, dialect: Dialect) -> None:
        self.socket = socket
        self.state = state
        self.dialect = dialect
        self.pool: Pool = state.pool
        config = self.pool.config
        self.session: ResponsesSocket[_Response] = ResponsesSocket(
            verify_key=None if socket.authenticated() else socket.key_ok,
            max_requests=config.max_client_requests,
            max_message_bytes=config.max_client_message_bytes,
        )
        self._check_model = model_check(self.pool, dialect)
        self._running: set[_Response] = set()

    # --- SocketApi ------------------------------------------------------------------------

    def receive(self, data: bytes | str) -> None:
        self._act(self.session.receive(data))

    def auth_timed_out(self) -> tuple[int, str] | None:
        refusal = self.session.auth_timed_out()
        return None if refusal is None else (refusal.code, refusal.reason)

    def stop(self) -> list[asyncio.Task[None]]:
        self.session.close()
        ending = []
        for response in self._running:
            response.stop()
            if response.task is not None:
                ending.append(response.task)
        self._running.clear()
        return ending

    # --- Transport --------------------------------------------------------------------------

    keepalive = None

    def write(self, messages: list[bytes], last: bool) -> Awaitable[None] | None:
        send = self.socket.send
        for message in messages:
            for event in split_events(message):
                send(event)
        return None

    # --- the session's events ---------------------------------------------------------------

    def _act(self, events: list[Event[_Response]]) -> None:
        for event in events:
            match event:
                case Reply(data=data):
                    self.socket.send(data)
                case Run(ticket=ticket):
                    self._run(ticket)
                case Interrupt(handle=response):
                    response.interrupt()
                case CloseSocket(code=code, reason=reason):
                    self.socket.close_with(code, reason)

    def _run(self, ticket: Ticket) -> None:
        context = Context(self.pool, self.state, self._check_model, time.perf_counter_ns())
        try:
            plan = self.dialect.plan(orjson.dumps(ticket.body), context)
            events = plan.framing
            if plan.early is not None or not isinstance(events, ResponseEvents):
                raise AssertionError("a streamed, non-background plan has its events")
        except ApiError as err:
            self._act(self.session.refused(ticket, err))
            return
        except Exception:
            log.exception("planning a WebSocket response failed")
            self._act(self.session.refused(ticket, server_error()))
            return
        events.framing = SocketEvents(ticket.stream_id)
        response = _Response(ticket, plan, events)
        keeper = None
        if plan.keep is not None:
            keeper = Keeper(plan.builder(), plan.kept or plan.body, plan.keep)
        self.session.bound(ticket, plan.id, response, stored=plan.keep is not None)
        run = relay_on_socket(
            self.pool,
            plan.id,
            plan.generates,
            response.completion,
            self,
            label=self.dialect.name,
            keeper=keeper,
            placed=response.placed,
        )
        response.task = asyncio.create_task(run)
        self._running.add(response)
        response.task.add_done_callback(lambda _: self._ended(response))

    def _ended(self, response: _Response) -> None:
        """The response's task ended: its last event is sent (a task cancelled before a
        runner had it ends it here); a steered one is kept here (its cancel is not kept by
        the relay's keeper); then the session says what runs next."""
        self._running.discard(response)
        if self.socket.closed:
            return
        if not response.completion.over:
            out: list[bytes] = []
            response.completion.cancel(out)
            self.write(out, True)
        final, keep = response.events.response, response.plan.keep
        kept = final is not None and keep is not None
        steered = final is not None and final["incomplete_details"] == {"reason": "steered"}
        if steered and final is not None and keep is not None:
            try:
                keep(final)
            except Exception:
                log.exception("keeping steered response %s failed", response.plan.id)
                kept = False
        self._act(self.session.ended(response.ticket, kept=kept))


def responses_socket(dialect: Dialect) -> WebsocketRouteHandler:
    """The route handler of the WebSocket mode, planning its creates with `dialect`'s
    `plan` (the Responses dialect's: passed in, so that its routes can list this handler)."""

    async def responses_websocket(socket: WebSocket[Any, Any, Any], state: State) -> None:
        """OpenAI's WebSocket mode for the Responses API (`client.responses.connect()`)."""
        await serve_socket(socket, state, lambda client: ResponsesApi(client, state, dialect))

    return websocket(RESPONSES_WS_PATH)(responses_websocket)
