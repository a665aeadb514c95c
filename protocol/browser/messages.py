"""The messages of the browser WebSocket API (`/v1/ws`, docs/websocket-api.md).

Each message is a frozen attrs class; on the wire it is a JSON object in a text frame whose
`type` field names the class (`TAGS`), written first:

    client  → gateway   Create          `chat.completions.create`: request_id, body
                        CancelRequest   `cancel`: request_id
                        Ping            `ping`
                        PoolSubscribe   `pool.subscribe`
                        Auth            `auth`: api_key (first message, with API keys only)
    gateway → client    ChunkMessage    `chunk`: request_id, chunk (a chat.completion.chunk)
                        Done            `done`: request_id, finish_reason, usage
                        ErrorMessage    `error`: request_id (null: about a message), error
                        Pong            `pong`
                        AuthOk          `auth.ok`
                        PoolState       `pool.state`: runners, requests_in_flight, ...

One strict converter (`protocol.strict`) reads and writes them all. The gateway reads client
messages in steps (`protocol.client_socket.load`, `request_id_of`, `structure`,
`chat_request`) because the API's errors depend on the socket's state in between (a
duplicate id is refused before a create's other fields are looked at);
`protocol.browser.session` runs the steps. `decode_*` read a whole message strictly, for
clients and tests.
"""

from __future__ import annotations

from typing import Any, TypeVar, get_args

import attrs
import cattrs
import orjson
from cattrs.strategies import configure_tagged_union

from protocol.browser import errors
from protocol.client_socket import unknown_fields
from protocol.errors import FrameError
from protocol.frames import FinishReason
from protocol.openai.chat.request import (
    ChatRequest,
    parse_chat_object,
)
from protocol.openai.params import MAX_N
from protocol.strict import make_strict_converter

CLIENT_WS_PATH = "/v1/ws"
"""Where on the gateway browsers open their WebSocket."""


@attrs.frozen
class Create:
    """Start a chat completion; every message about it carries `request_id`."""

    request_id: str
    body: Any = None
    """A `POST /v1/chat/completions` body, validated by `chat_request`. A missing body is
    None here, so that it is refused by the body validation like any other bad body."""


@attrs.frozen
class CancelRequest:
    """Stop a request (ignored if it already ended: cancel and done cross on the wire)."""

    request_id: str


@attrs.frozen
class Ping:
    """Answered by Pong, in order."""


@attrs.frozen
class PoolSubscribe:
    """Start this socket's PoolState messages (again: nothing changes)."""


@attrs.frozen
class Auth:
    """The API key, as the first message of a socket that sent no `Authorization` header."""

    api_key: str


@attrs.frozen
class ChunkMessage:
    """One `chat.completion.chunk` of a request, as the HTTP API streams it."""

    request_id: str
    chunk: dict[str, Any]


@attrs.frozen
class Done:
    """A request's last message when it did not fail; `usage` is OpenAI's usage object."""

    request_id: str
    finish_reason: FinishReason
    usage: dict[str, Any]


@attrs.frozen
class ErrorMessage:
    """An error: with a request_id it ends that request; with None it is about a message."""

    request_id: str | None
    error: dict[str, Any]
    """OpenAI's error object: message, type, param, code."""


@attrs.frozen
class Pong:
    """The answer to Ping."""


@attrs.frozen
class AuthOk:
    """The Auth key was right."""


@attrs.frozen
class PoolState:
    """The live pool view, about every second after PoolSubscribe."""

    runners: list[dict[str, Any]]
    requests_in_flight: int
    queue_depth: int
    models: list[str]
    history: dict[str, Any] | None = None
    """The last minutes per runner and per model (tokens per second, TTFT p50 / p99), in
    buckets: `gateway.observability.history.PoolHistory.view`."""


ClientMessage = Create | CancelRequest | Ping | PoolSubscribe | Auth
"""Messages a browser sends."""

GatewayMessage = ChunkMessage | Done | ErrorMessage | Pong | AuthOk | PoolState
"""Messages the gateway sends."""

BrowserMessage = ClientMessage | GatewayMessage

TAGS: dict[type, str] = {
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
"""The `type` value of each message on the wire."""

CLIENT_TYPES: dict[str, type[ClientMessage]] = {TAGS[cls]: cls for cls in get_args(ClientMessage)}
GATEWAY_TYPES: dict[str, type[GatewayMessage]] = {
    TAGS[cls]: cls for cls in get_args(GatewayMessage)
}

_FIELDS: dict[type, frozenset[str]] = {
    cls: frozenset(("type", *(field.name for field in attrs.fields(cls)))) for cls in TAGS
}
"""The keys each message may have."""


def _make_converter() -> cattrs.Converter:
    conv = make_strict_converter()

    def unstructure_type_first(message: Any) -> dict[str, Any]:
        # The strategy appends `type`; the wire has it first (docs/websocket-api.md), and
        # `protocol.browser.framing` builds the same bytes from precomputed prefixes.
        cls = message.__class__
        return {"type": TAGS[cls], **conv.unstructure(message, cls)}

    for union in (ClientMessage, GatewayMessage, BrowserMessage):
        configure_tagged_union(union, conv, tag_generator=TAGS.__getitem__, tag_name="type")
        conv.register_unstructure_hook(union, unstructure_type_first)
    return conv


converter = _make_converter()
"""The one converter for the browser socket's messages."""


def encode(message: BrowserMessage) -> bytes:
    """Serialise a message to UTF-8 JSON bytes (send them as a text frame).

    Raises `FrameError` for what JSON cannot carry (integers past 64 bits, lone surrogates).
    """
    try:
        return orjson.dumps(converter.unstructure(message, BrowserMessage))
    except orjson.JSONEncodeError as exc:
        raise FrameError(f"cannot encode {type(message).__name__}: {exc}") from exc


# --- the gateway's reading of a client message, step by step -------------------------------

M = TypeVar("M", bound=ClientMessage)


def request_id_of(obj: dict[str, Any]) -> str:
    """The message's request_id; raises `ApiError` invalid_request_id."""
    rid = obj.get("request_id")
    if type(rid) is not str or not 0 < len(rid) <= errors.MAX_REQUEST_ID_CHARS:
        raise errors.invalid_request_id()
    return rid


def structure(obj: dict[str, Any], cls: type[M]) -> M:
    """`obj` (a loaded message whose type is `cls`'s tag) as a `cls`.

    Raises `ApiError` unknown_parameter for keys `cls` does not have, checked first so that
    the error names them all; then `FrameError`, with the path, for a field of the wrong type
    (only `Auth.api_key` can be: callers check request_id first, and a body is any JSON).
    """
    unknown = obj.keys() - _FIELDS[cls]
    if unknown:
        raise unknown_fields(unknown)
    fields = {key: value for key, value in obj.items() if key != "type"}
    try:
        return converter.structure(fields, cls)
    except Exception as exc:
        messages = "; ".join(cattrs.transform_error(exc, path=TAGS[cls]))
        raise FrameError(f"invalid {TAGS[cls]} message: {messages}") from exc


def chat_request(
    body: Any, max_tokens_limit: int, *, store: bool = False, max_choices: int = MAX_N
) -> ChatRequest:
    """A create's body as a `ChatRequest`, validated as the HTTP API does, plus the socket's
    rule that it always streams. `store`: the gateway keeps stored completions. Raises
    `ApiError`."""
    if type(body) is dict and "stream" not in body:
        body = {**body, "stream": True}  # streaming is implied
    chat = parse_chat_object(body, store=store)
    chat.check_ceilings(max_tokens_limit, max_choices)
    if not chat.stream:
        raise errors.stream_required()
    return chat


# --- strict decoding of whole messages (clients, tests) ------------------------------------


def _decode(data: bytes | str, types: dict[str, Any], union: Any) -> Any:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"not valid JSON: {exc}") from exc
    if type(obj) is not dict:
        raise FrameError(f"a message must be a JSON object, got {type(obj).__name__}")
    tag = obj.get("type")
    if type(tag) is not str:
        raise FrameError("a message needs a string 'type' field")
    if tag not in types:
        raise FrameError(f"unknown message type {tag[:64]!r}")
    try:
        return converter.structure(obj, union)
    except Exception as exc:
        messages = "; ".join(cattrs.transform_error(exc, path=tag))
        raise FrameError(f"invalid {tag} message: {messages}") from exc


def decode_client_message(data: bytes | str) -> ClientMessage:
    """Strictly decode a message a browser sent; raises `FrameError` naming the bad path.
    (The gateway reads client messages step by step, for the API's errors.)"""
    message: ClientMessage = _decode(data, CLIENT_TYPES, ClientMessage)
    return message


def decode_gateway_message(data: bytes | str) -> GatewayMessage:
    """Strictly decode a message the gateway sent; raises `FrameError` naming the bad path."""
    message: GatewayMessage = _decode(data, GATEWAY_TYPES, GatewayMessage)
    return message
