"""What the Responses WebSocket test modules share: a gateway with a paced scripted runner,
reading the SDK's events up to each response's end, raw sockets for what the SDK would never
send, and a proxy that can drop a client's socket with a close code of its choice (as a
load balancer or a restarting server does), so that the SDK's reconnection runs against the
real gateway behind it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve

from tests.support import UNIT, Gateway, Process, start_runner, wait_until

MODEL = "scripted-m"
RATE = 100.0
"""The scripted runner's tokens per second: slow enough that concurrent lanes interleave."""
TERMINAL = frozenset(("response.completed", "response.incomplete", "response.failed", "error"))


def scripted_runner(
    gateway: Gateway, rate: float = RATE, slots: int = 8, key: str | None = None
) -> Process:
    """A scripted runner on `gateway`, once the gateway lists it (asked with `key`)."""
    runner = start_runner(
        gateway,
        "--engine",
        "scripted",
        "--model",
        MODEL,
        "--max-concurrent",
        str(slots),
        "--tokens-per-second",
        str(rate),
    )
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def listed() -> bool:
        got = httpx.get(f"{gateway.base}/v1/runners", headers=headers, timeout=5)
        return bool(got.json()["data"])

    wait_until(listed, 60, "the scripted runner")
    return runner


def expected(n: int) -> str:
    """The scripted engine's text for n tokens."""
    return "".join(f"tok{i} " for i in range(n))


def until_ends(events: Iterable[Any], count: int) -> list[Any]:
    """Events (the SDK's, or dicts) read until `count` responses have ended."""
    got: list[Any] = []
    ended = 0
    for event in events:
        got.append(event)
        kind = event["type"] if isinstance(event, dict) else event.type
        if kind in TERMINAL:
            ended += 1
            if ended == count:
                return got
    raise AssertionError(f"the socket closed after {ended} of {count} responses")


def by_lane(events: Iterable[Any]) -> dict[str | None, list[Any]]:
    lanes: dict[str | None, list[Any]] = {}
    for event in events:
        lanes.setdefault(getattr(event, "stream_id", None), []).append(event)
    return lanes


def text_of(events: Iterable[Any]) -> list[str]:
    """Each response's text, in the order they ended."""
    texts, current = [], ""
    for event in events:
        if event.type == "response.output_text.delta":
            current += event.delta
        if event.type in TERMINAL:
            texts.append(current)
            current = ""
    return texts


# --- raw sockets -------------------------------------------------------------------------------


def ws_url(gateway: Gateway) -> str:
    return f"ws://127.0.0.1:{gateway.port}/v1/responses"


@contextlib.asynccontextmanager
async def raw(gateway: Gateway, **options: Any) -> AsyncIterator[ClientConnection]:
    async with connect(ws_url(gateway), max_size=None, compression=None, **options) as sock:
        yield sock


async def send(ws: ClientConnection, obj: Any) -> None:
    await ws.send(orjson.dumps(obj), text=True)


async def recv(ws: ClientConnection, seconds: float = 10) -> dict[str, Any]:
    async with asyncio.timeout(seconds * UNIT):
        event: dict[str, Any] = orjson.loads(await ws.recv())
    return event


async def recv_until_ends(ws: ClientConnection, count: int) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    ended = 0
    while ended < count:
        event = await recv(ws, 20)
        got.append(event)
        ended += event["type"] in TERMINAL
    return got


def create(stream_id: str | None = None, **body: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "type": "response.create",
        "model": MODEL,
        "input": "hi",
        "max_output_tokens": 16,
        **body,
    }
    if stream_id is not None:
        obj["stream_id"] = stream_id
    return obj


# --- a proxy that drops sockets ---------------------------------------------------------------


class DroppingProxy:
    """A WebSocket proxy in front of `/v1/responses`: each client socket gets its own socket to
    the gateway (the upgrade's Authorization header passed on); `drop(code)` closes every
    client socket with `code`, and its upstream socket, as a restarting server would."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.server: Server | None = None
        self.port = 0
        self.clients: set[ServerConnection] = set()
        self.connections = 0

    async def __aenter__(self) -> DroppingProxy:
        self.server = await serve(self._handle, "127.0.0.1", 0, max_size=None, compression=None)
        self.port = next(iter(self.server.sockets)).getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _handle(self, client: ServerConnection) -> None:
        self.connections += 1
        headers = {}
        assert client.request is not None
        if "authorization" in client.request.headers:
            headers["Authorization"] = client.request.headers["authorization"]
        async with connect(
            ws_url(self.gateway), additional_headers=headers, max_size=None, compression=None
        ) as upstream:
            self.clients.add(client)

            async def down() -> None:
                async for message in upstream:
                    await client.send(message)

            async def up() -> None:
                async for message in client:
                    await upstream.send(message)

            tasks = [asyncio.ensure_future(down()), asyncio.ensure_future(up())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self.clients.discard(client)

    async def drop(self, code: int, reason: str = "service restart") -> None:
        for client in list(self.clients):
            await client.close(code, reason)


@contextlib.contextmanager
def stopped(*processes: Process | Gateway) -> Iterator[None]:
    try:
        yield
    finally:
        for process in processes:
            process.stop()
