"""What a finished answer's `Keeper` stores: a streamed completion only once its runner
finished it (stop, length, tool_calls), every choice of it, nothing of a cancelled or failed
one; and only for requests that asked (`store: true`)."""

from __future__ import annotations

import orjson
import pytest

from gateway.openai.chat.routes import keeper_of
from gateway.stores.chat import CompletionStore
from gateway.streaming.keeper import Keeper, keepable
from protocol.core.errors import ApiError
from protocol.core.stream import CompletionBuilder
from protocol.frames import Chunk, FinishReason, Usage
from protocol.openai.chat.request import parse_chat_object


def make() -> CompletionStore:
    return CompletionStore(100, 1 << 20, 60, lambda: 0.0)


# --- what gets stored ---------------------------------------------------------------------


def chunk(seq: int, text: str, finish: FinishReason | None = None) -> Chunk:
    return Chunk("c", seq, text, "", 1, Usage(3, seq + 1), finish)


def keeper(store: CompletionStore) -> Keeper:
    chat = parse_chat_object(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "store": True},
        store=True,
    )
    made = keeper_of(store, chat, id="c", created=7, fingerprint="fp_x", request_id="req_c")
    assert made is not None
    return made


@pytest.mark.parametrize("finish", ["stop", "length", "tool_calls"])
def test_a_finished_stream_is_stored(finish: FinishReason) -> None:
    store = make()
    keep = keeper(store)
    keep.feed(chunk(0, "Hel"))
    assert len(store) == 0  # not before its end
    keep.feed(chunk(1, "lo", finish))
    stored = orjson.loads(store.get("c"))
    assert stored["id"] == "c"
    assert stored["created"] == 7
    assert stored["model"] == "m"
    assert stored["system_fingerprint"] == "fp_x"
    assert stored["request_id"] == "req_c"
    assert stored["choices"][0]["message"]["content"] == "Hello"
    assert stored["choices"][0]["finish_reason"] == finish
    assert stored["usage"]["completion_tokens"] == 2


def test_every_choice_is_stored() -> None:
    store = make()
    chat = parse_chat_object(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "store": True, "n": 2},
        store=True,
    )
    keep = keeper_of(store, chat, id="c", created=7, fingerprint=None, request_id="r")
    assert keep is not None
    usage = Usage(3, 1)
    keep.feed(Chunk("c", 0, "a", "", 1, usage, index=1, choice_finish="length"))
    keep.feed(Chunk("c", 1, "b", "", 1, Usage(3, 2), "stop", index=0))
    choices = orjson.loads(store.get("c"))["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == [
        (0, "b", "stop"),
        (1, "a", "length"),
    ]


def test_a_cancelled_stream_is_not_stored() -> None:
    store = make()
    keep = keeper(store)
    keep.feed(chunk(0, "Hel"))
    keep.feed(chunk(1, "", "cancelled"))
    assert len(store) == 0


def test_only_requests_that_asked_have_a_keeper() -> None:
    chat = parse_chat_object({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert keeper_of(make(), chat, id="c", created=1, fingerprint=None, request_id="r") is None


def test_keepable() -> None:
    builder = CompletionBuilder()
    assert not keepable(builder)  # nothing yet
    builder.feed(chunk(0, "a"))
    assert not keepable(builder)  # not over
    builder.feed(chunk(1, "b", "length"))
    assert keepable(builder)
    failed = CompletionBuilder()
    failed.feed(chunk(0, "a"))
    failed.feed(ApiError(502, "lost", "server_error"))
    assert not keepable(failed)
