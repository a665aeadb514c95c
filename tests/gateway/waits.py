"""Waiting for a gateway's state instead of sleeping: what `GET /v1/runners` shows (its queue,
each runner's requests in flight and models), polled until it is so (`async_wait_until`, whose
bound is in the tests' time unit). A client passed in carries the API key where one is set.

Candidates for tests.support once other packages need them."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support import async_wait_until


async def listing(http: httpx.AsyncClient) -> dict[str, Any]:
    """`GET /v1/runners`: `data` (each runner) and `queue_depth`."""
    resp = await http.get("/v1/runners")
    assert resp.status_code == 200, resp.text
    listed: dict[str, Any] = resp.json()
    return listed


async def until_queued(http: httpx.AsyncClient, depth: int) -> None:
    """Until the gateway's queues hold `depth` requests waiting for a slot."""

    async def queued() -> bool:
        depth_now: int = (await listing(http))["queue_depth"]
        return depth_now == depth

    await async_wait_until(queued, 10, f"{depth} request(s) in the queue")


async def until_idle(http: httpx.AsyncClient, name: str = "fake") -> None:
    """Until the runner called `name` holds no request (its `active` is 0): every slot came
    back. It must stay connected meanwhile (a runner dropped, say for missing heartbeats,
    would free its slots by leaving)."""

    async def idle() -> bool:
        listed = [r for r in (await listing(http))["data"] if r["name"] == name]
        assert listed, f"the runner {name!r} left"
        return all(r["active"] == 0 for r in listed)

    await async_wait_until(idle, 10, f"the slots of {name!r} to be free")


async def until_gone(http: httpx.AsyncClient, name: str) -> None:
    """Until no runner called `name` is connected (the gateway has seen it leave)."""

    async def gone() -> bool:
        return all(r["name"] != name for r in (await listing(http))["data"])

    await async_wait_until(gone, 10, f"the runner {name!r} to leave")


async def until_model_state(http: httpx.AsyncClient, runner: str, model: str, state: str) -> None:
    """Until the runner called `runner` shows `model` in `state` (a ModelStatus it sent was
    taken in)."""

    async def shown() -> bool:
        for r in (await listing(http))["data"]:
            if r["name"] == runner:
                return any(m["id"] == model and m["state"] == state for m in r["models"])
        return False

    await async_wait_until(shown, 10, f"{runner!r} to show {model!r} {state}")
