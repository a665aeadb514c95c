"""The errors the browser socket answers about a message itself, each made by one function.

They are `ApiError`s, sent as `{"type": "error", "request_id", "error": {...}}`; which
`request_id` an error carries is the session's decision (`protocol.browser.session`), not the
error's. The texts are part of the wire format (docs/websocket-api.md): keep them byte-exact.

    type                    code                    made by
    invalid_request_error   invalid_request_id      invalid_request_id()
    invalid_request_error   duplicate_request_id    duplicate_request_id()
    invalid_request_error   null                    stream_required()
    rate_limit_error        too_many_requests       too_many_requests()

The errors about a message itself that every client socket shares (too large, not JSON, not
an object with a string `type`, an unknown type, unknown fields) are
`protocol.client_socket`'s. Errors in the create's `body` are `protocol.openai.chat.request`'s,
exactly as over HTTP.
"""

from __future__ import annotations

from protocol.core.errors import ApiError, invalid_request

MAX_REQUEST_ID_CHARS = 256


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


def stream_required() -> ApiError:
    """A create whose body says `stream: false`."""
    return invalid_request(
        "The WebSocket API always streams; 'stream' must be true or omitted.", "stream"
    )
