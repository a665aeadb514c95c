"""What every client WebSocket reads the same way, sans-I/O: the browser socket (`/v1/ws`,
protocol.browser) and the Responses API's WebSocket mode (`/v1/responses`,
protocol.openai.responses.socket).

- `load`: one message as a JSON object with a string `type`, or the `ApiError` that says
  why not (too large, not JSON, not such an object);
- the errors about a message itself (each made by one function below), which each socket
  writes in its own error shape;
- `AuthGate`: the first-message authentication of a socket whose upgrade request brought no
  valid `Authorization: Bearer` key (browsers cannot set headers on a WebSocket);
- what both sessions' states and events have in common: `State`, `Reply`, `CloseSocket`.

    type                    code                    made by
    invalid_request_error   message_too_large       message_too_large()
    invalid_request_error   invalid_json            invalid_json()
    invalid_request_error   invalid_message         invalid_message()
    invalid_request_error   unknown_message_type    unknown_message_type()
    invalid_request_error   unknown_parameter       unknown_fields()

The texts are part of the wire formats (docs/websocket-api.md,
docs/responses-websocket.md): keep them byte-exact.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import orjson

from protocol.closecodes import CloseCode
from protocol.core.errors import ApiError, invalid_request

AUTH_OK = b'{"type":"auth.ok"}'
"""The answer to the right key."""
AUTH_FIELDS = frozenset(("type", "api_key"))


class State(enum.Enum):
    """A client socket's session: waiting for its `auth`, open, or closed for good."""

    AWAIT_AUTH = "await_auth"
    OPEN = "open"
    CLOSED = "closed"


@attrs.frozen
class Reply:
    """Send `data` (a whole message) to the client, after whatever is queued."""

    data: bytes


@attrs.frozen
class CloseSocket:
    """Close the socket with this code and reason; the session is CLOSED."""

    code: int
    reason: str


def message_too_large(size: int, limit: int) -> ApiError:
    """The message is over the size limit; it was not parsed."""
    return invalid_request(
        f"Message of {size} bytes is over the {limit}-byte limit.", None, "message_too_large"
    )


def invalid_json(exc: Exception) -> ApiError:
    """The message is not JSON; `exc` is the parser's error, which says where."""
    return invalid_request(f"Invalid JSON: {exc}", None, "invalid_json")


def invalid_message() -> ApiError:
    """JSON, but not an object with a string `type`."""
    return invalid_request(
        "A message must be a JSON object with a string 'type'.", "type", "invalid_message"
    )


def unknown_message_type(tag: str) -> ApiError:
    """A `type` the socket does not take (`auth` too, once authenticated)."""
    # Clipped: the client chose the text, and it is echoed back.
    return invalid_request(f"Unknown message type {tag[:64]!r}.", "type", "unknown_message_type")


def unknown_fields(names: Iterable[str]) -> ApiError:
    """Fields a message type does not have (never silently ignored)."""
    return invalid_request(
        f"Unknown field(s) in message: {', '.join(sorted(names))}.", None, "unknown_parameter"
    )


def load(data: bytes | str, max_bytes: int) -> dict[str, Any]:
    """Parse one client message into a JSON object with a string `type` (not yet checked
    against the known types). Raises `ApiError`: message_too_large, invalid_json,
    invalid_message."""
    # A str is measured as the UTF-8 the client sent (surrogatepass: a str that is not
    # valid UTF-8 must still be measured, then refused as invalid JSON below).
    size = len(data) if not isinstance(data, str) else len(data.encode(errors="surrogatepass"))
    if size > max_bytes:
        raise message_too_large(size, max_bytes)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise invalid_json(exc) from exc
    if type(obj) is not dict or type(obj.get("type")) is not str:
        raise invalid_message()
    return obj


class AuthGate:
    """Whether a socket may speak yet, and the `auth` message that lets it:

        waiting --{"type":"auth","api_key":<right key>}--> open       reply AUTH_OK
        waiting --auth with a wrong, missing or non-string key--> 4004 "invalid API key"
        waiting --any other type--> 4004 "authenticate first"
        waiting --timed_out()--> 4004 "no auth message in time"

    With no key to check (the gateway has none, or the upgrade had a valid one) it starts
    open. An `auth` with fields besides `api_key` raises the `ApiError` unknown_parameter
    (the socket answers it; the key is not even looked at, the gate still waits)."""

    __slots__ = ("_verify_key", "closed", "waiting")

    def __init__(self, verify_key: Callable[[str], bool] | None) -> None:
        self._verify_key = verify_key
        self.waiting = verify_key is not None
        """No message but `auth` is taken yet."""
        self.closed = False
        """Refused: the socket is closing."""

    def admit(self, obj: dict[str, Any]) -> bytes | CloseSocket:
        """A loaded message while `waiting`: AUTH_OK to send (the gate is open now), or the
        socket's close (the gate is closed for good)."""
        if obj["type"] != "auth":
            return self._refuse("authenticate first")
        unknown = obj.keys() - AUTH_FIELDS
        if unknown:
            raise unknown_fields(unknown)
        key = obj.get("api_key")
        assert self._verify_key is not None  # waiting only with a key to check
        if type(key) is not str or not self._verify_key(key):
            return self._refuse("invalid API key")
        self.waiting = False
        return AUTH_OK

    def timed_out(self) -> CloseSocket | None:
        """The socket's auth timer fired: its close if it is still waiting."""
        if not self.waiting or self.closed:
            return None
        return self._refuse("no auth message in time")

    def _refuse(self, reason: str) -> CloseSocket:
        self.waiting = False
        self.closed = True
        return CloseSocket(CloseCode.UNAUTHORIZED, reason)
