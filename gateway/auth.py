"""Who may talk to the gateway: runner tokens, client API keys, browser origins.

Secrets are compared in constant time and never logged. See docs/security.md.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from litestar import Request

from gateway.config import GatewayConfig
from protocol.core.errors import ApiError, authentication

METRICS_PATH = "/metrics"
"""Guarded as the client APIs are (`check_metrics`), unless the gateway runs with
`--metrics-open`. The liveness probe and the TLS proof runners ask for (which needs the runner
token to answer, not a client's key) are open."""
BEARER_HINT = "Authorization: Bearer <key>"
"""How OpenAI's and Ollama's clients send their key."""


def secret_in(given: object, secrets: Iterable[str]) -> bool:
    """True when `given` equals one of `secrets`; every candidate is compared in full."""
    if not isinstance(given, str):
        return False
    found = False
    for secret in secrets:
        found |= hmac.compare_digest(given.encode(), secret.encode())
    return found


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if any."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def api_key(headers: Mapping[str, str]) -> str | None:
    """The client's API key: `Authorization: Bearer <key>` (OpenAI, Ollama), else Anthropic's
    `x-api-key` header."""
    return bearer(headers) or headers.get("x-api-key")


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, host: str | None, config: GatewayConfig) -> bool:
    """Browsers send Origin; non-browser clients usually don't and are not limited here.

    Allowed: no Origin, the gateway's own origin (same host:port as the request), or one
    listed with --allow-origin ("*" allows any).
    """
    if origin is None:
        return True
    if "*" in config.allowed_origins or origin in config.allowed_origins:
        return True
    return host is not None and urlsplit(origin).netloc == host


def check_client(request: Request[Any, Any, Any], key_hint: str = BEARER_HINT) -> None:
    """Raise the `ApiError` for a request to a client API (every route of its router:
    gateway.api) that fails the origin or API-key checks; `key_hint` says how its clients
    send their key."""
    config: GatewayConfig = request.app.state.config
    if not origin_allowed(request.headers.get("origin"), request.headers.get("host"), config):
        raise ApiError(
            403, "This origin is not allowed.", "permission_error", None, "origin_not_allowed"
        )
    if config.api_keys and not secret_in(api_key(request.headers), config.api_keys):
        raise authentication(f"Missing or incorrect API key. Send it as '{key_hint}'.")


async def check_metrics(request: Request[Any, Any, Any]) -> None:
    """`/metrics`' before_request: the client checks, unless `--metrics-open`."""
    if not request.app.state.config.metrics_open:
        check_client(request)
