"""The gateway's errors, all under one base; the HTTP and WebSocket layers map them to
OpenAI-shaped errors (see `gateway.http_errors`).

    GatewayError
    ├── ModelNotFound        no live runner serves the model, nor did one recently
    ├── ModelUnavailable     no live runner serves it now, but one did within the grace period
    ├── QueueFull            every runner is busy and the model's queue is full
    ├── QueueTimeout         waited in the queue past the timeout
    ├── ShuttingDown         the gateway is draining and takes no new requests
    ├── RunnerLost           the runner carrying a request went away after its first token
    └── StreamTimeout        no frame from the runner for the stream timeout
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base of the gateway's own errors."""


class ModelNotFound(GatewayError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.")
        self.model = model


class ModelUnavailable(GatewayError):
    def __init__(self, model: str, retry_after: float) -> None:
        super().__init__(
            f"No runner serving `{model}` is connected right now; its runners may be "
            "reconnecting. Retry shortly."
        )
        self.model = model
        self.retry_after = retry_after


class ShuttingDown(GatewayError):
    def __init__(self) -> None:
        super().__init__("The gateway is shutting down and takes no new requests.")
        self.retry_after = 1.0


class StreamTimeout(GatewayError):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"The runner sent nothing for {seconds:g} s; the request was ended.")
        self.seconds = seconds


class QueueFull(GatewayError):
    def __init__(self, model: str, retry_after: float) -> None:
        super().__init__(f"Every runner serving `{model}` is busy and its queue is full.")
        self.model = model
        self.retry_after = retry_after


class QueueTimeout(GatewayError):
    def __init__(self, model: str, retry_after: float) -> None:
        super().__init__(f"Timed out waiting for a free runner serving `{model}`.")
        self.model = model
        self.retry_after = retry_after


class RunnerLost(GatewayError):
    def __init__(self, runner_name: str) -> None:
        super().__init__(f"The runner {runner_name!r} serving this request disconnected.")
        self.runner_name = runner_name
