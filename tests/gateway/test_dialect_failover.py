"""Failover before the first token, the same in every dialect: a runner that goes away after
taking a request, before its first chunk, does not lose it; the request moves to another
runner serving the model, and the client gets that runner's answer in its own API's shape,
streamed and not."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from protocol.frames import Generate
from tests.support import FakeRunner, Gateway, sse_events

MODEL = "moving-model"
USER = [{"role": "user", "content": "hi"}]


def _chat(stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": stream}


def _responses(stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"model": MODEL, "input": "hi", "stream": stream, "store": False}


def _anthropic(stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 8, "stream": stream}


def _ollama(stream: bool) -> tuple[str, dict[str, Any]]:
    return "/api/chat", {"model": MODEL, "messages": USER, "stream": stream}


def _text(path: str, stream: bool, content: bytes) -> str:
    """The answer's text, read in the dialect's own shape."""
    if not stream:
        body = orjson.loads(content)
        if path == "/v1/chat/completions":
            return str(body["choices"][0]["message"]["content"])
        if path == "/v1/responses":
            return str(body["output"][0]["content"][0]["text"])
        if path == "/v1/messages":
            return str(body["content"][0]["text"])
        return str(body["message"]["content"])
    if path == "/api/chat":
        lines = [orjson.loads(line) for line in content.splitlines() if line]
        assert lines[-1]["done"] is True
        return "".join(line["message"]["content"] for line in lines)
    if path in ("/v1/messages", "/v1/responses"):  # named events, no [DONE]
        events = [
            orjson.loads(line[len(b"data: ") :])
            for line in content.splitlines()
            if line.startswith(b"data: ")
        ]
        if path == "/v1/messages":
            assert events[-1]["type"] == "message_stop"
            return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        assert events[-1]["type"] == "response.completed"
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    events = sse_events(content)
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])


DIALECTS: dict[str, Callable[[bool], tuple[str, dict[str, Any]]]] = {
    "chat": _chat,
    "responses": _responses,
    "anthropic": _anthropic,
    "ollama": _ollama,
}


@pytest.fixture(scope="module")
def gateway(patient_gateway: Gateway) -> Gateway:
    return patient_gateway  # shared with other modules (conftest.py)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_a_request_moves_when_its_runner_leaves_before_the_first_token(
    gateway: Gateway, http: httpx.AsyncClient, dialect: str, stream: bool
) -> None:
    path, body = DIALECTS[dialect](stream)
    leaving = await FakeRunner.connect(gateway, models=(MODEL,), name="leaving")
    backup: FakeRunner | None = None
    asked = asyncio.create_task(http.post(path, json=body))
    try:
        first = await leaving.next_request()
        assert isinstance(first, Generate)
        backup = await FakeRunner.connect(gateway, models=(MODEL,), name="backup")
        await leaving.close()  # gone, with the request and no token sent
        moved = await backup.next_request()
        assert isinstance(moved, Generate)
        assert moved.request_id == first.request_id
        assert moved.messages == first.messages
        await backup.send(FakeRunner.chunk(moved.request_id, 0, "moved"))
        await backup.send(FakeRunner.chunk(moved.request_id, 1, " on", done=True))
        response = await asked
        assert response.status_code == 200, response.text
        assert _text(path, stream, response.content) == "moved on"
    finally:  # a failure here must not leave a runner for the next case's request
        asked.cancel()
        await leaving.close()
        if backup is not None:
            await backup.close()
