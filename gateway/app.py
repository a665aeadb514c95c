"""The gateway's Litestar application."""

from __future__ import annotations

import logging

from litestar import Litestar
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig

from gateway.admin import health, list_models, list_runners
from gateway.chat import chat_completions
from gateway.config import GatewayConfig
from gateway.http_errors import handle_http_exception, handle_openai_error, handle_unexpected
from gateway.pool import Pool
from gateway.runner_link import runner_socket
from protocol.openai.errors import OpenAIError

log = logging.getLogger("gateway")


def create_app(config: GatewayConfig | None = None) -> Litestar:
    """Build the gateway app; its pool lives in `app.state.pool`."""
    config = config or GatewayConfig()
    pool = Pool(config)
    return Litestar(
        route_handlers=[chat_completions, list_models, list_runners, health, runner_socket],
        state=State({"pool": pool, "config": config}),
        exception_handlers={
            OpenAIError: handle_openai_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
        openapi_config=OpenAPIConfig(title="Orchard gateway", version="0.1.0", path="/schema"),
        request_max_body_size=config.max_body_bytes,
        logging_config=None,
    )
