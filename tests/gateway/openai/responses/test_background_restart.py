"""A background response never stays in progress across a gateway's end: one that a
gateway killed (SIGKILL) left running is marked failed by the next gateway on the same store,
one that a stopping gateway (SIGTERM) could not finish is stored failed by it; a finished one
is retrieved, replayed and continued after the restart."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import orjson
import websockets

from protocol.frames import Chunk, Generate, Usage
from tests.gateway.gateways import FAKE_RUNNERS
from tests.support import UNIT, FakeRunner, Gateway, async_wait_until, secs


def started(store: Path) -> Gateway:
    return Gateway("--store", str(store), "--drain-timeout", secs(0.5), *FAKE_RUNNERS)


async def create(gateway: Gateway, **extra: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as http:
        body = {"model": "fake-model", "input": "Hi", "background": True, **extra}
        resp = await http.post("/v1/responses", json=body)
        assert resp.status_code == 200, resp.text
        created: dict[str, Any] = resp.json()
        return created


def retrieve(gateway: Gateway, rid: str, query: str = "") -> httpx.Response:
    return httpx.get(f"{gateway.base}/v1/responses/{rid}{query}", timeout=10 * UNIT)


async def until_status(gateway: Gateway, rid: str, status: str) -> None:
    async def reached() -> bool:
        return bool(retrieve(gateway, rid).json()["status"] == status)

    await async_wait_until(reached, 10, f"{rid} {status}")


async def generate(runner: FakeRunner) -> Generate:
    frame = await runner.next_request()
    assert isinstance(frame, Generate)
    return frame


async def test_killed_then_restarted_marks_the_run_failed_and_keeps_the_finished(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store.sqlite3"
    first = started(store)
    try:
        runner = await FakeRunner.connect(first)
        finished = await create(first)
        gen = await generate(runner)
        await runner.send(Chunk(gen.request_id, 0, "Done", "", 1, Usage(4, 1), "stop"))
        running = await create(first)
        await generate(runner)  # it runs, and its runner never answers
        await until_status(first, finished["id"], "completed")
        replayed = retrieve(first, finished["id"], "?stream=true").content
        first.process.proc.send_signal(signal.SIGKILL)
        first.process.proc.wait()
        await runner.close()
    finally:
        first.stop()
    second = started(store)
    try:
        failed = retrieve(second, running["id"]).json()
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "server_error"
        assert "gateway stopped" in failed["error"]["message"]
        kept = retrieve(second, finished["id"]).json()
        assert (kept["status"], kept["output"][0]["content"][0]["text"]) == ("completed", "Done")
        assert retrieve(second, finished["id"], "?stream=true").content == replayed
        events = [orjson.loads(line[6:]) for line in replayed.split(b"\n") if line[:5] == b"data:"]
        assert events[-1]["type"] == "response.completed"
    finally:
        second.stop()


async def test_a_stopping_gateway_stores_its_unfinished_runs_failed(tmp_path: Path) -> None:
    store = tmp_path / "store.sqlite3"
    first = started(store)
    try:
        runner = await FakeRunner.connect(first)
        running = await create(first)
        await generate(runner)
        await runner.send(Chunk(running["id"], 0, "Par", "", 1, Usage(4, 1)))
        await until_status(first, running["id"], "in_progress")
        stopping = asyncio.ensure_future(asyncio.to_thread(first.stop))
        # The drain sends the runner a cancel for what it still holds: answer it so.
        while not stopping.done():
            try:
                async with asyncio.timeout(0.2 * UNIT):
                    frame = await runner.next_request()
            except TimeoutError:
                continue
            except websockets.ConnectionClosed:
                break  # the gateway sent its runners away
            if not isinstance(frame, Generate):
                await runner.send(Chunk(running["id"], 1, "", "", 0, Usage(4, 1), "cancelled"))
        await stopping
    finally:
        first.stop()
    second = started(store)
    try:
        failed = retrieve(second, running["id"]).json()
        assert failed["status"] == "failed"
        assert "gateway stopped" in failed["error"]["message"]
        events = retrieve(second, running["id"], "?stream=true").content
        assert b"event: response.failed" in events  # its stream ends, as its object says
    finally:
        second.stop()
