"""The gateway's Litestar application."""

from __future__ import annotations

import logging
from pathlib import Path

from litestar import Litestar, get
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.response import File
from litestar.static_files import create_static_files_router

from gateway.anthropic import routes as anthropic_api
from gateway.auth import before_request
from gateway.browser.routes import client_socket
from gateway.config import GatewayConfig
from gateway.http_errors import handle_api_error, handle_http_exception, handle_unexpected
from gateway.observability.admin import health, list_models, list_runners, metrics, tls_proof
from gateway.ollama import routes as ollama_api
from gateway.openai.chat.routes import chat_completions
from gateway.openai.chat.stored import (
    delete_stored,
    get_stored,
    list_stored,
    list_stored_messages,
    update_stored,
)
from gateway.openai.completions.routes import completions
from gateway.openai.responses import routes as responses_api
from gateway.pool.link import runner_socket
from gateway.pool.pool import Pool
from gateway.stores.chat import CompletionStore
from protocol.core.errors import ApiError

log = logging.getLogger("gateway")

STATIC = Path(__file__).parent / "static"


@get("/", include_in_schema=False)
async def console() -> File:
    """The web console."""
    return File(STATIC / "index.html", filename="index.html", content_disposition_type="inline")


def create_app(config: GatewayConfig | None = None) -> Litestar:
    """Build the gateway app; its pool lives in `app.state.pool`, its stored completions in
    `app.state.store`."""
    config = config or GatewayConfig()
    pool = Pool(config)
    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            *responses_api.ROUTES,
            *anthropic_api.ROUTES,
            *ollama_api.ROUTES,
            list_stored,
            get_stored,
            update_stored,
            delete_stored,
            list_stored_messages,
            list_models,
            list_runners,
            health,
            metrics,
            tls_proof,
            runner_socket,
            client_socket,
            console,
            create_static_files_router(path="/static", directories=[STATIC], name="static"),
        ],
        state=State(
            {
                "pool": pool,
                "store": CompletionStore.from_config(config),
                "config": config,
                "client_sockets": [],
            }
        ),
        exception_handlers={
            ApiError: handle_api_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
        openapi_config=OpenAPIConfig(title="Orchard gateway", version="0.1.0", path="/schema"),
        request_max_body_size=config.max_body_bytes,
        before_request=before_request,
        cors_config=(
            CORSConfig(
                allow_origins=sorted(config.allowed_origins),
                allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
            )
            if config.allowed_origins
            else None
        ),
        logging_config=None,
    )
