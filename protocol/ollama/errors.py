"""Errors in Ollama's wire shape: `{"error": "<message>"}`, with the HTTP status.

The gateway decides every error once, as an `ApiError` (protocol.core.errors); a request
to the Ollama API gets its status and message in Ollama's shape, which the ollama library
raises as `ResponseError(error, status_code)`.
"""

from __future__ import annotations

from typing import Any

from protocol.core.errors import ApiError


def error_body(err: ApiError) -> dict[str, Any]:
    """The body of an error response, or the last line of a stream that failed."""
    return {"error": err.message}
