"""Runners that load models on demand, as the gateway sees them (fake runners sending exactly
the frames a test wants): routing by model state, ModelStatus, /v1/models, /v1/runners and
the stream timeout while a model loads. The real runner: tests/e2e/test_models_on_demand.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from protocol.closecodes import CloseCode
from protocol.frames import Chunk, Download, Generate, ModelInfo, ModelStatus, Usage
from tests.gateway.gateways import FAKE_RUNNERS, SHORT_STREAM_TIMEOUT
from tests.gateway.waits import until_model_state, until_queued
from tests.support import UNIT, FakeRunner, Gateway, recv_until_closed, secs, sse_events

STREAM_TIMEOUT = 0.6
"""`timing_out`'s --stream-timeout, in the tests' time unit."""


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    """For routing and states: no timeout while a test holds a request."""
    return patient_gateway  # shared with other modules (conftest.py)


@pytest.fixture(scope="module")
def timing_out() -> Iterator[Gateway]:
    """Ends a request after STREAM_TIMEOUT without a frame from its runner; commits a stream
    before that."""
    gw = Gateway(
        "--stream-timeout", secs(STREAM_TIMEOUT), "--first-token-wait", secs(0.2), *FAKE_RUNNERS
    )
    yield gw
    gw.stop()


@pytest.fixture
async def timing_out_http(timing_out: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=timing_out.base, timeout=10 * UNIT) as client:
        yield client


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


async def generate(runner: FakeRunner) -> Generate:
    frame = await runner.next_request()
    assert isinstance(frame, Generate)
    return frame


async def answer(runner: FakeRunner, gen: Generate, text: str = "ok") -> None:
    await runner.send(Chunk(gen.request_id, 0, text, "", 1, Usage(3, 1), "stop"))


async def test_a_model_in_memory_somewhere_is_served_there_not_loaded_elsewhere(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    has = await FakeRunner.connect(
        gateway, name="has", infos=(ModelInfo("shared-a", 2048),), max_concurrent=1
    )
    could = await FakeRunner.connect(
        gateway, name="could", infos=(ModelInfo("shared-a", None, state="loadable"),)
    )
    try:
        # Every request goes to the runner that has the model loaded, even when it is busy:
        # the second waits for its slot rather than making the other runner load the model.
        first = asyncio.create_task(http.post("/v1/chat/completions", json=body("shared-a")))
        gen1 = await generate(has)
        second = asyncio.create_task(http.post("/v1/chat/completions", json=body("shared-a")))
        await until_queued(http, 1)
        assert not second.done()
        await answer(has, gen1, "one")
        gen2 = await generate(has)
        await answer(has, gen2, "two")
        assert (await first).json()["choices"][0]["message"]["content"] == "one"
        assert (await second).json()["choices"][0]["message"]["content"] == "two"

        # Once that runner unloads it, no runner holds it: the other one, with more free
        # slots, is given the next request (and loads the model).
        await has.send(ModelStatus(ModelInfo("shared-a", 2048, state="loadable")))
        await until_model_state(http, "has", "shared-a", "loadable")
        third = asyncio.create_task(http.post("/v1/chat/completions", json=body("shared-a")))
        gen3 = await generate(could)
        await answer(could, gen3, "three")
        assert (await third).json()["choices"][0]["message"]["content"] == "three"
    finally:
        await has.close()
        await could.close()


async def test_models_and_runners_show_each_models_state(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    runner = await FakeRunner.connect(
        gateway,
        name="shelf",
        infos=(
            ModelInfo("st-loaded", 2048, "mlx-lm", size_bytes=10),
            ModelInfo("st-lazy", None, state="loadable"),
        ),
    )
    try:
        models = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
        assert models["st-loaded"]["state"] == "loaded"
        assert models["st-lazy"]["state"] == "loadable"
        assert set(models["st-lazy"]) == {"id", "object", "created", "owned_by", "state"}

        loading = ModelInfo("st-lazy", None, state="loading", download=Download(512, 2048))
        await runner.send(ModelStatus(loading))

        async def shown() -> dict[str, Any]:
            runners = (await http.get("/v1/runners")).json()["data"]
            (mine,) = [r for r in runners if r["name"] == "shelf"]
            return {m["id"]: m for m in mine["models"]}

        await until_model_state(http, "shelf", "st-lazy", "loading")
        assert (await shown())["st-lazy"] == {
            "id": "st-lazy",
            "context_length": None,
            "engine": None,
            "state": "loading",
            "size_bytes": None,
            "download": {"done_bytes": 512, "total_bytes": 2048},
            "error": None,
            "defaults": None,
            "draft_model": None,
            "kv_bits": None,
            "adapter": None,
        }
        models = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
        assert models["st-lazy"]["state"] == "loading"
        ps = (await http.get("/api/ps")).json()["models"]
        assert "st-lazy" not in [m["name"] for m in ps]
        assert "st-loaded" in [m["name"] for m in ps]
    finally:
        await runner.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_silence_while_the_model_loads_is_not_a_timeout(
    timing_out: Gateway, timing_out_http: httpx.AsyncClient, stream: bool
) -> None:
    model = f"slow-load-{stream}"
    http = timing_out_http
    runner = await FakeRunner.connect(
        timing_out, name="loader", infos=(ModelInfo(model, None, state="loadable"),)
    )
    try:
        # The load is under way when the request comes (had it begun with the request, the
        # status would have to beat the stream timeout to the gateway).
        await runner.send(ModelStatus(ModelInfo(model, None, state="loading")))
        await until_model_state(http, "loader", model, "loading")
        post = asyncio.create_task(
            http.post("/v1/chat/completions", json=body(model, stream=stream))
        )
        gen = await generate(runner)
        # Twice the stream timeout with nothing for the request: it is loading.
        await asyncio.sleep(2 * STREAM_TIMEOUT * UNIT)
        assert not post.done()
        # The answer comes while the model still shows as loading: the silence it ends was
        # all in the load (a status "loaded" first would leave the gateway a moment in which
        # the silence, counted from before the load ended, is a timeout).
        await answer(runner, gen, "loaded at last")
        await runner.send(ModelStatus(ModelInfo(model, 2048, state="loaded")))
        resp = await post
        assert resp.status_code == 200
        if stream:
            contents = [
                e["choices"][0]["delta"].get("content")
                for e in sse_events(resp.content)
                if e != "[DONE]" and e["choices"]
            ]
            assert "loaded at last" in contents
        else:
            assert resp.json()["choices"][0]["message"]["content"] == "loaded at last"
    finally:
        await runner.close()


async def test_silence_once_loaded_times_out_as_before(
    timing_out: Gateway, timing_out_http: httpx.AsyncClient
) -> None:
    runner = await FakeRunner.connect(timing_out, name="mute", infos=(ModelInfo("mute-m", 2048),))
    try:
        post = asyncio.create_task(
            timing_out_http.post("/v1/chat/completions", json=body("mute-m"))
        )
        await generate(runner)
        resp = await asyncio.wait_for(post, 10 * UNIT)
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "timeout"
    finally:
        await runner.close()


async def test_a_status_for_a_model_the_hello_did_not_list_closes_that_runner(
    gateway: Gateway,
) -> None:
    runner = await FakeRunner.connect(gateway, name="liar", infos=(ModelInfo("liar-m", 2048),))
    await runner.send(ModelStatus(ModelInfo("not-mine", 2048)))
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(recv_until_closed(runner.ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.ILLEGAL_STATE
    assert "model_status for 'not-mine'" in closed.value.rcvd.reason


async def test_a_first_token_wait_past_the_stream_timeout_waits_for_a_loading_model(
    short_timeout_gateway: Gateway,
) -> None:
    # Here a streaming request waits for its first token longer than the stream timeout (a
    # runner silent that long is an HTTP error before any answer) unless its model is loading.
    stream_timeout = SHORT_STREAM_TIMEOUT
    gw = short_timeout_gateway
    runner = await FakeRunner.connect(
        gw, name="loader", infos=(ModelInfo("m", None, state="loadable"),)
    )
    try:
        async with httpx.AsyncClient(base_url=gw.base, timeout=10 * UNIT) as http:
            # The load is under way when the request comes (see the test above).
            await runner.send(ModelStatus(ModelInfo("m", None, state="loading")))
            await until_model_state(http, "loader", "m", "loading")
            post = asyncio.create_task(
                http.post("/v1/chat/completions", json=body("m", stream=True))
            )
            gen = await generate(runner)
            await asyncio.sleep(2 * stream_timeout * UNIT)  # silent, but loading
            assert not post.done()
            await answer(runner, gen, "here")  # still loading, as above
            await runner.send(ModelStatus(ModelInfo("m", 2048, state="loaded")))
            resp = await post
            assert resp.status_code == 200, resp.text
            events = [e for e in sse_events(resp.content) if e != "[DONE]"]
            # The role's chunk, the text, the finish.
            assert [e["choices"][0]["delta"].get("content") for e in events] == [
                "",
                "here",
                None,
            ]
    finally:
        await runner.close()
