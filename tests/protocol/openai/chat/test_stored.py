"""Stored chat completions without a server: what a `store: true` request keeps, the stored
object and its messages field by field, the list queries and their 400s, and the pages."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from protocol.browser.messages import chat_request
from protocol.core.errors import ApiError
from protocol.openai.chat.request import ChatRequest, parse_chat_object
from protocol.openai.chat.stored import (
    ListQuery,
    StoreRequest,
    completion_deleted,
    parse_list_query,
    parse_messages_query,
    parse_update,
    stored_completion,
    stored_messages,
)
from protocol.openai.errors import completion_not_found, error_body
from protocol.openai.pages import PageQuery, list_body, page
from protocol.openai.params import parse_metadata
from tests.protocol.bad_input import METADATA_REFUSALS

USER = {"role": "user", "content": "hi"}


def parse(stores: bool = True, **fields: Any) -> ChatRequest:
    """A request with `fields`, parsed by a server that `stores` completions or not."""
    return parse_chat_object({"model": "m", "messages": [USER], **fields}, store=stores)


def refusal(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args, **kwargs)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    return err


# --- the request --------------------------------------------------------------------------


def test_store_is_refused_where_the_server_stores_nothing() -> None:
    err = refusal(parse, stores=False, store=True)
    assert (err.param, err.code) == ("store", "unsupported_value")


def test_store_true_carries_what_is_stored() -> None:
    chat = parse(store=True, metadata={"k": "v"})
    assert chat.store is not None
    assert chat.store.metadata == {"k": "v"}
    assert parse(store=True).store == StoreRequest(
        metadata={},
        messages=({"role": "user", "content": "hi", "name": None, "content_parts": None},),
        settings={
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
        },
    )


@pytest.mark.parametrize("value", [False, None, ...])
def test_no_store_no_record(value: Any) -> None:
    fields = {} if value is ... else {"store": value}
    assert parse(**fields).store is None


def test_metadata_still_needs_store_true() -> None:
    for fields in ({"metadata": {"k": "v"}}, {"metadata": {"k": "v"}, "store": False}):
        err = refusal(parse, **fields)
        assert (err.param, err.code) == ("metadata", "invalid_parameter_combination")


def test_the_browser_socket_stores_where_the_gateway_does() -> None:
    body = {"model": "m", "messages": [USER], "store": True}
    # What it keeps is what the HTTP API's parse keeps of the same request.
    assert chat_request(body, 100, store=True).store == parse(store=True).store
    assert parse(store=True).store is not None
    err = refusal(chat_request, body, 100)
    assert (err.param, err.code) == ("store", "unsupported_value")


def test_messages_as_openai_lists_them() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = parse_chat_object(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief", "name": "boss"},
                {"role": "user", "content": parts},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            ],
            "tools": [tool],
            "tool_choice": "auto",
            "response_format": {"type": "json_object"},
            "seed": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "presence_penalty": 0.1,
            "frequency_penalty": -0.1,
            "user": "u-1",
            "store": True,
        },
        store=True,
    )
    assert chat.store is not None
    assert stored_messages("chatcmpl-x", chat.store) == [
        {
            "id": "chatcmpl-x-0",
            "role": "system",
            "content": "be brief",
            "name": "boss",
            "content_parts": None,
        },
        {
            "id": "chatcmpl-x-1",
            "role": "user",
            "content": "a\nb",
            "name": None,
            "content_parts": parts,
        },
        {
            "id": "chatcmpl-x-2",
            "role": "assistant",
            "content": None,
            "name": None,
            "content_parts": None,
            "tool_calls": [call],
        },
        {
            "id": "chatcmpl-x-3",
            "role": "tool",
            "content": "42",
            "name": None,
            "content_parts": None,
            "tool_call_id": "call_1",
        },
    ]
    assert chat.store.settings == {
        "seed": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "presence_penalty": 0.1,
        "frequency_penalty": -0.1,
        "tools": [tool],
        "tool_choice": "auto",
        "response_format": {"type": "json_object"},
        "input_user": "u-1",
        "service_tier": "default",
    }


def test_the_stored_object_is_the_answer_plus_the_request() -> None:
    chat = parse(store=True, seed=3)
    assert chat.store is not None
    body = {"id": "chatcmpl-x", "object": "chat.completion", "created": 5, "choices": []}
    assert stored_completion(body, chat.store, "req_1", {"a": "b"}) == {
        **body,
        "request_id": "req_1",
        "metadata": {"a": "b"},
        "seed": 3,
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


def test_deleted_and_not_found_objects() -> None:
    assert completion_deleted("c1") == {
        "object": "chat.completion.deleted",
        "id": "c1",
        "deleted": True,
    }
    err = completion_not_found("c1")
    assert err.status == 404
    assert error_body(err) == {
        "error": {
            "message": "No chat completion found with id 'c1'.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert len(completion_not_found("x" * 10_000).message) < 200


# --- metadata -----------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "param", "code"), METADATA_REFUSALS)
def test_metadata_refusals(value: Any, param: str, code: str) -> None:
    err = refusal(parse_metadata, value)
    assert (err.param, err.code) == (param, code)


def test_metadata_at_its_bounds() -> None:
    most = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert parse_metadata(most) == most
    assert parse_metadata(None) is None


# --- queries ------------------------------------------------------------------------------


def test_list_query_defaults_and_fields() -> None:
    assert parse_list_query([]) == ListQuery(PageQuery(None, 20, "asc"), None, {})
    assert parse_list_query(
        [
            ("model", "m"),
            ("metadata[a]", "1"),
            ("metadata[b c]", ""),
            ("after", "chatcmpl-1"),
            ("limit", "100"),
            ("order", "desc"),
        ]
    ) == ListQuery(PageQuery("chatcmpl-1", 100, "desc"), "m", {"a": "1", "b c": ""})
    assert parse_messages_query([("limit", "1"), ("order", "asc")]) == PageQuery(None, 1, "asc")


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ([("limit", "0")], "limit", "integer_below_min_value"),
        ([("limit", "101")], "limit", "integer_above_max_value"),
        ([("limit", "ten")], "limit", "invalid_type"),
        ([("limit", "")], "limit", "invalid_type"),
        ([("limit", "-1")], "limit", "integer_below_min_value"),
        ([("limit", "--1")], "limit", "invalid_type"),
        ([("limit", "1.5")], "limit", "invalid_type"),
        ([("limit", "9" * 400)], "limit", "invalid_type"),
        ([("order", "up")], "order", "invalid_value"),
        ([("sort", "asc")], "sort", "unknown_parameter"),
        ([("limit", "1"), ("limit", "2")], "limit", "invalid_value"),
        ([("metadata", "x")], "metadata", "invalid_type"),
        ([("metadata[]", "x")], "metadata", "invalid_type"),
        ([("metadata[a", "x")], "metadata", "invalid_type"),
        ([("metadata[a]", "1"), ("metadata[a]", "2")], "metadata[a]", "invalid_value"),
    ],
)
def test_list_query_refusals(params: list[tuple[str, str]], param: str, code: str) -> None:
    err = refusal(parse_list_query, params)
    assert (err.param, err.code) == (param, code)
    assert param.split("[", maxsplit=1)[0] in err.message


@pytest.mark.parametrize("name", ["model", "metadata[a]"])
def test_messages_are_not_filtered(name: str) -> None:
    err = refusal(parse_messages_query, [(name, "x")])
    assert (err.param, err.code) == (name, "unknown_parameter")


def test_filters() -> None:
    query = parse_list_query([("model", "m"), ("metadata[a]", "1"), ("metadata[b]", "2")])
    assert query.matches("m", {"a": "1", "b": "2", "c": "3"})
    assert not query.matches("other", {"a": "1", "b": "2"})
    assert not query.matches("m", {"a": "1"})
    assert not query.matches("m", {"a": "1", "b": "3"})
    assert ListQuery().matches("anything", {})


# --- updates ------------------------------------------------------------------------------


def test_update_bodies() -> None:
    assert parse_update(b'{"metadata": {"a": "b"}}') == {"a": "b"}
    assert parse_update(b'{"metadata": null}') == {}
    assert parse_update(b'{"metadata": {}}') == {}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{", None, "invalid_json"),
        (b"[]", None, "invalid_type"),
        (b"{}", "metadata", "missing_required_parameter"),
        (b'{"metadata": {}, "store": true}', "store", "unknown_parameter"),
        (b'{"metadata": "x"}', "metadata", "invalid_type"),
        (orjson.dumps({"metadata": {str(i): "" for i in range(17)}}), "metadata", None),
    ],
)
def test_update_refusals(body: bytes, param: str | None, code: str | None) -> None:
    err = refusal(parse_update, body)
    assert err.param == param
    if code is not None:
        assert err.code == code


# --- pages --------------------------------------------------------------------------------

IDS = ["a", "b", "c", "d", "e"]


def ids_of(query: PageQuery) -> tuple[list[str], bool]:
    return page(IDS, query, str, "item")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (PageQuery(), (IDS, False)),
        (PageQuery(limit=5), (IDS, False)),
        (PageQuery(limit=2), (["a", "b"], True)),
        (PageQuery(after="b", limit=2), (["c", "d"], True)),
        (PageQuery(after="c", limit=2), (["d", "e"], False)),
        (PageQuery(after="e"), ([], False)),
        (PageQuery(order="desc", limit=2), (["e", "d"], True)),
        (PageQuery(order="desc", after="d"), (["c", "b", "a"], False)),
        (PageQuery(order="desc", after="a"), ([], False)),
    ],
)
def test_pages(query: PageQuery, expected: tuple[list[str], bool]) -> None:
    assert ids_of(query) == expected


def test_walking_every_page_visits_each_item_once() -> None:
    for order in ("asc", "desc"):
        seen: list[str] = []
        after = None
        while True:
            chosen, more = page(IDS, PageQuery(after=after, limit=2, order=order), str, "item")
            seen += chosen
            if not more:
                break
            after = chosen[-1]
        assert seen == (IDS if order == "asc" else IDS[::-1])


def test_an_unknown_after_is_a_400() -> None:
    err = refusal(ids_of, PageQuery(after="zz"))
    assert (err.param, err.code) == ("after", "invalid_value")
    assert "'zz'" in err.message


def test_list_bodies() -> None:
    assert orjson.loads(list_body([b'{"id":"a"}', b'{"id":"b"}'], ["a", "b"], True)) == {
        "object": "list",
        "data": [{"id": "a"}, {"id": "b"}],
        "first_id": "a",
        "last_id": "b",
        "has_more": True,
    }
    assert orjson.loads(list_body([], [], False)) == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
