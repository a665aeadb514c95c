"""Every error the gateway answers, in OpenAI's shape: `{"error": {message, type, param, code}}`.

`openai_error_for` maps gateway errors and runner error frames to `OpenAIError`; the
exception handlers turn those, Litestar's own HTTP errors (404 route, 405, 413 body too
large) and anything unexpected into OpenAI-shaped responses.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from litestar import Request, Response
from litestar.exceptions import HTTPException

from gateway.errors import ModelNotFound, QueueFull, QueueTimeout, RunnerLost
from gateway.pool import Lost
from protocol.frames import Error
from protocol.openai.errors import OpenAIError

log = logging.getLogger("gateway.errors")

_RUNNER_CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "over_capacity": (503, "server_error"),
    "internal_error": (500, "server_error"),
}


def openai_error_for(problem: object) -> OpenAIError:
    """The OpenAI error for a gateway exception, a runner Error frame, or a lost runner."""
    match problem:
        case OpenAIError():
            return problem
        case ModelNotFound(model=model):
            return OpenAIError(404, str(problem), "invalid_request_error", "model", "model_not_found")
        case QueueFull() | QueueTimeout():
            err = OpenAIError(429, str(problem), "rate_limit_error", None, "queue_full")
            err.retry_after = problem.retry_after
            return err
        case Lost(error=lost):
            return OpenAIError(502, str(lost), "server_error", None, "runner_lost")
        case RunnerLost():
            return OpenAIError(502, str(problem), "server_error", None, "runner_lost")
        case Error(code=code, message=message):
            status, kind = _RUNNER_CODES.get(code, (500, "server_error"))
            return OpenAIError(status, message, kind, None, code)
        case None:
            return OpenAIError(504, "The runner sent nothing in time.", "server_error", None, "timeout")
    log.exception("unexpected error", exc_info=problem if isinstance(problem, BaseException) else None)
    return OpenAIError(500, "Internal server error.", "server_error", None, None)


def error_response(err: OpenAIError) -> Response[bytes]:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return Response(
        content=orjson.dumps(err.body()),
        status_code=err.status,
        media_type="application/json",
        headers=headers,
    )


def handle_openai_error(_: Request[Any, Any, Any], exc: OpenAIError) -> Response[bytes]:
    return error_response(exc)


_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def handle_http_exception(_: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    if status == 413:
        message = "Request body too large."
        code: str | None = "request_too_large"
    else:
        message = str(exc.detail)
        code = None
    kind = _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return error_response(OpenAIError(status, message, kind, None, code))


def handle_unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    return error_response(openai_error_for(exc))
