"""The gateway's Litestar application."""

from __future__ import annotations

import logging
from pathlib import Path

from litestar import Litestar, get
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.response import File
from litestar.static_files import create_static_files_router

from gateway.anthropic import router as anthropic
from gateway.api import unrouted
from gateway.browser.routes import client_socket
from gateway.config import GatewayConfig
from gateway.http_errors import exception_handlers
from gateway.observability.admin import health, metrics, tls_proof
from gateway.ollama import router as ollama
from gateway.openai import router as openai
from gateway.openai.responses.background import fail_unfinished
from gateway.pool.link import runner_socket
from gateway.pool.pool import Pool
from gateway.stores.chat import CompletionStore
from gateway.stores.responses import ResponseStore
from gateway.stores.sqlite import Database

log = logging.getLogger("gateway")

STATIC = Path(__file__).parent / "static"
MOUNTED = (
    # The client APIs, each its own router (gateway.api): one line per API.
    openai.MOUNTED,
    anthropic.MOUNTED,
    ollama.MOUNTED,
)
APIS = tuple(mounted.api for mounted in MOUNTED)


@get("/", include_in_schema=False)
async def console() -> File:
    """The web console."""
    return File(STATIC / "index.html", filename="index.html", content_disposition_type="inline")


def create_app(config: GatewayConfig | None = None) -> Litestar:
    """Build the gateway app; its pool lives in `app.state.pool`, its stored completions in
    `app.state.store`, its stored responses in `app.state.responses`. With `config.store_path`
    both are written through to that database (`app.state.database`), opened here, so that a
    file that cannot be used is a `StoreUnavailable` now, not at the first request; close it
    with `close_app` (or the app's shutdown)."""
    config = config or GatewayConfig()
    pool = Pool(config)
    database = None if config.store_path is None else Database.open(config.store_path)
    try:
        store = CompletionStore.from_config(config, database)
        responses = ResponseStore.from_config(config, database)
        fail_unfinished(responses)  # an earlier gateway's background responses: never resumed
    except BaseException:
        if database is not None:
            database.close()
        raise
    return Litestar(
        route_handlers=[
            *(mounted.router() for mounted in MOUNTED),
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
                "store": store,
                "responses": responses,
                "database": database,
                "config": config,
                "client_sockets": [],
            }
        ),
        # Errors of the routes outside the APIs' routers, and of requests no route took.
        exception_handlers=exception_handlers(
            lambda request: unrouted(request.url.path, APIS, openai.OPENAI.error_body)
        ),
        openapi_config=OpenAPIConfig(title="Orchard gateway", version="0.1.0", path="/schema"),
        request_max_body_size=config.max_body_bytes,
        cors_config=(
            CORSConfig(
                allow_origins=sorted(config.allowed_origins),
                allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
            )
            if config.allowed_origins
            else None
        ),
        logging_config=None,
        on_shutdown=[] if database is None else [database.close],
    )


def close_app(app: Litestar) -> None:
    """Release what the app holds open: the stores' database and its lock."""
    database: Database | None = app.state.database
    if database is not None:
        database.close()
