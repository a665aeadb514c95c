"""Errors in Anthropic's wire shape: `{"type": "error", "error": {"type", "message"}}`.

The gateway decides every error once, as an `ApiError` (protocol.core.errors: the HTTP
status and what went wrong); a request to the Messages API gets it in Anthropic's shape, its
`type` from the status as Anthropic's API documents them. The anthropic SDK picks its
exception class from the status and retries 408, 409, 429 and 5xx.
"""

from __future__ import annotations

from typing import Any

from protocol.core.errors import ApiError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(err: ApiError) -> dict[str, Any]:
    """The body of an error response, or of a stream's `error` event."""
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}
