"""Background responses (`background: true`): responses that run with no client attached.

The create answers at once with the response `queued` (streamed: its events from the first,
`response.created` and `response.queued`, both queued). A task then submits it to the pool
and relays its events as a socket's requests are relayed (`relay_on_socket`), into the
response's `EventLog`: every event in order, so that an event's index is its
`sequence_number`. While it runs:

- `GET /v1/responses/{id}` answers the object as it stands (queued, then in progress with
  the items done so far);
- `GET /v1/responses/{id}?stream=true&starting_after=N` sends the events after N, then the
  live ones as they come, until the last (a client that leaves stops only its own replay);
- `POST /v1/responses/{id}/cancel` stops it: its runner cancels the request, and the
  response ends `cancelled` with the items cut short `incomplete` (no event says so: the
  stream ends; OpenAI's has no cancelled event either).

When it ends, whatever the end (completed, incomplete, failed, cancelled), the final object
is stored with its events (gateway.stores.responses), so that it is retrieved, continued
(`previous_response_id`, completed or incomplete ones) and its events replayed after it
ended, within the store's bounds (count, bytes, TTL).

Bounded: at most `max_background` run at once (past it the create is a 429), and one run's
events at most `store_max_bytes` (past it the response fails: it could never be stored). A
run is also bounded by the stream timeout and its `max_output_tokens`, as any request.

The create stores the queued object at once, so that a gateway that stops (or dies) before a
run ends leaves a trace: at start, `fail_unfinished` marks every stored response still
queued or in progress failed, saying the gateway restarted; none is left in progress
forever. A stopping gateway marks its own runs so (`close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson

from gateway.http_errors import api_error_for
from gateway.pool.pool import Pool
from gateway.stores.responses import ResponseStore
from gateway.streaming.endpoint import Cancel
from gateway.streaming.request_stream import RequestStream
from gateway.streaming.socket import relay_on_socket
from gateway.streaming.sse import KEEPALIVE
from protocol.core.errors import ApiError, invalid_request, server_error
from protocol.core.stream import CompletionStream
from protocol.frames import Generate, Message
from protocol.openai.responses.events import ResponseEvents, error_object, output_messages

log = logging.getLogger("gateway.background")

UNFINISHED = ("queued", "in_progress")

RESTARTED = (
    "The gateway stopped before this background response finished; it was not resumed. "
    "Create it again."
)

CANCEL_WAIT = 10.0
"""Seconds a cancel waits for the runner to confirm before it answers the object as it
stands (the run still ends cancelled when the runner answers)."""


def too_many(limit: int) -> ApiError:
    return ApiError(
        429,
        f"Too many background responses running ({limit}, --max-background); wait for one "
        "to finish or cancel one.",
        "rate_limit_exceeded",
        "background",
        "rate_limit_exceeded",
    )


def still_running(response_id: str) -> ApiError:
    return invalid_request(
        f"Previous response with id '{response_id}' is still running in the background; "
        "wait for it to finish (or cancel it) before continuing it.",
        "previous_response_id",
        "previous_response_not_finished",
    )


def not_background(what: str, param: str) -> ApiError:
    return invalid_request(
        f"Only responses created with 'background': true can be {what}.", param, None
    )


class EventLog:
    """One background response's events as SSE frames, in order (index = sequence number),
    and who waits for more."""

    __slots__ = ("_changed", "events", "nbytes", "over")

    def __init__(self, events: Sequence[bytes] = (), *, over: bool = False) -> None:
        self.events: list[bytes] = list(events)
        self.nbytes = sum(len(event) for event in self.events)
        self.over = over
        self._changed = asyncio.Event()

    def extend(self, messages: Sequence[bytes]) -> None:
        """Messages as a `CompletionStream` renders them: each holds whole SSE frames."""
        for message in messages:
            for frame in message.split(b"\n\n")[:-1]:
                self.events.append(frame + b"\n\n")
                self.nbytes += len(frame) + 2
        self._wake()

    def close(self) -> None:
        self.over = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int, keepalive: float) -> AsyncIterator[bytes]:
        """The frames after sequence number `after`, then each new one until the last;
        a keep-alive comment after `keepalive` seconds of silence."""
        sent = max(after + 1, 0)
        while True:
            if sent < len(self.events):
                batch = b"".join(self.events[sent:])
                sent = len(self.events)
                yield batch
                continue
            if self.over:
                return
            changed = self._changed
            try:
                async with asyncio.timeout(keepalive):
                    await changed.wait()
            except TimeoutError:
                yield KEEPALIVE


class Run:
    """One background response running: its events' writer, their log, and its request."""

    __slots__ = (
        "budget",
        "cancelling",
        "completion",
        "conversation",
        "events",
        "id",
        "items",
        "log",
        "on_overflow",
        "overflow",
        "stream",
        "task",
    )

    def __init__(
        self,
        id: str,
        events: ResponseEvents,
        conversation: tuple[Message, ...],
        items: Sequence[dict[str, Any]],
        *,
        budget: int,
        on_overflow: Callable[[Run], None],
    ) -> None:
        self.id = id
        self.events = events
        self.completion = CompletionStream(events, events)
        self.conversation = conversation
        """This turn's conversation: what its answer continues."""
        self.items = items
        """Its input items (GET .../input_items)."""
        self.log = EventLog()
        self.log.extend([events.queued()])
        self.stream: RequestStream | None = None
        """Set once a runner has it: from then on a cancel goes to the runner."""
        self.task: asyncio.Task[None] | None = None
        self.cancelling = False
        self.budget = budget
        """The most its events may weigh (they are stored with it)."""
        self.on_overflow = on_overflow
        self.overflow = False
        """Its events outgrew the budget: it is stopped, and fails."""

    # `Transport` for the run's relay: everything goes to the log.
    keepalive = None

    def write(self, messages: list[bytes], last: bool) -> Awaitable[None] | None:
        self.log.extend(messages)
        if not self.overflow and self.log.nbytes > self.budget:
            self.overflow = True
            self.on_overflow(self)
        return None


class Background:
    """The gateway's background responses (see the module docstring): those running, by id;
    the finished ones are in the response store."""

    def __init__(self, pool: Pool, store: ResponseStore) -> None:
        self.pool = pool
        self.store = store
        self.config = pool.config
        self.runs: dict[str, Run] = {}

    def start(
        self,
        id: str,
        generate: Generate,
        events: ResponseEvents,
        conversation: tuple[Message, ...],
        items: Sequence[dict[str, Any]],
    ) -> Run:
        """Queue a response to run in the background (a 429 past `max_background`)."""
        limit = self.config.max_background
        if len(self.runs) >= limit:
            raise too_many(limit)
        run = Run(
            id,
            events,
            conversation,
            items,
            budget=self.config.store_max_bytes,
            on_overflow=self._stop,
        )
        self.store.keep(events.snapshot(), (), items)  # a trace, should the gateway stop
        self.runs[id] = run
        run.task = asyncio.create_task(self._run(run, generate), name=f"background {id}")
        return run

    def check_continuable(self, previous_response_id: str | None) -> None:
        """A 400 when the response a create continues is still running."""
        if previous_response_id is not None and previous_response_id in self.runs:
            raise still_running(previous_response_id)

    def snapshot(self, response_id: str) -> bytes | None:
        """A running response's object as it stands; None: it is not running."""
        run = self.runs.get(response_id)
        return None if run is None else orjson.dumps(run.events.snapshot())

    def replay(self, response_id: str, after: int) -> AsyncIterator[bytes]:
        """A background response's events after sequence number `after`, live ones
        included while it runs; the 404 for an unknown response, a 400 for one that did not
        run in the background."""
        run = self.runs.get(response_id)
        if run is not None:
            return run.log.follow(after, self.config.keepalive_interval)
        entry = self.store.get(response_id)
        if not orjson.loads(entry.body).get("background"):
            raise not_background("streamed again", "stream")
        return EventLog(entry.events, over=True).follow(after, self.config.keepalive_interval)

    async def cancel(self, response_id: str) -> bytes:
        """Cancel a running background response; the object once it ended (or, if its
        runner has not confirmed within CANCEL_WAIT, as it stands). A finished one is
        answered as it ended; the 404 for an unknown one, a 400 for one not in the
        background."""
        run = self.runs.get(response_id)
        if run is None:
            body = self.store.get(response_id).body
            if not orjson.loads(body).get("background"):
                raise not_background("cancelled", "response_id")
            return body
        run.cancelling = True
        task = run.task
        assert task is not None, "a run has its task"
        if run.stream is not None:
            self.pool.cancel(run.stream)  # the runner ends it: its final chunk follows
        else:
            task.cancel()  # still waiting for a runner
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT):
                await asyncio.shield(task)
        return orjson.dumps(run.events.snapshot())

    async def close(self) -> None:
        """The gateway stops: its runs end failed (stored so), as a restart would mark them."""
        runs = list(self.runs.values())
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in runs if r.task is not None), return_exceptions=True)

    # --- one run --------------------------------------------------------------------------

    async def _run(self, run: Run, generate: Generate) -> None:
        def placed(stream: RequestStream, cancel: Cancel) -> None:
            run.stream = stream
            started: list[bytes] = []
            run.completion.start(started)  # a runner has it: in progress from now
            run.log.extend(started)

        try:
            await relay_on_socket(
                self.pool,
                run.id,
                (generate,),
                run.completion,
                run,
                label="responses",
                placed=placed,
            )
        except asyncio.CancelledError:
            if run.cancelling and run.events.ended is None:
                run.events.cancelled()  # before a runner had it
            elif run.events.ended is None:
                self._fail(run, server_error(RESTARTED))
        except Exception as exc:  # a bug here must end this response, not go unseen
            log.exception("background response %s failed", run.id)
            self._fail(run, api_error_for(exc))
        finally:
            self._end(run)

    def _fail(self, run: Run, err: ApiError) -> None:
        if run.events.ended is None or run.events.ended["status"] != "failed":
            run.log.extend([run.events.error(err)])

    def _stop(self, run: Run) -> None:
        """A run whose events outgrew its budget: its runner stops it."""
        if run.stream is not None:
            self.pool.cancel(run.stream)

    def _end(self, run: Run) -> None:
        """Store the run's final object with its events, and forget it."""
        if run.overflow:
            self._fail(
                run,
                server_error(
                    "The background response's events outgrew the gateway's store "
                    f"(--store-max-bytes {self.config.store_max_bytes}); it was stopped."
                ),
            )
        ended = run.events.ended
        if ended is not None and ended["status"] == "cancelled" and not run.cancelling:
            self._fail(run, server_error(RESTARTED))  # cancelled by the gateway's drain
        final = run.events.ended
        if final is None:  # no end reached the writer (a bug): say so rather than hang
            self._fail(run, server_error("The background response ended without an answer."))
            final = run.events.ended
        assert final is not None
        answered = run.conversation
        if final["status"] in ("completed", "incomplete"):
            answered = (*answered, *output_messages(final["output"]))
        self.store.keep(final, answered, run.items, events=tuple(run.log.events))
        run.log.close()
        self.runs.pop(run.id, None)


def fail_unfinished(store: ResponseStore, message: str = RESTARTED) -> int:
    """Mark every stored response still queued or in progress failed (a previous gateway
    process's runs: see the module docstring); how many there were."""
    marked = 0
    for entry in store.entries():
        body = orjson.loads(entry.body)
        if body.get("status") not in UNFINISHED:
            continue
        failed = {**body, "status": "failed", "error": error_object(server_error(message))}
        store.replace(entry.id, failed)
        marked += 1
    if marked:
        log.warning("%d background response(s) marked failed: the gateway restarted", marked)
    return marked
