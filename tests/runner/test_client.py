"""The runner's transport against a stand-in gateway (a websockets server speaking the
protocol): how chunks of many requests are packed into frames."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import pytest
import websockets
from websockets.asyncio.server import Server, ServerConnection, serve

from protocol.codec import decode_runner_frame, encode
from protocol.frames import (
    PROTOCOL_VERSION,
    Batch,
    Chunk,
    Echo,
    Generate,
    Hello,
    Message,
    ModelInfo,
    ModelState,
    ModelStatus,
    Usage,
    Welcome,
)
from protocol.merge import merge
from protocol.session import Delivered, GatewaySession
from runner.client import GATHER_MIN_REQUESTS, GATHER_S, Runner
from runner.engine.base import Engine, Output, Sink
from runner.engine.scripted import ScriptedEngine
from runner.hardware import detect
from tests.support import UNIT, async_wait_until

TOKENS = 20
RATE = 100.0


def runner_for(server: Server, engine: Engine, slots: int, gather: float = GATHER_S) -> Runner:
    """A real Runner pointed at a stand-in gateway."""
    port = server.sockets[0].getsockname()[1]
    return Runner(
        f"http://127.0.0.1:{port}",
        engine,
        name="test",
        max_concurrent=slots,
        hardware=detect("none"),
        gather=gather,
    )


async def serve_requests(
    requests: int, gather: float, spacing: float = 0.003
) -> dict[str, list[Chunk]]:
    """Send `requests` requests `spacing` s apart to a real Runner on a paced scripted engine;
    its chunks per request, once every request has finished."""
    chunks: dict[str, list[Chunk]] = {}
    finished: set[str] = set()
    all_done = asyncio.Event()

    async def gateway(ws: ServerConnection) -> None:
        assert isinstance(decode_runner_frame(await ws.recv()), Hello)
        await ws.send(encode(Welcome("runner-1", PROTOCOL_VERSION, 30.0)).decode())
        for i in range(requests):
            generate = Generate(f"r{i}", "scripted", (Message("user", "hi"),), TOKENS)
            await ws.send(encode(generate).decode())
            await asyncio.sleep(spacing)
        with contextlib.suppress(websockets.ConnectionClosed):  # the runner left
            async for data in ws:
                frame = decode_runner_frame(data)
                for chunk in frame.frames if isinstance(frame, Batch) else (frame,):
                    if not isinstance(chunk, Chunk):
                        continue
                    chunks.setdefault(chunk.request_id, []).append(chunk)
                    if chunk.finish_reason is not None:
                        finished.add(chunk.request_id)
                if len(finished) == requests:
                    all_done.set()

    engine = ScriptedEngine(("scripted",), RATE, max_concurrent=requests)
    async with serve(gateway, "127.0.0.1", 0) as server:
        runner = runner_for(server, engine, requests, gather=gather)
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(all_done.wait(), 20 * UNIT)
        runner.stop()
        await asyncio.wait_for(task, 10 * UNIT)
    return chunks


def check_exact(chunks: dict[str, list[Chunk]], requests: int) -> None:
    assert sorted(chunks) == sorted(f"r{i}" for i in range(requests))
    for got in chunks.values():
        assert "".join(c.text for c in got) == "".join(f"tok{n} " for n in range(TOKENS))
        assert sum(c.tokens for c in got) == TOKENS
        assert got[-1].finish_reason == "length"
        assert got[-1].usage.completion_tokens == TOKENS
        assert [c.seq for c in got] == list(range(len(got)))


@pytest.mark.parametrize(
    ("requests", "gather"),
    [(GATHER_MIN_REQUESTS * 2, 0.02), (GATHER_MIN_REQUESTS * 2, 0.0), (4, 3600.0)],
    ids=["gathered", "apart", "few-held-an-hour"],
)
async def test_paced_requests_arrive_exactly_however_they_are_gathered(
    requests: int, gather: float
) -> None:
    # Real engine rounds, merged and gathered as they come: nothing lost, doubled or
    # reordered; and with few requests in flight an hour's gather holds nothing back.
    check_exact(await serve_requests(requests, gather), requests)


class SteppedEngine(Engine):
    """An engine that emits what the test tells it to, one event at a time, from a thread of
    its own as an engine does (`emit`)."""

    def __init__(self) -> None:
        self.submitted: list[Generate] = []
        self._sink: Sink | None = None

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        return (ModelInfo("stepped", 4096),)

    def start(self, sink: Sink) -> None:
        self._sink = sink

    def submit(self, request: Generate) -> None:
        self.submitted.append(request)

    def cancel(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass

    async def emit(self, request_id: str, token: int, *, last: bool = False) -> None:
        """Emit token `token` of a request (the last one if `last`) from another thread, and
        return once the runner's loop has taken it in (the sink wakes the loop with
        `call_soon_threadsafe`, which runs callbacks in order: the runner's before ours)."""
        output = Output(
            request_id,
            f"tok{token} ",
            "",
            1,
            Usage(1, token + 1),
            "length" if last else None,
        )
        assert self._sink is not None
        await asyncio.to_thread(self._sink, output)


@attrs.define
class SteppedRun:
    """A real Runner on a `SteppedEngine`, `requests` requests in flight, and each frame that
    reached the stand-in gateway (its chunks). Its gather window opens, instead of on the
    clock, in `windows` (the delays asked for); `close_window()` ends it."""

    runner: Runner
    engine: SteppedEngine
    frames: list[list[Chunk]]
    windows: list[float]
    _received: asyncio.Condition
    _pending: list[Callable[[], None]]

    def close_window(self) -> None:
        (drain,) = self._pending
        self._pending.clear()
        drain()

    async def frames_received(self, count: int) -> list[list[Chunk]]:
        """Wait for `count` frames in all; the frames."""
        async with self._received:
            await asyncio.wait_for(
                self._received.wait_for(lambda: len(self.frames) >= count), 10 * UNIT
            )
        return self.frames


@contextlib.asynccontextmanager
async def stepped_run(
    requests: int, gather: float, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[SteppedRun]:
    frames: list[list[Chunk]] = []
    received = asyncio.Condition()

    async def gateway(ws: ServerConnection) -> None:
        assert isinstance(decode_runner_frame(await ws.recv()), Hello)
        await ws.send(encode(Welcome("runner-1", PROTOCOL_VERSION, 30.0)).decode())
        for i in range(requests):
            generate = Generate(f"r{i}", "stepped", (Message("user", "hi"),), TOKENS)
            await ws.send(encode(generate).decode())
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in ws:
                frame = decode_runner_frame(data)
                sent = frame.frames if isinstance(frame, Batch) else (frame,)
                chunks = [chunk for chunk in sent if isinstance(chunk, Chunk)]
                if chunks:
                    async with received:
                        frames.append(chunks)
                        received.notify_all()

    engine = SteppedEngine()
    async with serve(gateway, "127.0.0.1", 0) as server:
        runner = runner_for(server, engine, requests, gather=gather)
        windows: list[float] = []
        pending: list[Callable[[], None]] = []
        loop = asyncio.get_running_loop()
        call_later = loop.call_later

        def held_call_later(delay: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
            if callback == runner._drain_events:  # the gather window: the test ends it
                windows.append(delay)
                pending.append(callback)
                return None
            return call_later(delay, callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_later", held_call_later)
        task = asyncio.create_task(runner.run())

        async def all_submitted() -> bool:
            return len(engine.submitted) == requests

        try:
            await async_wait_until(all_submitted, 10, "the requests to reach the engine")
            yield SteppedRun(runner, engine, frames, windows, received, pending)
        except BaseException:
            task.cancel()  # requests left unfinished: no drain to wait for
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise
        runner.stop()
        await asyncio.wait_for(task, 10 * UNIT)


def tokens_of(frame: list[Chunk]) -> list[tuple[str, str, int]]:
    return [(chunk.request_id, chunk.text, chunk.tokens) for chunk in frame]


async def test_many_requests_share_frames_when_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    n = GATHER_MIN_REQUESTS
    async with stepped_run(n, 0.25, monkeypatch) as run:
        # One token of each request, one at a time: the first opens the window, nothing
        # goes out until it ends, then all of them go out in one frame.
        for i in range(n):
            await run.engine.emit(f"r{i}", 0)
        assert run.windows == [0.25]
        assert run.runner.frames_sent == 0
        run.close_window()
        (frame,) = await run.frames_received(1)
        assert tokens_of(frame) == [(f"r{i}", "tok0 ", 1) for i in range(n)]
        # Two tokens of each: a request's tokens are merged into one chunk.
        for token in (1, 2):
            for i in range(n):
                await run.engine.emit(f"r{i}", token, last=token == 2)
        assert run.windows == [0.25, 0.25]
        run.close_window()
        frames = await run.frames_received(2)
        assert tokens_of(frames[1]) == [(f"r{i}", "tok1 tok2 ", 2) for i in range(n)]
        assert all(chunk.finish_reason == "length" for chunk in frames[1])
        assert (run.runner.frames_sent, run.runner.chunks_sent) == (2, 2 * n)
    assert len(run.frames) == 2


async def test_with_no_gather_each_burst_is_its_own_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = GATHER_MIN_REQUESTS
    async with stepped_run(n, 0.0, monkeypatch) as run:
        for i in range(n):
            await run.engine.emit(f"r{i}", 0, last=True)
            assert run.runner.frames_sent == i + 1
        frames = await run.frames_received(n)
        assert [tokens_of(frame) for frame in frames] == [[(f"r{i}", "tok0 ", 1)] for i in range(n)]
    assert run.windows == []
    assert run.runner.chunks_sent == n


async def test_few_requests_are_never_held_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # One request short of gathering, with an hour's window: every token goes out at once.
    n = GATHER_MIN_REQUESTS - 1
    async with stepped_run(n, 3600.0, monkeypatch) as run:
        for i in range(n):
            await run.engine.emit(f"r{i}", 0)
            assert run.runner.frames_sent == i + 1
        frames = await run.frames_received(n)
        assert [tokens_of(frame) for frame in frames] == [[(f"r{i}", "tok0 ", 1)] for i in range(n)]
        for i in range(n):
            await run.engine.emit(f"r{i}", 1, last=True)
        await run.frames_received(2 * n)
    assert run.windows == []


async def test_frames_keep_their_order_when_the_gateway_stops_reading() -> None:
    # Big tokens and a stand-in gateway that reads nothing for a while: sends wait for
    # the socket, frames queue behind them, and every request's chunks still arrive
    # complete and in order (the session refuses a gap or a repeat).
    big = "x" * 32_768
    requests, tokens = 4, 400
    session_frames: list[Chunk] = []
    all_in = asyncio.Event()

    async def gateway(ws: ServerConnection) -> None:
        hello = decode_runner_frame(await ws.recv())
        assert isinstance(hello, Hello)
        session: GatewaySession[str] = GatewaySession()
        session.receive(hello)
        await ws.send(encode(Welcome("runner-1", PROTOCOL_VERSION, 30.0)).decode())
        for i in range(requests):
            generate = Generate(f"r{i}", "scripted", (Message("user", "hi"),), tokens)
            session.assign(generate, generate.request_id)
            await ws.send(encode(generate).decode())
        # Read nothing until the engine is halfway (26 MB, far more than the sockets and
        # websockets' queues take in): the runner's sends back up.
        await async_wait_until(halfway, 15, "half of the tokens")
        ended = 0
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in ws:
                await asyncio.sleep(0.002)  # then read slowly, while the runner produces
                for event in session.receive(decode_runner_frame(data)):
                    if isinstance(event, Delivered):
                        session_frames.append(event.chunk)
                        ended += event.chunk.finish_reason is not None
                if ended == requests:
                    all_in.set()

    engine = ScriptedEngine(("scripted",), 1000.0, max_concurrent=requests, text=lambda r, i: big)

    async def halfway() -> bool:
        return engine.stats.tokens_generated >= requests * tokens // 2

    async with serve(gateway, "127.0.0.1", 0, max_size=None) as server:
        runner = runner_for(server, engine, requests)
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(all_in.wait(), 30 * UNIT)
        runner.stop()
        await asyncio.wait_for(task, 10 * UNIT)
    assert runner.most_queued > 1  # frames really queued behind the stalled gateway
    for i in range(requests):
        mine = [c for c in session_frames if c.request_id == f"r{i}"]
        assert sum(c.tokens for c in mine) == tokens
        assert "".join(c.text for c in mine) == big * tokens


def test_merged_outputs_keep_each_choices_echo() -> None:
    """Outputs that piled up are merged per choice (`protocol.merge`, as the runner merges
    them); a choice's first output carries its echo, and the merged one keeps it."""
    echo = Echo("Hi")
    outputs = [
        Output("r", "a", "", 1, Usage(1, 1), echo=echo),
        Output("r", "b", "", 1, Usage(1, 2), index=1, echo=echo),
        Output("r", "c", "", 1, Usage(1, 3)),
    ]
    merged = {output.index: output for output in merge(outputs, echo_apart=True)}
    assert (merged[0].text, merged[0].echo) == ("ac", echo)
    assert (merged[1].text, merged[1].echo) == ("b", echo)


def test_echo_pieces_are_not_merged_together() -> None:
    """Merged, the pieces of a long prompt's echo would make one frame as large as it."""
    outputs = [
        Output("r", "", "", 0, Usage(1, 0), echo=Echo("a")),
        Output("r", "", "", 0, Usage(1, 0), echo=Echo("b")),
        Output("r", "x", "", 1, Usage(1, 1)),
        Output("r", "y", "", 1, Usage(1, 2)),
    ]
    merged = merge(outputs, echo_apart=True)
    assert [(o.echo, o.text) for o in merged] == [(Echo("a"), ""), (Echo("b"), "xy")]


class ChangingEngine(ScriptedEngine):
    """A scripted engine whose model is loading until `loaded` is set."""

    def __init__(self) -> None:
        super().__init__(("m",))
        self.loaded = False

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        state: ModelState = "loaded" if self.loaded else "loading"
        return (ModelInfo("m", 4096, state=state),)


async def test_a_model_that_changed_during_the_handshake_is_told_after_it() -> None:
    frames: list[object] = []
    told = asyncio.Event()
    engine = ChangingEngine()

    async def gateway(ws: ServerConnection) -> None:
        frames.append(decode_runner_frame(await ws.recv()))
        engine.loaded = True  # between the hello and the welcome: no session to tell it yet
        await ws.send(encode(Welcome("runner-1", PROTOCOL_VERSION, 30.0)).decode())
        frames.append(decode_runner_frame(await ws.recv()))
        told.set()
        with contextlib.suppress(websockets.ConnectionClosed):
            async for _ in ws:
                pass

    async with serve(gateway, "127.0.0.1", 0) as server:
        runner = runner_for(server, engine, 1)
        running = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(told.wait(), 10 * UNIT)
        finally:
            runner.stop()
            await asyncio.wait_for(running, 10 * UNIT)
    hello, status = frames
    assert isinstance(hello, Hello)
    assert hello.models == (ModelInfo("m", 4096, state="loading"),)
    assert status == ModelStatus(ModelInfo("m", 4096, state="loaded"))
