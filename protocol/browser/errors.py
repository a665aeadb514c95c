"""The errors the browser socket answers about a message itself, each made by one function.

They are `ApiError`s, sent as `{"type": "error", "request_id", "error": {...}}`; which
`request_id` an error carries is the session's decision (`protocol.browser.session`), not the
error's. The texts are part of the wire format (docs/websocket-api.md): keep them byte-exact.

    type                    code                    made by
    invalid_request_error   message_too_large       message_too_large()
    invalid_request_error   invalid_json            invalid_json()
    invalid_request_error   invalid_message         invalid_message()
    invalid_request_error   unknown_message_type    unknown_message_type()
    invalid_request_error   invalid_request_id      invalid_request_id()
    invalid_request_error   duplicate_request_id    duplicate_request_id()
    invalid_request_error   unknown_parameter       unknown_fields()
    invalid_request_error   null                    stream_required()
    rate_limit_error        too_many_requests       too_many_requests()

Errors in the create's `body` are `protocol.openai.chat.request`'s, exactly as over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.core.errors import ApiError, invalid_request

MAX_REQUEST_ID_CHARS = 256


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
    """A `type` the gateway does not take (now: `auth` once authenticated)."""
    # Clipped: the client chose the text, and it is echoed back.
    return invalid_request(f"Unknown message type {tag[:64]!r}.", "type", "unknown_message_type")


def invalid_request_id() -> ApiError:
    """`request_id` missing, not a string, empty or too long."""
    return invalid_request(
        f"'request_id' must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters.",
        "request_id",
        "invalid_request_id",
    )


def duplicate_request_id(request_id: str) -> ApiError:
    """A create reusing the id of a request still in flight."""
    return invalid_request(
        f"request_id {request_id!r} is already in flight on this socket.",
        "request_id",
        "duplicate_request_id",
    )


def too_many_requests(limit: int) -> ApiError:
    """A create while `limit` requests are in flight on the socket."""
    return ApiError(
        429,
        f"At most {limit} requests may be in flight on one socket.",
        "rate_limit_error",
        None,
        "too_many_requests",
    )


def unknown_fields(names: Iterable[str]) -> ApiError:
    """Fields a message type does not have (never silently ignored)."""
    return invalid_request(
        f"Unknown field(s) in message: {', '.join(sorted(names))}.", None, "unknown_parameter"
    )


def stream_required() -> ApiError:
    """A create whose body says `stream: false`."""
    return invalid_request(
        "The WebSocket API always streams; 'stream' must be true or omitted.", "stream"
    )
