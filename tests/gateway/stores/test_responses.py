"""The stored responses' bounds, on a clock the test drives: expiry, the count and byte
limits (oldest first), the 404 and the previous_response_id 400, and a store with no room."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.stores.responses import ResponseStore
from protocol.core.errors import ApiError
from protocol.frames import Message


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def response(id: str, text: str = "x") -> dict[str, Any]:
    return {"id": id, "object": "response", "status": "completed", "output": [text]}


CONVERSATION = (Message("user", "hi"), Message("assistant", "hello"))


def test_kept_until_it_expires() -> None:
    clock = Clock()
    store = ResponseStore(10, 10_000, 60, clock)
    assert store.keep(response("resp_1"), CONVERSATION)
    assert store.get("resp_1").body == orjson.dumps(response("resp_1"))
    assert store.conversation("resp_1") == CONVERSATION
    clock.now = 59.9
    assert len(store) == 1
    clock.now = 60
    assert len(store) == 0
    with pytest.raises(ApiError) as caught:
        store.get("resp_1")
    assert (caught.value.status, caught.value.param) == (404, "response_id")
    with pytest.raises(ApiError) as caught:
        store.conversation("resp_1")
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        "previous_response_id",
        "previous_response_not_found",
    )
    assert "expired" in caught.value.message


def test_the_oldest_goes_first_past_the_count() -> None:
    store = ResponseStore(2, 10_000, 60, Clock())
    for n in range(3):
        store.keep(response(f"resp_{n}"), CONVERSATION)
    assert len(store) == 2
    with pytest.raises(ApiError):
        store.get("resp_0")
    store.get("resp_2")


def test_the_oldest_go_first_past_the_bytes() -> None:
    store = ResponseStore(100, 300, 60, Clock())
    for n in range(3):
        assert store.keep(response(f"resp_{n}", "y" * 60), CONVERSATION)
    # Each: its JSON and the conversation's text.
    each = len(orjson.dumps(response("resp_0", "y" * 60))) + len("hi") + len("hello")
    assert 2 * each <= 300 < 3 * each
    assert store.nbytes == 2 * each
    assert len(store) == 2
    store.get("resp_1")  # the oldest went
    assert not store.keep(response("resp_big", "z" * 400), CONVERSATION)  # alone too large
    assert len(store) == 2


def test_delete() -> None:
    store = ResponseStore(10, 10_000, 60, Clock())
    store.keep(response("resp_1"), CONVERSATION)
    store.delete("resp_1")
    assert (len(store), store.nbytes) == (0, 0)
    with pytest.raises(ApiError):
        store.delete("resp_1")


@pytest.mark.parametrize("limits", [(0, 10, 10), (10, 0, 10), (10, 10, 0)])
def test_no_room_stores_nothing(limits: tuple[int, int, float]) -> None:
    store = ResponseStore(*limits)
    assert not store.enabled
    assert not store.keep(response("resp_1"), CONVERSATION)
    assert len(store) == 0
