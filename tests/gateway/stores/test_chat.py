"""The gateway's store of chat completions, with no server: its bounds (count, bytes, oldest
dropped first), expiry on an injected clock, the list's order, filters and pages, updates and
deletes. What gets stored is tests/gateway/streaming/test_keeper.py's."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.config import GatewayConfig
from gateway.stores.chat import CompletionStore
from protocol.core.errors import ApiError
from protocol.openai.chat.request import parse_chat_object
from protocol.openai.chat.stored import ListQuery, StoreRequest, parse_list_query
from protocol.openai.pages import PageQuery


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(metadata: dict[str, str] | None = None, messages: int = 1) -> StoreRequest:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": f"message {i}"} for i in range(messages)],
        "store": True,
    }
    if metadata is not None:
        body["metadata"] = metadata
    stored = parse_chat_object(body, store=True).store
    assert stored is not None
    return stored


def body(id: str, created: int = 100, model: str = "m", text: str = "hi") -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
    }


def make(
    clock: Clock | None = None, count: int = 100, nbytes: int = 1 << 20, ttl: float = 60
) -> CompletionStore:
    return CompletionStore(count, nbytes, ttl, clock or Clock())


def listed(store: CompletionStore, *params: tuple[str, str]) -> dict[str, Any]:
    result: dict[str, Any] = orjson.loads(store.list(parse_list_query(params)))
    return result


def ids(store: CompletionStore, *params: tuple[str, str]) -> list[str]:
    return [item["id"] for item in listed(store, *params)["data"]]


def missing(store: CompletionStore, completion_id: str) -> bool:
    with pytest.raises(ApiError) as info:
        store.get(completion_id)
    assert info.value.status == 404
    return True


def test_a_kept_completion_is_its_body_plus_the_request() -> None:
    store = make()
    assert store.keep(body("c1"), request({"k": "v"}), "req_1")
    stored = orjson.loads(store.get("c1"))
    assert stored == {
        **body("c1"),
        "request_id": "req_1",
        "metadata": {"k": "v"},
        "seed": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "tools": None,
        "tool_choice": None,
        "response_format": None,
        "input_user": None,
        "service_tier": "default",
    }
    assert orjson.loads(store.messages("c1", PageQuery())) == {
        "object": "list",
        "data": [
            {
                "id": "c1-0",
                "role": "user",
                "content": "message 0",
                "name": None,
                "content_parts": None,
            }
        ],
        "first_id": "c1-0",
        "last_id": "c1-0",
        "has_more": False,
    }
    assert missing(store, "c2")


def test_the_oldest_goes_first_past_the_count() -> None:
    store = make(count=3)
    for i in range(5):
        store.keep(body(f"c{i}", created=100 - i), request(), "r")  # created: no matter
    assert len(store) == 3
    assert missing(store, "c0")
    assert missing(store, "c1")
    assert ids(store) == ["c4", "c3", "c2"]  # by created


def test_the_oldest_goes_first_past_the_bytes() -> None:
    probe = make()
    probe.keep(body("c0"), request(), "r")
    size = probe.nbytes
    store = make(nbytes=3 * size)
    for i in range(4):
        assert store.keep(body(f"c{i}"), request(), "r")
    assert ids(store) == ["c1", "c2", "c3"]
    assert store.nbytes == 3 * size
    big = body("huge", text="x" * 4 * size)
    assert not store.keep(big, request(), "r")  # larger than the whole budget: not kept
    assert missing(store, "huge")
    assert ids(store) == ["c1", "c2", "c3"]  # and nothing was dropped for it


def test_completions_expire() -> None:
    clock = Clock()
    store = make(clock, ttl=60)
    store.keep(body("c0"), request(), "r")
    clock.now += 30
    store.keep(body("c1"), request(), "r")
    clock.now += 29.9
    assert ids(store) == ["c0", "c1"]
    clock.now += 0.1
    assert missing(store, "c0")
    assert ids(store) == ["c1"]
    clock.now += 30
    assert len(store) == 0
    assert store.nbytes == 0


def test_disabled_stores_keep_nothing() -> None:
    for store in (make(count=0), make(nbytes=0), make(ttl=0)):
        assert not store.enabled
        assert not store.keep(body("c0"), request(), "r")
        assert len(store) == 0
    assert make().enabled
    config = GatewayConfig(store_max_completions=7, store_max_bytes=8, store_ttl=9.0)
    store = CompletionStore.from_config(config)
    assert (store.max_completions, store.max_bytes, store.ttl) == (7, 8, 9.0)


def test_the_list_is_by_creation_then_by_storing() -> None:
    store = make()
    store.keep(body("late", created=200), request(), "r")
    store.keep(body("b", created=100), request(), "r")
    store.keep(body("early", created=50), request(), "r")
    store.keep(body("c", created=100), request(), "r")
    assert ids(store) == ["early", "b", "c", "late"]
    assert ids(store, ("order", "desc")) == ["late", "c", "b", "early"]
    page = listed(store, ("limit", "2"))
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("early", "b", True)
    assert ids(store, ("after", "b")) == ["c", "late"]
    assert ids(store, ("after", "c"), ("order", "desc")) == ["b", "early"]
    assert listed(store, ("after", "late"))["has_more"] is False


def test_filters_by_model_and_metadata() -> None:
    store = make()
    store.keep(body("a", model="m1"), request({"team": "x", "env": "prod"}), "r")
    store.keep(body("b", model="m2"), request({"team": "x"}), "r")
    store.keep(body("c", model="m1"), request(), "r")
    assert ids(store, ("model", "m1")) == ["a", "c"]
    assert ids(store, ("metadata[team]", "x")) == ["a", "b"]
    assert ids(store, ("metadata[team]", "x"), ("metadata[env]", "prod")) == ["a"]
    assert ids(store, ("metadata[team]", "x"), ("model", "m2")) == ["b"]
    assert ids(store, ("model", "none")) == []
    empty = listed(store, ("model", "none"))
    assert (empty["first_id"], empty["last_id"], empty["has_more"]) == (None, None, False)


def test_an_after_that_is_gone_is_a_400() -> None:
    store = make()
    store.keep(body("a"), request(), "r")
    with pytest.raises(ApiError) as info:
        store.list(ListQuery(PageQuery(after="gone")))
    assert (info.value.status, info.value.param) == (400, "after")


def test_updates_replace_the_metadata() -> None:
    store = make()
    store.keep(body("a"), request({"old": "1"}), "req_a")
    before = store.nbytes
    updated = orjson.loads(store.update("a", {"new": "2" * 100}))
    assert updated["metadata"] == {"new": "2" * 100}
    assert orjson.loads(store.get("a")) == updated
    assert updated["request_id"] == "req_a"
    # The stored JSON grew by what the metadata did.
    assert store.nbytes == before + len(orjson.dumps({"new": "2" * 100})) - len(
        orjson.dumps({"old": "1"})
    )
    assert ids(store, ("metadata[new]", "2" * 100)) == ["a"]
    assert ids(store, ("metadata[old]", "1")) == []
    assert orjson.loads(store.update("a", {}))["metadata"] == {}
    with pytest.raises(ApiError) as info:
        store.update("b", {})
    assert info.value.status == 404


def test_a_growing_update_drops_the_others_first() -> None:
    probe = make()
    probe.keep(body("c0"), request(), "r")
    size = probe.nbytes
    store = make(nbytes=2 * size + 100)
    store.keep(body("c0"), request(), "r")
    store.keep(body("c1"), request(), "r")
    store.update("c0", {"k": "v" * 200})  # the oldest, grown past the budget
    assert ids(store) == ["c0"]


def test_deletes() -> None:
    store = make()
    store.keep(body("a"), request(), "r")
    store.keep(body("b"), request(), "r")
    assert orjson.loads(store.delete("a")) == {
        "object": "chat.completion.deleted",
        "id": "a",
        "deleted": True,
    }
    assert missing(store, "a")
    assert ids(store) == ["b"]
    with pytest.raises(ApiError) as info:
        store.delete("a")
    assert info.value.status == 404
    store.delete("b")
    assert store.nbytes == 0


def test_message_pages() -> None:
    store = make()
    store.keep(body("c"), request(messages=5), "r")

    def page(**fields: Any) -> tuple[list[str], bool]:
        data = orjson.loads(store.messages("c", PageQuery(**fields)))
        return [item["id"] for item in data["data"]], data["has_more"]

    assert page() == (["c-0", "c-1", "c-2", "c-3", "c-4"], False)
    assert page(limit=2) == (["c-0", "c-1"], True)
    assert page(limit=2, after="c-1") == (["c-2", "c-3"], True)
    assert page(order="desc", limit=3) == (["c-4", "c-3", "c-2"], True)
    with pytest.raises(ApiError) as info:
        store.messages("nope", PageQuery())
    assert info.value.status == 404


def test_the_schema_documents_the_endpoints() -> None:
    from gateway.app import create_app

    paths = create_app().openapi_schema.to_schema()["paths"]
    listing = paths["/v1/chat/completions"]["get"]
    params = {p["name"]: p for p in listing["parameters"]}
    assert set(params) == {"model", "metadata", "after", "limit", "order"}
    assert (params["limit"]["schema"]["minimum"], params["limit"]["schema"]["maximum"]) == (1, 100)
    assert (params["metadata"]["style"], params["metadata"]["explode"]) == ("deepObject", True)
    assert params["order"]["schema"]["enum"] == ["asc", "desc"]
    one = paths["/v1/chat/completions/{completion_id}"]
    assert set(one) == {"get", "post", "delete"}
    for operation in (*one.values(), paths["/v1/chat/completions/{completion_id}/messages"]["get"]):
        assert {"200", "400", "401", "404"} <= set(operation["responses"])
        assert any(p["name"] == "completion_id" for p in operation["parameters"])
    assert one["post"]["requestBody"]["content"]["application/json"]["schema"]["required"] == [
        "metadata"
    ]
