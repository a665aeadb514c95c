"""The runner's transport against a stand-in gateway (a websockets server speaking the
protocol): how chunks of many requests are packed into frames."""

from __future__ import annotations

import asyncio
import contextlib
import time

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
from protocol.session import Delivered, GatewaySession
from runner.client import GATHER_MIN_REQUESTS, GATHER_S, Runner, _merged
from runner.engine.base import Output
from runner.engine.scripted import ScriptedEngine
from runner.hardware import detect

TOKENS = 20
RATE = 100.0


def runner_for(
    server: Server, engine: ScriptedEngine, slots: int, gather: float = GATHER_S
) -> Runner:
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
) -> tuple[Runner, dict[str, list[Chunk]], float]:
    """Send `requests` paced requests `spacing` s apart to a real Runner; its chunks per
    request, and the seconds until the last one finished."""
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
        started = time.perf_counter()
        await asyncio.wait_for(all_done.wait(), 20)
        took = time.perf_counter() - started
        runner.stop()
        await asyncio.wait_for(task, 10)
    return runner, chunks, took


def check_exact(chunks: dict[str, list[Chunk]], requests: int) -> None:
    assert sorted(chunks) == sorted(f"r{i}" for i in range(requests))
    for got in chunks.values():
        assert "".join(c.text for c in got) == "".join(f"tok{n} " for n in range(TOKENS))
        assert sum(c.tokens for c in got) == TOKENS
        assert got[-1].finish_reason == "length"
        assert got[-1].usage.completion_tokens == TOKENS
        assert [c.seq for c in got] == list(range(len(got)))


async def test_many_requests_share_frames_when_gathered() -> None:
    n = GATHER_MIN_REQUESTS * 2
    gathered, chunks, _ = await serve_requests(n, gather=0.02)
    check_exact(chunks, n)
    apart, chunks, _ = await serve_requests(n, gather=0.0)
    check_exact(chunks, n)
    assert gathered.chunks_sent < apart.chunks_sent  # a request's tokens merged
    assert gathered.frames_sent * 2 <= apart.frames_sent
    assert gathered.chunks_sent / gathered.frames_sent >= 4


async def test_few_requests_are_never_held_back() -> None:
    n = GATHER_MIN_REQUESTS // 4
    _, chunks, took = await serve_requests(n, gather=1.0)
    check_exact(chunks, n)
    assert took < 0.8  # 20 tokens at 100 tok/s take 0.2 s; one 1 s gather would show


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
        await asyncio.sleep(0.2)  # read nothing: the runner's sends back up
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
    async with serve(gateway, "127.0.0.1", 0, max_size=None) as server:
        runner = runner_for(server, engine, requests)
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(all_in.wait(), 15)
        runner.stop()
        await asyncio.wait_for(task, 10)
    assert runner.most_queued > 1  # frames really queued behind the stalled gateway
    for i in range(requests):
        mine = [c for c in session_frames if c.request_id == f"r{i}"]
        assert sum(c.tokens for c in mine) == tokens
        assert "".join(c.text for c in mine) == big * tokens


def test_merged_outputs_keep_each_choices_echo() -> None:
    """Outputs that piled up are merged per choice; a choice's first output carries its echo,
    and the merged one keeps it."""
    echo = Echo("Hi")
    outputs = [
        Output("r", "a", "", 1, Usage(1, 1), echo=echo),
        Output("r", "b", "", 1, Usage(1, 2), index=1, echo=echo),
        Output("r", "c", "", 1, Usage(1, 3)),
    ]
    merged = {output.index: output for output in _merged(outputs)}
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
    merged = _merged(outputs)
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
            await asyncio.wait_for(told.wait(), 10)
        finally:
            runner.stop()
            await asyncio.wait_for(running, 10)
    hello, status = frames
    assert isinstance(hello, Hello)
    assert hello.models == (ModelInfo("m", 4096, state="loading"),)
    assert status == ModelStatus(ModelInfo("m", 4096, state="loaded"))
