"""Stored chat completions end to end: a gateway process, a scripted runner process, and the
official `openai` SDK storing (`store=True`, streamed and not, and over the browser socket),
then retrieving, listing, updating, deleting and listing the messages, field by field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from websockets.asyncio.client import connect

from tests.support import UNIT, Gateway, Process, start_runner, wait_until

MODEL = "scripted-m"
OTHER_MODEL = "scripted-other"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief.", "name": "boss"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
    },
]

pytestmark = pytest.mark.timeout(int(120 * UNIT))


def text(n: int) -> str:
    """The scripted engine's answer of n tokens."""
    return "".join(f"tok{i} " for i in range(n))


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway()
    runners: list[Process] = []
    try:
        for model, rate in ((MODEL, "0"), (OTHER_MODEL, "50")):
            runners.append(
                start_runner(
                    gw,
                    *("--engine", "scripted", "--model", model),
                    *("--tokens-per-second", rate),
                    name=model,
                )
            )
        gw.wait_for_runners(2)
        yield gw
    finally:
        for runner in runners:
            runner.stop()
        gw.stop()


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0) as c:
        yield c


def create(client: openai.OpenAI, **extra: Any) -> ChatCompletion:
    answer: ChatCompletion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, store=True, **extra
    )
    return answer


def dump(obj: Any) -> dict[str, Any]:
    result: dict[str, Any] = obj.model_dump(mode="json", exclude_unset=True)
    return result


def test_a_stored_completion_is_the_answer(client: openai.OpenAI) -> None:
    answer = create(client, metadata={"topic": "greeting", "user": "u1"})
    assert answer._request_id is not None
    assert answer._request_id.startswith("req_")
    stored = client.chat.completions.retrieve(answer.id)
    # The answer, field by field, plus what OpenAI's stored objects add.
    assert dump(stored) == {
        **dump(answer),
        "request_id": answer._request_id,
        "metadata": {"topic": "greeting", "user": "u1"},
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
    assert stored.choices[0].message.content == text(4)
    assert stored.choices[0].finish_reason == "length"


def test_a_streamed_completion_is_stored_as_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        store=True,
        stream=True,
        stream_options={"include_usage": True},
        seed=42,
        temperature=0.5,
        user="someone",
    )
    chunks = list(stream)
    first, last = chunks[0], chunks[-1]
    stored = client.chat.completions.retrieve(first.id)
    assert stored.id == first.id
    assert stored.object == "chat.completion"
    assert stored.created == first.created
    assert stored.model == MODEL
    assert stored.system_fingerprint == first.system_fingerprint
    assert stored.metadata == {}
    assert len(stored.choices) == 1
    choice = stored.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices
    )
    assert choice.message.content == text(5)
    assert choice.message.refusal is None
    assert choice.message.tool_calls is None
    assert choice.logprobs is None
    assert choice.finish_reason == "length"
    assert stored.usage == last.usage
    extra = stored.model_extra
    assert extra is not None
    assert extra["request_id"] == stream.response.headers["x-request-id"]
    assert (extra["seed"], extra["temperature"], extra["input_user"]) == (42, 0.5, "someone")


def test_the_messages_of_a_stored_completion(client: openai.OpenAI) -> None:
    answer = create(client)
    page = client.chat.completions.messages.list(answer.id)
    assert [dump(m) for m in page.data] == [
        {
            "id": f"{answer.id}-0",
            "role": "system",
            "content": "Be brief.",
            "name": "boss",
            "content_parts": None,
        },
        {
            "id": f"{answer.id}-1",
            "role": "user",
            "content": "Hi\nthere",
            "name": None,
            "content_parts": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
    ]
    assert page.has_more is False
    desc = client.chat.completions.messages.list(answer.id, order="desc", limit=1)
    assert [m.id for m in desc.data] == [f"{answer.id}-1"]
    assert desc.has_more is True
    assert [m.id for m in desc] == [f"{answer.id}-1", f"{answer.id}-0"]  # auto-paging


def test_list_filter_and_page(client: openai.OpenAI) -> None:
    tag = {"run": "test_list_filter_and_page"}
    made = [
        create(client, metadata={**tag, "n": str(i), "parity": "even" if i % 2 == 0 else "odd"})
        for i in range(5)
    ]
    other = client.chat.completions.create(
        model=OTHER_MODEL, messages=MESSAGES, max_tokens=1, store=True, metadata=tag
    )
    ids = [c.id for c in made]

    listed = client.chat.completions.list(metadata=tag, model=MODEL)
    assert [c.id for c in listed.data] == ids
    assert listed.has_more is False
    first = client.chat.completions.retrieve(ids[0])
    assert dump(listed.data[0]) == dump(first)

    page = client.chat.completions.list(metadata=tag, model=MODEL, limit=2)
    assert [c.id for c in page.data] == ids[:2]
    assert page.has_more is True
    raw = client.chat.completions.with_raw_response.list(metadata=tag, limit=2, after=ids[1])
    body = orjson.loads(raw.content)
    assert [c["id"] for c in body["data"]] == ids[2:4]
    assert (body["object"], body["first_id"], body["last_id"]) == ("list", ids[2], ids[3])
    assert body["has_more"] is True

    everything = client.chat.completions.list(metadata=tag, limit=2)
    assert [c.id for c in everything] == [*ids, other.id]  # the SDK follows `after`
    newest = client.chat.completions.list(metadata=tag, order="desc", limit=3)
    assert [c.id for c in newest.data] == [other.id, *ids[::-1][:2]]
    assert [c.id for c in client.chat.completions.list(model=OTHER_MODEL, metadata=tag)] == [
        other.id
    ]
    even = client.chat.completions.list(metadata={**tag, "parity": "even"})
    assert [c.id for c in even] == ids[::2]
    assert list(client.chat.completions.list(metadata={"run": "nothing"})) == []


def test_update_and_delete(client: openai.OpenAI) -> None:
    answer = create(client, metadata={"a": "1"})
    updated = client.chat.completions.update(answer.id, metadata={"b": "2"})
    assert updated.metadata == {"b": "2"}
    assert dump(client.chat.completions.retrieve(answer.id)) == dump(updated)
    assert [c.id for c in client.chat.completions.list(metadata={"b": "2"})] == [answer.id]

    deleted = client.chat.completions.delete(answer.id)
    assert dump(deleted) == {"object": "chat.completion.deleted", "id": answer.id, "deleted": True}
    for call in (
        lambda: client.chat.completions.retrieve(answer.id),
        lambda: client.chat.completions.update(answer.id, metadata={}),
        lambda: client.chat.completions.delete(answer.id),
        lambda: client.chat.completions.messages.list(answer.id),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body == {
            "message": f"No chat completion found with id '{answer.id}'.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }


def active(gateway: Gateway, runner: str) -> int:
    (info,) = [r for r in gateway.runners() if r["name"] == runner]
    return int(info["active"])


def test_what_is_not_stored(gateway: Gateway, client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(plain.id)

    # A stream its client leaves before the end: cancelled, so not stored.
    stream = client.chat.completions.create(
        model=OTHER_MODEL,
        messages=MESSAGES,
        max_tokens=500,
        store=True,
        stream=True,
        metadata={"run": "left"},
    )
    completion_id = next(iter(stream)).id
    stream.close()
    # Once the request is over on its runner (it would be stored then, if at all).
    wait_until(lambda: active(gateway, OTHER_MODEL) == 0, 10, "the stream to be cancelled")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(completion_id)
    assert list(client.chat.completions.list(metadata={"run": "left"})) == []


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ({"limit": 101}, "limit", "integer_above_max_value"),
        ({"limit": 0}, "limit", "integer_below_min_value"),
        ({"order": "sideways"}, "order", "invalid_value"),
        ({"after": "chatcmpl-gone"}, "after", "invalid_value"),
    ],
)
def test_bad_list_queries(
    client: openai.OpenAI, params: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.list(**params)
    assert isinstance(info.value.body, dict)
    assert (info.value.body["param"], info.value.body["code"]) == (param, code)


def test_bad_requests_over_http(gateway: Gateway, client: openai.OpenAI) -> None:
    answer = create(client)
    with httpx.Client(base_url=f"{gateway.base}/v1") as http:
        cases = [
            http.get("/chat/completions", params={"sort": "asc"}),
            http.get(f"/chat/completions/{answer.id}/messages", params={"model": MODEL}),
            http.post(f"/chat/completions/{answer.id}", json={"metadata": {"k": 1}}),
            http.post(f"/chat/completions/{answer.id}", json={}),
            http.post(f"/chat/completions/{answer.id}", content=b"{"),
        ]
    assert [
        (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) for r in cases
    ] == [
        (400, "sort", "unknown_parameter"),
        (400, "model", "unknown_parameter"),
        (400, "metadata.k", "invalid_type"),
        (400, "metadata", "missing_required_parameter"),
        (400, None, "invalid_json"),
    ]


async def test_the_browser_socket_stores_too(gateway: Gateway, client: openai.OpenAI) -> None:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "store": True}
        await ws.send(
            orjson.dumps({"type": "chat.completions.create", "request_id": "r1", "body": body}),
            text=True,
        )
        chunks = []
        while True:
            message = orjson.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT))
            if message["type"] == "done":
                break
            assert message["type"] == "chunk", message
            chunks.append(message["chunk"])
    stored = await asyncio.to_thread(client.chat.completions.retrieve, chunks[0]["id"])
    assert stored.created == chunks[0]["created"]
    assert stored.system_fingerprint == chunks[0]["system_fingerprint"]
    assert stored.choices[0].message.content == text(3)
    assert stored.choices[0].finish_reason == "length"
    assert stored.model_extra is not None
    assert stored.model_extra["request_id"].startswith("req_")
    messages = await asyncio.to_thread(client.chat.completions.messages.list, stored.id)
    assert [m.role for m in messages.data] == ["system", "user"]


# --- a gateway with keys, and one that stores nothing ------------------------------------------


@pytest.fixture(scope="module")
def locked() -> Iterator[Gateway]:
    gw = Gateway("--api-key", "sesame", "--store-max-completions", "0")
    runner = start_runner(gw, "--engine", "scripted", "--model", MODEL)
    try:
        wait_until(
            lambda: httpx.get(f"{gw.base}/health", timeout=5 * UNIT).json()["runners"] == 1,
            60,
            "the runner",
        )
        yield gw
    finally:
        runner.stop()
        gw.stop()


def test_the_endpoints_need_the_key(locked: Gateway) -> None:
    with openai.OpenAI(base_url=f"{locked.base}/v1", api_key="wrong", max_retries=0) as c:
        for call in (
            c.chat.completions.list,
            lambda: c.chat.completions.retrieve("chatcmpl-x"),
            lambda: c.chat.completions.update("chatcmpl-x", metadata={}),
            lambda: c.chat.completions.delete("chatcmpl-x"),
            lambda: c.chat.completions.messages.list("chatcmpl-x"),
        ):
            with pytest.raises(openai.AuthenticationError):
                call()


def test_a_gateway_that_stores_nothing_refuses_store(locked: Gateway) -> None:
    with openai.OpenAI(base_url=f"{locked.base}/v1", api_key="sesame", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, store=True)
        assert isinstance(info.value.body, dict)
        assert (info.value.body["param"], info.value.body["code"]) == ("store", "unsupported_value")
        assert c.chat.completions.list().data == []
