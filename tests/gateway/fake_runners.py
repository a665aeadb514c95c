"""What the fake-runner test modules share (test_fake_runner_relay, _queue and _link): the
chat body they post and the `committing` gateway, started anew by each module that asks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tests.gateway.gateways import FAKE_RUNNERS
from tests.support import Gateway, secs

FIRST_TOKEN_WAIT = 0.3
KEEPALIVE = 0.5
QUEUE_TIMEOUT = 1.0
"""The `committing` gateway's --first-token-wait, --keepalive-interval and --queue-timeout,
in the tests' time unit."""


def committing_gateway() -> Iterator[Gateway]:
    """Commits a silent stream soon and keeps it alive, queues one request per model for a
    second, and takes two browser sockets."""
    gw = Gateway(
        "--first-token-wait",
        secs(FIRST_TOKEN_WAIT),
        "--keepalive-interval",
        secs(KEEPALIVE),
        "--queue-size",
        "1",
        "--queue-timeout",
        secs(QUEUE_TIMEOUT),
        "--max-client-sockets",
        "2",
        *FAKE_RUNNERS,
    )
    yield gw
    gw.stop()


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}
