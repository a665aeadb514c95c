"""Gateway settings, with their defaults in one place (documented in docs/operations.md)."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

STORE_FILE = "store.sqlite3"
"""The stores' database in the state directory: `orchard gateway`'s default `--store`."""


def state_directory() -> Path:
    """Where the gateway keeps its state: $ORCHARD_STATE_DIR, or ~/.orchard/state."""
    configured = os.environ.get("ORCHARD_STATE_DIR")
    return Path(configured) if configured else Path.home() / ".orchard" / "state"


def default_store_path() -> Path:
    """The `--store` of `orchard gateway` and `orchard serve` unless told otherwise."""
    return state_directory() / STORE_FILE


@attrs.frozen
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000

    runner_token: str | None = attrs.field(default=None, repr=False)
    """Runners must present it (Authorization: Bearer). Unset: loopback runners only,
    unless `insecure`."""
    insecure: bool = False
    """Accept runners from any address without a token (explicit opt-in)."""
    api_keys: frozenset[str] = attrs.field(default=frozenset(), repr=False)
    """When non-empty, every /v1/* call needs one of these as a bearer token."""
    metrics_open: bool = False
    """Serve `GET /metrics` without an API key (for a scraper on the LAN)."""
    tls_fingerprint: str | None = None
    """The SHA-256 fingerprint of the certificate authority clients and runners trust: the
    root of the chain the gateway serves over TLS (set by the `orchard gateway` command when
    it serves TLS, with `tls_chain`)."""
    tls_chain: tuple[str, ...] = ()
    """The certificates served over TLS, as PEM: the leaf first, its authority last. Runners
    are proven the leaf and pin the authority (protocol.pinning, runner.pinning)."""
    allowed_origins: frozenset[str] = frozenset()
    """Browser origins allowed besides the gateway's own ("*" for any)."""
    auth_timeout: float = 10.0
    """Seconds a browser socket has to authenticate when API keys are set."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted HTTP request body."""
    max_runner_frame_bytes: int = 4 * 1024 * 1024
    """Largest accepted WebSocket message (runner frames carry whole prompts)."""

    max_client_message_bytes: int = 1024 * 1024
    """Largest message accepted on the browser WebSocket API."""
    max_client_requests: int = 64
    """Requests in flight on one browser socket."""
    max_client_sockets: int = 1024
    """Browser sockets open at once; more are closed with 1013 (try again later)."""
    max_tokens_limit: int = 32768
    """Largest max_tokens / max_completion_tokens a request may ask for."""
    max_choices: int = 8
    """Largest `n` (choices generated from one prompt) a request may ask for."""
    max_client_backlog_bytes: int = 4 * 1024 * 1024
    """Unsent output a browser socket may accumulate before it is closed as too slow."""

    max_background: int = 256
    """Background responses (`background: true`) running at once; past it a create is a
    429."""

    queue_size: int = 256
    """Requests that may wait per model when every runner serving it is busy."""
    queue_timeout: float = 30.0
    """Seconds a request may wait in the queue before a 429."""

    header_timeout: float = 10.0
    """Seconds a client has to send a request's headers (slowloris guard)."""
    handshake_timeout: float = 10.0
    """Seconds a runner has to send hello after connecting."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats, both ways."""
    liveness_timeout: float = 2.5
    """A runner silent this long is dropped from the pool (checked every 0.25 s, so a
    frozen runner is gone within 3 s)."""

    model_grace: float = 30.0
    """Seconds after its last runner left during which a model answers 503 (runners may be
    reconnecting) rather than 404."""
    start_grace: float = 10.0
    """Seconds after the gateway starts during which a model no runner has registered yet
    answers 503 with Retry-After rather than 404: a restarted gateway's runners are on their
    way back. Five times the runners' longest reconnect backoff (`runner.client.BACKOFF_MAX`,
    2 s): each tries again within 2 s of the gateway coming up."""
    stream_timeout: float = 60.0
    """Seconds without a frame from the runner after which a request is ended with an error."""
    drain_timeout: float = 30.0
    """Seconds a stopping gateway lets requests in flight finish."""

    first_token_wait: float = 10.0
    """Seconds a streamed response waits for the runner's first frame before committing
    to 200 and sending keep-alive comments; errors before then get a proper HTTP status."""
    keepalive_interval: float = 10.0
    """Seconds of silence on an SSE stream before a `: keep-alive` comment is sent."""

    store_path: Path | None = None
    """The SQLite file stored completions and responses are written through to
    (gateway.stores.sqlite), so that they outlive a restart. None: in memory only, lost when
    the gateway stops (the default here, for embedders and tests; `orchard gateway` and
    `orchard serve` default to `default_store_path()`)."""
    store_max_completions: int = 10_000
    """Chat completions stored with `store: true` kept at once (and as many responses); past
    it the oldest is dropped. 0: the gateway stores nothing and refuses `store: true`."""
    store_max_bytes: int = 128 * 1024 * 1024
    """Their total size as JSON (the completion and the request's messages); past it the
    oldest are dropped."""
    store_ttl: float = 24 * 3600.0
    """Seconds a stored completion is kept (OpenAI keeps them 30 days)."""
