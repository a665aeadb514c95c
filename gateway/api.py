"""The client APIs' HTTP surfaces: each is mounted as its own Litestar `Router`, with its own
error shape and key check.

An `Api` says how one API's errors read (OpenAI's `{"error": {message, type, param, code}}`,
Anthropic's `{"type": "error", "error": {type, message}}`, Ollama's `{"error": message}`),
how its clients send their key (for the 401's hint), and the path it answers under. `mount`
makes its router: every error of its routes (an `ApiError`, Litestar's 405 or 413, anything
unexpected) is written in its shape, and every request is checked against the API keys and
allowed origins first (gateway.auth).

A request that matches no route has no router; it gets the shape of the API whose path it
falls under (`unrouted`), so that `/api/nowhere` is an Ollama 404 and `/v1/nowhere` an
OpenAI one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from litestar import Request, Router
from litestar.types import ControllerRouterHandler

from gateway.auth import check_client
from gateway.http_errors import ErrorShape, exception_handlers


@attrs.frozen
class Api:
    """One client API (see the module docstring)."""

    name: str
    error_body: ErrorShape
    key_hint: str
    """How its clients send their API key, as the 401 says it."""
    prefix: str
    """The path its routes are under."""


@attrs.frozen
class Mounted:
    """An API and its route handlers: what gateway.app registers, one per API."""

    api: Api
    route_handlers: Sequence[ControllerRouterHandler]

    def router(self) -> Router:
        """A router serving the routes (a new one for each app)."""
        api = self.api

        async def check(request: Request[Any, Any, Any]) -> None:
            check_client(request, api.key_hint)

        return Router(
            path="/",
            route_handlers=list(self.route_handlers),
            exception_handlers=exception_handlers(lambda _: api.error_body),
            before_request=check,
        )


def mount(api: Api, route_handlers: Sequence[ControllerRouterHandler]) -> Mounted:
    """`api` with the route handlers its router serves."""
    return Mounted(api, tuple(route_handlers))


def unrouted(path: str, apis: Sequence[Api], default: ErrorShape) -> ErrorShape:
    """The error shape for a request to `path` that no route took: the API with the longest
    prefix of it, else `default`."""
    best: Api | None = None
    for api in apis:
        under = path == api.prefix or path.startswith(api.prefix.rstrip("/") + "/")
        if under and (best is None or len(api.prefix) > len(best.prefix)):
            best = api
    return default if best is None else best.error_body
