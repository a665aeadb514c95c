"""One request's output on its way to its client, the same for every transport.

A `Relay` reads one `RequestStream` and writes what the request's `CompletionStream`
(protocol.core.stream) renders to a `Transport`, which only knows how to write: an SSE
response body (gateway.streaming.sse) or the browser socket's outbox (gateway.browser.routes).

- **Push, not a task per token.** The relay is the stream's `sink`: the runner link's receive
  loop hands it each chunk, and the relay renders and writes it right there. A write that
  completes at once (every write while the client keeps up) costs no task switch at all.
- **Backpressure.** A transport whose client is not reading returns an awaitable from
  `write`; the relay finishes it in a task and, meanwhile, new chunks queue in the stream
  (bounded: later ones are merged, see gateway.streaming.request_stream). They go out together, as
  one write, when the client catches up.
- **Timers.** One per relay, re-armed when it fires, not per token: a keep-alive for
  transports that have one, and the stream timeout (a runner silent for `stream_timeout`
  ends the request with an error; silence while the request's model loads on its runner
  does not count, `RequestStream.model_loading`).
- **Cancel on close.** Closing a relay before its request ended (the client left, the
  timeout) cancels the request on its runner.
- **Stored answers.** A `store: true` request's relay has a `Keeper` (gateway.streaming.keeper):
  every chunk rendered is also fed to it, and it stores the completion when it finishes.
- **Fault isolation.** Anything that goes wrong while serving this client (rendering,
  writing, a bug here) ends this request with an error to this client, is logged once with
  the request id, and never reaches the runner link or any other request. A transport
  raising `OSError` means its client is gone: that ends the request quietly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.errors import StreamTimeout
from gateway.http_errors import api_error_for
from gateway.streaming.keeper import Keeper
from gateway.streaming.request_stream import Failed, RequestStream, StreamItem, next_item
from protocol.core.errors import server_error
from protocol.core.stream import CompletionBuilder, CompletionStream, Item
from protocol.frames import Chunk

log = logging.getLogger("gateway.relay")


class Transport(Protocol):
    """Where one request's messages go."""

    @property
    def keepalive(self) -> bytes | None:
        """Sent after `keepalive_interval` without a write; None: this transport needs none."""

    def write(self, messages: list[bytes], last: bool) -> Awaitable[None] | None:
        """Write `messages` (the request's last ones when `last`). None when written (or
        queued for good) already; otherwise an awaitable that finishes the write, for a
        client that is not reading. Raises `OSError` when the client is gone."""


def as_item(item: StreamItem) -> Item:
    """A stream item as the completion stream takes it (gateway failures as `ApiError`s)."""
    return api_error_for(item.error) if isinstance(item, Failed) else item


async def first_item(
    stream: RequestStream, config: GatewayConfig, cancel: Callable[[RequestStream], None]
) -> StreamItem | None:
    """Wait up to `first_token_wait` for the request's first item: both transports take it
    before they start relaying, so that a failure before the first token can still be a
    proper HTTP error. None: nothing came in time (the stream commits without it).

    With `first_token_wait` at or past the stream timeout, silence is the timeout's error,
    unless the request's model is loading on its runner.
    A request left waiting here (timed out, or the caller cancelled) is cancelled.
    """
    try:
        first = await next_item(stream, min(config.first_token_wait, config.stream_timeout))
    except asyncio.CancelledError:
        cancel(stream)
        raise
    silent = first is None and config.first_token_wait >= config.stream_timeout
    if silent and not stream.model_loading():
        first = Failed(StreamTimeout(config.stream_timeout))
        timed_out(stream)
    if first is not None and not isinstance(first, Chunk) and not stream.done:
        cancel(stream)  # timed out: the runner may still be working on it
    return first


def timed_out(stream: RequestStream) -> None:
    """The runner went silent past the stream timeout: the request counts as "timeout" in the
    metrics (not as the cancel that follows)."""
    if stream.meter is not None:
        stream.meter.end("timeout")


async def collect(
    stream: RequestStream,
    builder: CompletionBuilder,
    seconds: float,
    cancel: Callable[[RequestStream], None],
    disconnected: Awaitable[None],
) -> bool:
    """The non-streaming twin of `Relay`: feed the request's items to `builder` until it is
    over, or the client leaves (`disconnected` finishes first). False: the client is gone.
    Either way a request still running is cancelled; a timeout becomes the builder's error.
    """
    collector = asyncio.ensure_future(_collect(stream, builder, seconds))
    gone = asyncio.ensure_future(disconnected)
    try:
        await asyncio.wait({collector, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collector.done():
            collector.cancel()
        if not stream.done:
            cancel(stream)  # client gone, or the runner timed out: stop generating
    if not collector.done() or collector.cancelled():
        return False
    collector.result()
    return True


async def _collect(stream: RequestStream, builder: CompletionBuilder, seconds: float) -> None:
    while True:
        item = await next_item(stream, seconds)
        if item is None and stream.model_loading():
            continue  # its model is loading: silence is expected
        if item is None:
            item = Failed(StreamTimeout(seconds))
            timed_out(stream)
        if builder.feed(as_item(item)):
            return


class Relay:
    """Relays one request to one client; see the module docstring."""

    __slots__ = (
        "_busy",
        "_faulted",
        "_heard",
        "_loop",
        "_task",
        "_timer",
        "_written",
        "cancel",
        "completion",
        "config",
        "done",
        "keeper",
        "sends_suspended",
        "stream",
        "transport",
    )

    def __init__(
        self,
        stream: RequestStream,
        completion: CompletionStream,
        transport: Transport,
        config: GatewayConfig,
        cancel: Callable[[RequestStream], None],
        *,
        keeper: Keeper | None = None,
    ) -> None:
        self.stream = stream
        self.completion = completion
        self.transport = transport
        self.config = config
        self.cancel = cancel
        """Stops the request on its runner (`Pool.cancel`)."""
        self.keeper = keeper
        """Stores the completion (`store: true` requests only)."""
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()
        """Resolved when the request's last message is written, or its client is gone."""
        self._busy = False
        """A write is waiting for the client; items queue in the stream meanwhile."""
        self._faulted = False
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._heard = self._written = self._loop.time()
        self.sends_suspended = 0
        """How often a write had to wait for the client (for tests and debugging)."""

    def start(self, first: StreamItem | None = None, *, commit: bool = False) -> None:
        """Relay `first` (an item the caller already took from the stream), what is queued,
        then every item as it arrives. `commit`: send the role chunk now even if no chunk
        has come yet (an SSE response that has committed to status 200)."""
        try:
            out: list[bytes] = []
            if commit and type(first) is not Chunk:
                self.completion.start(out)  # a first chunk starts it, with its usage
            finished = first is not None and self._render(first, out)
            finished = finished or self._render_queued(out)
            if not finished:
                self.stream.sink = self._on_item
                keepalive = self.config.keepalive_interval
                if self.transport.keepalive is None:
                    keepalive = self.config.stream_timeout
                self._arm(min(keepalive, self.config.stream_timeout))
            self._write(out, finished)
        except Exception as exc:
            self._fault(exc)

    def close(self) -> None:
        """Stop relaying; the request is cancelled on its runner unless it ended. Idempotent,
        and safe to call before `start` (a response that failed before its body)."""
        self._detach()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if not self.stream.done and not self.stream.cancelled:
            self.cancel(self.stream)  # the client went away, or the runner timed out
        self._end()

    # --- items ---------------------------------------------------------------------------

    def _render(self, item: StreamItem, out: list[bytes]) -> bool:
        """The messages for one item; True when the request is over."""
        if type(item) is Chunk:
            finished = self.completion.feed(item, out)
            if self.keeper is not None:
                self.keeper.feed(item)  # after the render: a chunk that failed it is not kept
            return finished
        return self.completion.feed(as_item(item), out)

    def _render_queued(self, out: list[bytes]) -> bool:
        """The messages for what waits in the stream (merged past its bound); True when the
        request is over."""
        finished = False
        while not finished and (item := self.stream.get_nowait()) is not None:
            finished = self._render(item, out)
        return finished

    def _send(self, out: list[bytes], finished: bool) -> None:
        if finished:
            self._detach()
        self._write(out, finished)

    def _on_item(self, item: StreamItem) -> bool:
        """`RequestStream.sink`: write the item now; False (queue it) while a write waits."""
        if self._busy:
            return False
        self._heard = self._loop.time()
        try:
            out: list[bytes] = []
            self._send(out, self._render(item, out))
        except Exception as exc:
            self._fault(exc)
        return True

    def _write(self, out: list[bytes], last: bool) -> None:
        """Write `out`; completes here unless the client's buffer is full."""
        if not out:
            if last:
                self._end()
            return
        self._written = self._loop.time()
        try:
            pending = self.transport.write(out, last)
        except OSError as exc:
            self._gone(exc)
            return
        if pending is None:
            if last:
                self._end()
            return
        self._busy = True
        self.sends_suspended += 1
        self._task = self._loop.create_task(self._finish_write(pending, last))

    async def _finish_write(self, pending: Awaitable[None], last: bool) -> None:
        try:
            await pending
        except OSError as exc:
            self._gone(exc)
            return
        except Exception as exc:
            self._fault(exc)
            return
        self._busy = False
        if last:
            self._end()
            return
        try:
            out: list[bytes] = []
            self._send(out, self._render_queued(out))
        except Exception as exc:
            self._fault(exc)

    # --- timers --------------------------------------------------------------------------

    def _tick(self) -> None:
        """Keep-alive after `keepalive_interval` without a write; end a silent stream."""
        self._timer = None
        try:
            now = self._loop.time()
            timeout = self.config.stream_timeout
            if now - self._heard >= timeout and self.stream.model_loading():
                self._heard = now  # its model is loading: silence is expected
            if now - self._heard >= timeout:
                timed_out(self.stream)
                self._detach()
                if self._busy:
                    self._end()  # the client is not reading either: give up on it
                    return
                out: list[bytes] = []
                self.completion.fail(api_error_for(StreamTimeout(timeout)), out)
                self._write(out, True)
                return
            keepalive = self.transport.keepalive
            next_at = self._heard + timeout
            if keepalive is not None:
                interval = self.config.keepalive_interval
                if not self._busy and now - self._written >= interval:
                    self._write([keepalive], False)
                next_at = min(next_at, self._written + interval)
            self._arm(next_at - now)
        except Exception as exc:
            self._fault(exc)

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(delay, 0.001), self._tick)

    # --- endings -------------------------------------------------------------------------

    def _detach(self) -> None:
        """No more items through the sink (the stream is over, or nobody reads it)."""
        if self.stream.sink == self._on_item:
            self.stream.sink = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def _gone(self, exc: BaseException) -> None:
        log.debug("client of %s gone: %r", self.stream.request_id, exc)
        self._detach()
        self._end()

    def _fault(self, exc: Exception) -> None:
        """Something failed while serving this client: end its request with an error."""
        self._detach()
        if self._faulted:
            self._end()
            return
        self._faulted = True
        log.error(
            "serving request %s to its client failed; the request ends with an error",
            self.stream.request_id,
            exc_info=exc,
        )
        if not self._busy and not self.completion.over:
            try:
                out: list[bytes] = []
                self.completion.fail(server_error(), out)
                pending = self.transport.write(out, True)
                if pending is not None:
                    self._task = self._loop.create_task(self._finish_write(pending, True))
                    return
            except Exception:
                log.debug("could not tell the client of %s", self.stream.request_id)
        self._end()
