"""Errors in OpenAI's wire shape: `{"error": {"message", "type", "param", "code"}}`.

One exception class, `OpenAIError`, carries the HTTP status with the four body fields. It is
apart from `protocol.errors.ProtocolError` (that one closes a runner WebSocket; this one
answers an HTTP client). Every kind of error this API answers is made by one function here:

    status  type                    code                       made by
    400     invalid_request_error   (varies, may be null)      invalid_request()
    400     invalid_request_error   context_length_exceeded    context_length_exceeded()
    401     authentication_error    invalid_api_key            authentication()
    404     invalid_request_error   model_not_found            model_not_found()
    404     invalid_request_error   null                       completion_not_found()
    413     invalid_request_error   request_too_large          too_large()
    429     rate_limit_error        rate_limit_exceeded        rate_limited()
    429     rate_limit_error        queue_full                 queue_full()
    500     server_error            null                       server_error()
    503     server_error            service_unavailable        unavailable()
    503     server_error            model_load_failed          runner_error()
    (any)   (by the runner's code)  (the runner's code)        runner_error()

The OpenAI SDK picks its exception class from the status alone, and retries 408, 409, 429
and 5xx honouring `Retry-After`; `retry_after` (seconds) is for the HTTP layer to send.
"""

from __future__ import annotations

from typing import Any

from protocol.frames import Error


class OpenAIError(Exception):
    """An error answered to an OpenAI-API client: an HTTP status and OpenAI's error body."""

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

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return (
            f"OpenAIError({self.status}, {self.message!r}, {self.type!r}, "
            f"param={self.param!r}, code={self.code!r})"
        )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400: the request is malformed, mistyped, out of range or asks for something unsupported."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(message: str, param: str = "messages") -> OpenAIError:
    """400: the prompt (plus the completion bound) does not fit the model's context; `param`
    names what holds it ("messages", or a text completion's "prompt")."""
    return OpenAIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def authentication(message: str = "Incorrect API key provided.") -> OpenAIError:
    """401: a missing or wrong API key."""
    return OpenAIError(401, message, "authentication_error", None, "invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    """404: no runner serves `model` (OpenAI's exact message; `param` is null there too)."""
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        None,
        "model_not_found",
    )


def completion_not_found(completion_id: str) -> OpenAIError:
    """404: no stored chat completion has this id (never stored, deleted or expired)."""
    shown = completion_id if len(completion_id) <= 100 else completion_id[:100] + "..."
    return OpenAIError(
        404,
        f"No chat completion found with id '{shown}'.",
        "invalid_request_error",
        None,
        None,
    )


def too_large(limit_bytes: int) -> OpenAIError:
    """413: the request body is over the gateway's limit."""
    return OpenAIError(
        413,
        f"Request body too large: the limit is {limit_bytes} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def rate_limited(message: str, retry_after: float | None = None) -> OpenAIError:
    """429: this client sent too much; retry later."""
    return OpenAIError(
        429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after=retry_after
    )


def queue_full(retry_after: float | None = None) -> OpenAIError:
    """429: every runner is busy and the wait queue is full; retry later."""
    return OpenAIError(
        429,
        "The server is busy: too many requests are waiting. Retry later.",
        "rate_limit_error",
        None,
        "queue_full",
        retry_after=retry_after,
    )


def server_error(
    message: str = "The server had an error while processing your request.",
) -> OpenAIError:
    """500: a bug or an unexpected failure on our side."""
    return OpenAIError(500, message, "server_error", None, None)


def unavailable(message: str, retry_after: float | None = None) -> OpenAIError:
    """503: nothing can serve the request right now (no runner up, shutting down)."""
    return OpenAIError(
        503, message, "server_error", None, "service_unavailable", retry_after=retry_after
    )


def runner_error(frame: Error) -> OpenAIError:
    """A runner's Error frame, as the HTTP status its code means."""
    match frame.code:
        case "context_length_exceeded":
            return context_length_exceeded(frame.message, frame.param or "messages")
        case "invalid_request":
            return invalid_request(frame.message, frame.param, "invalid_value")
        case "model_not_found":
            return OpenAIError(404, frame.message, "invalid_request_error", None, frame.code)
        case "over_capacity":
            return unavailable(frame.message, retry_after=1.0)
        case "model_load_failed":
            return OpenAIError(503, frame.message, "server_error", None, frame.code)
    return OpenAIError(500, frame.message, "server_error", None, frame.code)
