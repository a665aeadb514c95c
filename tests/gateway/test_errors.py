"""The gateway's errors (gateway.errors) and the two places that read them: the error a client
gets (gateway.http_errors) and the request's outcome label (gateway.observability.metrics)."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import (
    GatewayError,
    ModelNotFound,
    ModelUnavailable,
    QueueFull,
    QueueTimeout,
    RunnerLost,
    ShuttingDown,
    StoreUnavailable,
    StreamTimeout,
)
from gateway.http_errors import api_error_for, error_response
from gateway.observability.metrics import error_kind
from gateway.streaming.request_stream import Failed
from protocol.openai.errors import error_body

NOT_FOUND, UNAVAILABLE = "model_not_found", "model_unavailable"
NO_STORE = "store_unavailable"  # at start only: never sent to a client, but shaped as the others
Told = tuple[int, str, str, str, str | None]
"""status, type, code, outcome label, Retry-After."""
ERRORS: list[tuple[GatewayError, Told]] = [
    (ModelNotFound("m"), (404, "invalid_request_error", NOT_FOUND, NOT_FOUND, None)),
    (ModelUnavailable("m", 2), (503, "server_error", UNAVAILABLE, UNAVAILABLE, "2")),
    (QueueFull("m", 1.0), (429, "rate_limit_error", "queue_full", "queue_full", "1")),
    (QueueTimeout("m", 1.0), (429, "rate_limit_error", "queue_full", "queue_timeout", "1")),
    (ShuttingDown(), (503, "server_error", "shutting_down", "shutting_down", "1")),
    (RunnerLost("mac"), (502, "server_error", "runner_lost", "runner_lost", None)),
    (StreamTimeout(5), (504, "server_error", "timeout", "timeout", None)),
    (StoreUnavailable("f", "is bad"), (500, "server_error", NO_STORE, NO_STORE, None)),
]  # fmt: skip


def test_every_gateway_error_is_in_the_table() -> None:
    assert {type(error) for error, _ in ERRORS} == set(GatewayError.__subclasses__())


@pytest.mark.parametrize(("error", "told"), ERRORS, ids=[type(e).__name__ for e, _ in ERRORS])
def test_the_client_and_the_metrics_are_told_the_same(error: GatewayError, told: Told) -> None:
    status, kind, code, outcome, retry_after = told
    for problem in (error, Failed(error)):
        response = error_response(api_error_for(problem), error_body)
        assert response.status_code == status
        assert orjson.loads(response.content) == {
            "error": {"message": str(error), "type": kind, "param": None, "code": code}
        }
        assert response.headers.get("Retry-After") == retry_after
    assert error_kind(error) == outcome


def test_a_new_error_needs_only_its_class() -> None:
    class Teapot(GatewayError):
        status = 418
        error_type = "invalid_request_error"
        code = "teapot"

    err = api_error_for(Teapot("short and stout", retry_after=3.4))
    assert (err.status, err.type, err.code, err.message, err.retry_after) == (
        418,
        "invalid_request_error",
        "teapot",
        "short and stout",
        3.4,
    )
    assert error_kind(Teapot("x")) == "teapot"
