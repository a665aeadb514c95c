"""Errors in OpenAI's wire shape: `{"error": {"message", "type", "param", "code"}}`.

The gateway decides every error once, as an `ApiError` (protocol.core.errors: the HTTP status
and what went wrong); a request to an OpenAI API gets it in this shape. The one error only
this dialect answers is made here too:

    status  type                    code                       made by
    404     invalid_request_error   null                       completion_not_found()
"""

from __future__ import annotations

from typing import Any

from protocol.core.errors import ApiError


def error_body(err: ApiError) -> dict[str, Any]:
    """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
        }
    }


def completion_not_found(completion_id: str) -> ApiError:
    """404: no stored chat completion has this id (never stored, deleted or expired)."""
    shown = completion_id if len(completion_id) <= 100 else completion_id[:100] + "..."
    return ApiError(
        404,
        f"No chat completion found with id '{shown}'.",
        "invalid_request_error",
        None,
        None,
    )
