"""The one error type every API dialect answers with, and its neutral constructors.

`ApiError` carries the HTTP status and what went wrong: a message, a type, the parameter it is
about and a code. It is apart from `protocol.errors.ProtocolError` (that one closes a runner
WebSocket; this one answers an API client). The gateway decides every error once, as an
`ApiError`; each dialect writes it in its own shape (`protocol.openai.errors.error_body`,
`protocol.anthropic.errors`, `protocol.ollama.errors`). Every kind of error is made by one
function here:

    status  type                    code                       made by
    400     invalid_request_error   (varies, may be null)      invalid_request()
    400     invalid_request_error   context_length_exceeded    context_length_exceeded()
    401     authentication_error    invalid_api_key            authentication()
    404     invalid_request_error   model_not_found            model_not_found()
    413     invalid_request_error   request_too_large          too_large()
    429     rate_limit_error        rate_limit_exceeded        rate_limited()
    429     rate_limit_error        queue_full                 queue_full()
    500     server_error            null                       server_error()
    503     server_error            service_unavailable        unavailable()
    503     server_error            model_load_failed          runner_error()
    (any)   (by the runner's code)  (the runner's code)        runner_error()

The types and codes are OpenAI's names (the first API served). The SDKs pick their exception
class from the status alone, and retry 408, 409, 429 and 5xx honouring `Retry-After`;
`retry_after` (seconds) is for the HTTP layer to send.
"""

from __future__ import annotations

from protocol.frames import Error


class ApiError(Exception):
    """An error answered to an API client, in any dialect: an HTTP status and what went wrong."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after
        """Seconds the client should wait before retrying, for a `Retry-After` header."""

    def __repr__(self) -> str:
        return (
            f"ApiError({self.status}, {self.message!r}, {self.type!r}, "
            f"param={self.param!r}, code={self.code!r})"
        )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request is malformed, mistyped, out of range or asks for something unsupported."""
    return ApiError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(message: str, param: str = "messages") -> ApiError:
    """400: the prompt (plus the completion bound) does not fit the model's context; `param`
    names what holds it ("messages", or a text completion's "prompt")."""
    return ApiError(400, message, "invalid_request_error", param, "context_length_exceeded")


def authentication(message: str = "Incorrect API key provided.") -> ApiError:
    """401: a missing or wrong API key."""
    return ApiError(401, message, "authentication_error", None, "invalid_api_key")


def model_not_found(model: str) -> ApiError:
    """404: no runner serves `model` (OpenAI's exact message; `param` is null there too)."""
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        None,
        "model_not_found",
    )


def too_large(limit_bytes: int) -> ApiError:
    """413: the request body is over the gateway's limit."""
    return ApiError(
        413,
        f"Request body too large: the limit is {limit_bytes} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def rate_limited(message: str, retry_after: float | None = None) -> ApiError:
    """429: this client sent too much; retry later."""
    return ApiError(
        429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after=retry_after
    )


def queue_full(retry_after: float | None = None) -> ApiError:
    """429: every runner is busy and the wait queue is full; retry later."""
    return ApiError(
        429,
        "The server is busy: too many requests are waiting. Retry later.",
        "rate_limit_error",
        None,
        "queue_full",
        retry_after=retry_after,
    )


def server_error(
    message: str = "The server had an error while processing your request.",
) -> ApiError:
    """500: a bug or an unexpected failure on our side."""
    return ApiError(500, message, "server_error", None, None)


def unavailable(message: str, retry_after: float | None = None) -> ApiError:
    """503: nothing can serve the request right now (no runner up, shutting down)."""
    return ApiError(
        503, message, "server_error", None, "service_unavailable", retry_after=retry_after
    )


def runner_error(frame: Error) -> ApiError:
    """A runner's Error frame, as the HTTP status its code means."""
    match frame.code:
        case "context_length_exceeded":
            return context_length_exceeded(frame.message, frame.param or "messages")
        case "invalid_request":
            return invalid_request(frame.message, frame.param, "invalid_value")
        case "model_not_found":
            return ApiError(404, frame.message, "invalid_request_error", None, frame.code)
        case "over_capacity":
            return unavailable(frame.message, retry_after=1.0)
        case "model_load_failed":
            return ApiError(503, frame.message, "server_error", None, frame.code)
    return ApiError(500, frame.message, "server_error", None, frame.code)
