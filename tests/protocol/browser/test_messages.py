"""The browser socket's messages: the exact wire format, round trips, strict decoding, and the
steps the gateway reads a client message with."""

from __future__ import annotations

from typing import Any, get_args

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

from protocol.browser.messages import (
    CLIENT_TYPES,
    CLIENT_WS_PATH,
    GATEWAY_TYPES,
    TAGS,
    Auth,
    AuthOk,
    BrowserMessage,
    CancelRequest,
    ChunkMessage,
    ClientMessage,
    Create,
    Done,
    ErrorMessage,
    GatewayMessage,
    Ping,
    Pong,
    PoolState,
    PoolSubscribe,
    chat_request,
    decode_client_message,
    decode_gateway_message,
    encode,
    request_id_of,
    structure,
)
from protocol.core.errors import ApiError
from protocol.errors import FrameError
from protocol.openai.chat.request import parse_chat_object
from protocol.openai.errors import error_body
from tests.protocol.strategies import (
    finish_reasons,
    hostile_bytes,
    ints,
    json_values,
    mutations,
    text,
)

MESSAGE = {"role": "user", "content": "hi"}
BODY: dict[str, Any] = {"model": "m", "messages": [MESSAGE]}

json_objects = st.dictionaries(text, json_values, max_size=4)
MESSAGE_STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    Create: st.builds(Create, request_id=text, body=json_values),
    CancelRequest: st.builds(CancelRequest, request_id=text),
    Ping: st.just(Ping()),
    PoolSubscribe: st.just(PoolSubscribe()),
    Auth: st.builds(Auth, api_key=text),
    ChunkMessage: st.builds(ChunkMessage, request_id=text, chunk=json_objects),
    Done: st.builds(Done, request_id=text, finish_reason=finish_reasons, usage=json_objects),
    ErrorMessage: st.builds(ErrorMessage, request_id=st.none() | text, error=json_objects),
    Pong: st.just(Pong()),
    AuthOk: st.just(AuthOk()),
    PoolState: st.builds(
        PoolState,
        runners=st.lists(json_objects, max_size=3),
        requests_in_flight=ints,
        queue_depth=ints,
        models=st.lists(text, max_size=3),
        history=st.none() | json_objects,
    ),
}


def test_unions_and_tags() -> None:
    assert CLIENT_WS_PATH == "/v1/ws"
    assert set(get_args(ClientMessage)) == {Create, CancelRequest, Ping, PoolSubscribe, Auth}
    assert set(get_args(GatewayMessage)) == {
        ChunkMessage,
        Done,
        ErrorMessage,
        Pong,
        AuthOk,
        PoolState,
    }
    assert dict(TAGS) == {
        Create: "chat.completions.create",
        CancelRequest: "cancel",
        Ping: "ping",
        PoolSubscribe: "pool.subscribe",
        Auth: "auth",
        ChunkMessage: "chunk",
        Done: "done",
        ErrorMessage: "error",
        Pong: "pong",
        AuthOk: "auth.ok",
        PoolState: "pool.state",
    }
    assert {TAGS[cls]: cls for cls in get_args(ClientMessage)} == CLIENT_TYPES
    assert {TAGS[cls]: cls for cls in get_args(GatewayMessage)} == GATEWAY_TYPES
    assert set(MESSAGE_STRATEGIES) == set(TAGS)


# The wire format: `type` first, then the fields in order (as docs/websocket-api.md shows).

USAGE = {
    "prompt_tokens": 15,
    "completion_tokens": 3,
    "total_tokens": 18,
    "prompt_tokens_details": {"cached_tokens": 5},
    "completion_tokens_details": {"reasoning_tokens": 0},
}
WIRE_EXAMPLES: list[tuple[BrowserMessage, bytes]] = [
    (
        Create("r1", BODY),
        b'{"type":"chat.completions.create","request_id":"r1","body":{"model":"m",'
        b'"messages":[{"role":"user","content":"hi"}]}}',
    ),
    (CancelRequest("r2"), b'{"type":"cancel","request_id":"r2"}'),
    (Ping(), b'{"type":"ping"}'),
    (PoolSubscribe(), b'{"type":"pool.subscribe"}'),
    (Auth("sk-1"), b'{"type":"auth","api_key":"sk-1"}'),
    (
        ChunkMessage("r1", {"id": "chatcmpl-1", "choices": []}),
        b'{"type":"chunk","request_id":"r1","chunk":{"id":"chatcmpl-1","choices":[]}}',
    ),
    (
        Done("r1", "length", USAGE),
        b'{"type":"done","request_id":"r1","finish_reason":"length","usage":'
        + orjson.dumps(USAGE)
        + b"}",
    ),
    (
        ErrorMessage(None, {"message": "m", "type": "t", "param": None, "code": "c"}),
        b'{"type":"error","request_id":null,"error":'
        b'{"message":"m","type":"t","param":null,"code":"c"}}',
    ),
    (Pong(), b'{"type":"pong"}'),
    (AuthOk(), b'{"type":"auth.ok"}'),
    (
        PoolState([{"id": "runner-1"}], 2, 0, ["a", "b"]),
        b'{"type":"pool.state","runners":[{"id":"runner-1"}],"requests_in_flight":2,'
        b'"queue_depth":0,"models":["a","b"],"history":null}',
    ),
    (
        PoolState([], 0, 0, [], {"bucket_seconds": 5.0, "runners": {}, "models": {}}),
        b'{"type":"pool.state","runners":[],"requests_in_flight":0,"queue_depth":0,'
        b'"models":[],"history":{"bucket_seconds":5.0,"runners":{},"models":{}}}',
    ),
]


@pytest.mark.parametrize(("message", "wire"), WIRE_EXAMPLES, ids=lambda v: str(v)[:30])
def test_wire_format(message: BrowserMessage, wire: bytes) -> None:
    assert encode(message) == wire
    decoder = decode_client_message if type(message) in CLIENT_TYPES.values() else None
    decoded = (decoder or decode_gateway_message)(wire)
    assert decoded == message
    assert type(decoded) is type(message)


def test_every_type_has_a_wire_example() -> None:
    assert {type(message) for message, _ in WIRE_EXAMPLES} == set(TAGS)


def test_encode_refuses_what_json_cannot_carry() -> None:
    with pytest.raises(FrameError, match="cannot encode PoolState"):
        encode(PoolState([], 2**64, 0, []))


@pytest.mark.parametrize("cls", list(MESSAGE_STRATEGIES), ids=lambda cls: TAGS[cls])
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[cls])
    wire = encode(message)
    assert wire.startswith(b'{"type":' + orjson.dumps(TAGS[cls]))
    client = cls in CLIENT_TYPES.values()
    decoder = decode_client_message if client else decode_gateway_message
    assert decoder(wire) == message
    assert decoder(wire.decode()) == message
    # The other side's decoder does not take it.
    with pytest.raises(FrameError, match="unknown message type"):
        (decode_gateway_message if client else decode_client_message)(wire)


# Strict decoding.

BAD_MESSAGES = [
    (b"{nope", "not valid JSON"),
    (b"[]", "a message must be a JSON object, got list"),
    (b'{"type": 1}', "a message needs a string 'type' field"),
    (b'{"type": "teleport"}', "unknown message type 'teleport'"),
    (b'{"type": "pong", "x": 1}', r"invalid pong message: extra fields found \(x\) @ pong"),
    (b'{"type": "error", "request_id": 5, "error": {}}', r"@ error\.request_id"),
    (b'{"type": "error", "request_id": null, "error": []}', r"@ error\.error"),
    (b'{"type": "error", "request_id": null}', r"required field missing @ error\.error"),
    (b'{"type": "chunk", "request_id": "r", "chunk": "x"}', r"@ chunk\.chunk"),
    (
        b'{"type": "done", "request_id": "r", "finish_reason": "tired", "usage": {}}',
        r"@ done\.finish_reason",
    ),
    (
        b'{"type": "pool.state", "runners": [], "requests_in_flight": true, "queue_depth": 0,'
        b' "models": []}',
        r"@ pool\.state\.requests_in_flight",
    ),
    (
        # A string is not read as the list of its characters.
        b'{"type": "pool.state", "runners": [], "requests_in_flight": 0, "queue_depth": 0,'
        b' "models": "ab"}',
        r"expected list @ pool\.state\.models",
    ),
    (
        b'{"type": "pool.state", "runners": [{}, 1], "requests_in_flight": 0, "queue_depth": 0,'
        b' "models": []}',
        r"@ pool\.state\.runners\[1\]",
    ),
]


@pytest.mark.parametrize(("wire", "match"), BAD_MESSAGES)
def test_strict_gateway_decoding(wire: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_gateway_message(wire)


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b'{"type": "cancel", "request_id": 1}', r"@ cancel\.request_id"),
        (b'{"type": "auth", "api_key": 12}', r"expected str @ auth\.api_key"),
        (b'{"type": "ping", "request_id": "r"}', r"extra fields found \(request_id\) @ ping"),
        (b'{"type": "chunk", "request_id": "r", "chunk": {}}', "unknown message type 'chunk'"),
    ],
)
def test_strict_client_decoding(wire: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_client_message(wire)


any_message = st.one_of(*MESSAGE_STRATEGIES.values())


@st.composite
def mutated_messages(draw: st.DrawFn) -> bytes:
    """A valid message of either direction with one value replaced, one key dropped or one
    key added: mostly refused, sometimes another valid message."""
    return orjson.dumps(draw(mutations(orjson.loads(encode(draw(any_message))))))


# Valid messages too: each decoder must refuse the other direction's.
@given(
    data=hostile_bytes()
    | json_values.map(orjson.dumps)
    | mutated_messages()
    | any_message.map(encode)
)
def test_hostile_input_raises_only_frame_error(data: bytes) -> None:
    for decoder, types in (
        (decode_client_message, CLIENT_TYPES),
        (decode_gateway_message, GATEWAY_TYPES),
    ):
        try:
            message = decoder(data)
        except FrameError:
            continue
        # Whatever decodes is a message of the decoder's direction, and round-trips.
        assert type(message) in types.values()
        assert decoder(encode(message)) == message


# The gateway's steps.


def _error(err: ApiError) -> dict[str, Any]:
    assert err.status == 400
    body: dict[str, Any] = error_body(err)["error"]
    return body


@pytest.mark.parametrize("rid", ["r", "x" * 256, "日本語", " "])
def test_request_id_of(rid: str) -> None:
    assert request_id_of({"type": "cancel", "request_id": rid}) == rid


@pytest.mark.parametrize(
    "obj",
    [
        {},
        {"request_id": None},
        {"request_id": 1},
        {"request_id": ""},
        {"request_id": "x" * 257},
        {"request_id": ["r"]},
    ],
)
def test_request_id_of_refuses(obj: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as caught:
        request_id_of(obj)
    assert _error(caught.value) == {
        "message": "'request_id' must be a string of 1 to 256 characters.",
        "type": "invalid_request_error",
        "param": "request_id",
        "code": "invalid_request_id",
    }


def test_structure() -> None:
    assert structure({"type": "ping"}, Ping) == Ping()
    assert structure({"type": "cancel", "request_id": "r"}, CancelRequest) == CancelRequest("r")
    assert structure({"type": "auth", "api_key": "k"}, Auth) == Auth("k")
    create = {"type": "chat.completions.create", "request_id": "r", "body": [1]}
    assert structure(create, Create) == Create("r", [1])
    # No body: None, which the body validation refuses like any other bad body.
    assert structure({"type": "chat.completions.create", "request_id": "r"}, Create) == Create("r")


@pytest.mark.parametrize(
    ("obj", "cls", "names"),
    [
        ({"type": "ping", "zeta": 1, "alpha": 2}, Ping, "alpha, zeta"),
        ({"type": "pool.subscribe", "request_id": "r"}, PoolSubscribe, "request_id"),
        ({"type": "cancel", "request_id": "r", "body": {}}, CancelRequest, "body"),
        ({"type": "chat.completions.create", "request_id": "r", "b": 1, "a": 1}, Create, "a, b"),
        # Unknown fields are named before a field of the wrong type is looked at.
        ({"type": "auth", "api_key": 12, "x": None}, Auth, "x"),
    ],
)
def test_structure_refuses_unknown_fields(obj: dict[str, Any], cls: type, names: str) -> None:
    with pytest.raises(ApiError) as caught:
        structure(obj, cls)
    assert _error(caught.value) == {
        "message": f"Unknown field(s) in message: {names}.",
        "type": "invalid_request_error",
        "param": None,
        "code": "unknown_parameter",
    }


@pytest.mark.parametrize("obj", [{"type": "auth"}, {"type": "auth", "api_key": 12}])
def test_structure_refuses_a_bad_field_with_its_path(obj: dict[str, Any]) -> None:
    with pytest.raises(FrameError, match=r"invalid auth message: .* @ auth\.api_key"):
        structure(obj, Auth)


def test_chat_request_streams_by_default() -> None:
    chat = chat_request(BODY, 100)
    assert chat == parse_chat_object({**BODY, "stream": True})
    assert chat.stream
    assert chat_request({**BODY, "stream": True}, 100) == chat
    assert BODY == {"model": "m", "messages": [MESSAGE]}  # the caller's body is left alone


def test_chat_request_keeps_stream_options() -> None:
    chat = chat_request({**BODY, "stream_options": {"include_usage": True}}, 100)
    assert chat.include_usage


def test_chat_request_refuses_stream_false() -> None:
    with pytest.raises(ApiError) as caught:
        chat_request({**BODY, "stream": False}, 100)
    assert _error(caught.value) == {
        "message": "The WebSocket API always streams; 'stream' must be true or omitted.",
        "type": "invalid_request_error",
        "param": "stream",
        "code": None,
    }


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (None, None, "invalid_type"),
        ([BODY], None, "invalid_type"),
        ({**BODY, "max_tokens": 101}, "max_tokens", "integer_above_max_value"),
        # The body is validated before the ceiling, and both before the streaming rule.
        ({**BODY, "max_tokens": 101, "temperature": 9}, "temperature", "decimal_above_max_value"),
        ({**BODY, "stream": False, "max_tokens": 101}, "max_tokens", "integer_above_max_value"),
        ({**BODY, "stream": False, "temperature": 9}, "temperature", "decimal_above_max_value"),
    ],
)
def test_chat_request_order_of_refusals(body: Any, param: str | None, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request(body, 100)
    assert (caught.value.param, caught.value.code) == (param, code)


def test_chat_request_body_error_is_the_http_apis() -> None:
    with pytest.raises(ApiError) as caught:
        chat_request(None, 100)
    assert caught.value.message == (
        "Invalid type for the request body: expected an object, but got null instead."
    )


def test_create_obeys_the_gateways_choice_limit() -> None:
    assert chat_request({**BODY, "n": 3}, 100, max_choices=3).n == 3
    with pytest.raises(ApiError) as info:
        chat_request({**BODY, "n": 4}, 100, max_choices=3)
    assert (info.value.param, info.value.code) == ("n", "integer_above_max_value")
