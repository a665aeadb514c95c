"""The gateway's errors, all under one base. Each class carries what a client is told: its
HTTP status, OpenAI error type and code, and (for the ones worth retrying) how soon to retry.
The HTTP and WebSocket layers (`gateway.http_errors`) and the metrics' outcome labels
(`gateway.observability.metrics`) both read them from here, as `ProtocolError` carries its close
code.

    GatewayError                                  status  code
    ├── ModelNotFound        no live runner serves the model, nor did one recently
    │                                               404   model_not_found
    ├── ModelUnavailable     no live runner serves it now, but one did within the grace
    │                        period (or the gateway has just started)
    │                                               503   model_unavailable (Retry-After)
    ├── QueueFull            every runner is busy and the model's queue is full
    │                                               429   queue_full (Retry-After)
    ├── QueueTimeout         waited in the queue past the timeout
    │                                               429   queue_full (Retry-After; in the
    │                                                     metrics: queue_timeout)
    ├── ShuttingDown         the gateway is draining and takes no new requests
    │                                               503   shutting_down (Retry-After)
    ├── RunnerLost           the runner carrying a request went away after its first token
    │                                               502   runner_lost
    ├── StreamTimeout        no frame from the runner for the stream timeout
    │                                               504   timeout
    └── StoreUnavailable     the --store database cannot be used: at start (corrupt,
                             unreadable, held by another gateway), never a client's error;
                             `orchard gateway` and `serve` exit with status 2
"""

from __future__ import annotations

from typing import ClassVar


class GatewayError(Exception):
    """Base of the gateway's own errors."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    """OpenAI's error `type` (Anthropic's and Ollama's shapes are derived from the status)."""
    code: ClassVar[str] = "gateway_error"
    """OpenAI's error `code` (the browser socket's too)."""
    outcome: ClassVar[str | None] = None
    """The request's `outcome` label in the metrics when it is not `code`."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        """Seconds the client should wait before retrying (the Retry-After header); None:
        retrying is not the remedy."""


class ModelNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        # OpenAI's exact message.
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.")
        self.model = model


class ModelUnavailable(GatewayError):
    status = 503
    code = "model_unavailable"

    def __init__(self, model: str, retry_after: float) -> None:
        super().__init__(
            f"No runner serving `{model}` is connected right now; its runners may be "
            "reconnecting. Retry shortly.",
            retry_after,
        )
        self.model = model


class ShuttingDown(GatewayError):
    status = 503
    code = "shutting_down"

    def __init__(self) -> None:
        super().__init__("The gateway is shutting down and takes no new requests.", 1.0)


class StreamTimeout(GatewayError):
    status = 504
    code = "timeout"

    def __init__(self, seconds: float) -> None:
        super().__init__(f"The runner sent nothing for {seconds:g} s; the request was ended.")
        self.seconds = seconds


class QueueFull(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, model: str, retry_after: float) -> None:
        message = f"Every runner serving `{model}` is busy and its queue is full."
        super().__init__(message, retry_after)
        self.model = model


class QueueTimeout(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    code = "queue_full"  # to the client, as a full queue: retry later
    outcome = "queue_timeout"

    def __init__(self, model: str, retry_after: float) -> None:
        super().__init__(f"Timed out waiting for a free runner serving `{model}`.", retry_after)
        self.model = model


class RunnerLost(GatewayError):
    status = 502
    code = "runner_lost"

    def __init__(self, runner_name: str) -> None:
        super().__init__(f"The runner {runner_name!r} serving this request disconnected.")
        self.runner_name = runner_name


class StoreUnavailable(GatewayError):
    """The stores' database (`--store PATH`, gateway.stores.sqlite) cannot be opened or read;
    the message names the file and what to do."""

    code = "store_unavailable"

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(
            f"the store {path} {problem}. Start with --store memory (nothing kept across "
            "restarts) or --store ANOTHER_PATH."
        )
        self.path = path
