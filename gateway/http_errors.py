"""Every error the gateway answers, decided once as an `ApiError` and written in the shape
of the API the client spoke (each API's router has its own handlers: gateway.api).

`api_error_for` maps gateway errors and runner error frames to `ApiError`;
`exception_handlers` turns those, Litestar's own HTTP errors (404 route, 405, 413 body too
large) and anything unexpected into error responses in one shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from gateway.errors import GatewayError
from gateway.streaming.request_stream import Failed
from protocol.core import errors
from protocol.core.errors import ApiError
from protocol.frames import Error

log = logging.getLogger("gateway.errors")


def api_error_for(problem: object) -> ApiError:
    """The `ApiError` for a gateway exception, a runner Error frame, or a lost runner."""
    match problem:
        case ApiError():
            return problem
        case GatewayError():
            return ApiError(
                problem.status,
                str(problem),
                problem.error_type,
                None,
                problem.code,
                retry_after=problem.retry_after,
            )
        case Failed(error=error):
            return api_error_for(error)
        case Error():
            return errors.runner_error(problem)
    log.error("unexpected error", exc_info=problem if isinstance(problem, BaseException) else None)
    return errors.server_error()


ErrorShape = Callable[[ApiError], dict[str, Any]]


def error_response(err: ApiError, shape: ErrorShape) -> Response[bytes]:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return Response(
        content=orjson.dumps(shape(err)),
        status_code=err.status,
        media_type="application/json",
        headers=headers,
    )


_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}

ShapeOf = Callable[[Request[Any, Any, Any]], ErrorShape]
"""The error shape for a request (its API's; for a request no route took, by its path)."""


def exception_handlers(shape_of: ShapeOf) -> ExceptionHandlersMap:
    """Litestar exception handlers writing every error in `shape_of`'s shape."""

    def handle_api_error(request: Request[Any, Any, Any], exc: ApiError) -> Response[bytes]:
        return error_response(exc, shape_of(request))

    def handle_http_exception(
        request: Request[Any, Any, Any], exc: HTTPException
    ) -> Response[bytes]:
        status = exc.status_code
        shape = shape_of(request)
        if status == 413:
            return error_response(errors.too_large(request.app.state.config.max_body_bytes), shape)
        kind = _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        return error_response(ApiError(status, str(exc.detail), kind, None, None), shape)

    def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
        return error_response(api_error_for(exc), shape_of(request))

    return {
        ApiError: handle_api_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }
