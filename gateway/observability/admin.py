"""Read-only endpoints: `/v1/models`, `/v1/runners`, `/health`, `/metrics`, and the TLS proof
runners ask for (`protocol.pinning`)."""

from __future__ import annotations

import ssl
from typing import Any

import attrs
from litestar import Request, Response, get
from litestar.datastructures import State
from prometheus_client.exposition import choose_encoder

from gateway.auth import METRICS_PATH, check_metrics
from gateway.config import GatewayConfig
from gateway.pool.placement import RunnerConn
from gateway.pool.pool import Pool
from protocol.frames import ModelInfo, Speculation
from protocol.pinning import PROOF_PATH, fingerprint, proof

_STATE_RANK = {"loadable": 0, "loading": 1, "loaded": 2}


@get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    """The models live runners serve, as an OpenAI model list. Beside OpenAI's fields,
    `state`: "loaded" when a runner has the model in memory, "loading" while one loads it,
    "loadable" when a runner would load it on demand."""
    pool: Pool = state.pool
    first_seen: dict[str, int] = {}
    states: dict[str, str] = {}
    for conn in pool.runners.values():
        for info in conn.infos():
            first_seen[info.id] = min(first_seen.get(info.id, 2**62), int(conn.connected_at))
            if _STATE_RANK[info.state] >= _STATE_RANK[states.get(info.id, "loadable")]:
                states[info.id] = info.state
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "orchard",
                "state": states[model],
            }
            for model, created in sorted(first_seen.items())
        ],
    }


def model_info(info: ModelInfo) -> dict[str, Any]:
    """One of a runner's models in `/v1/runners`: its `defaults` only those the runner sets."""
    shown = attrs.asdict(info)
    if info.defaults is not None:
        shown["defaults"] = {k: v for k, v in shown["defaults"].items() if v is not None}
    return shown


def speculated(shown: dict[str, Any], speculation: tuple[Speculation, ...]) -> dict[str, Any]:
    """A model's `/v1/runners` entry with its draft's counts (`speculative`), if it has one."""
    for spec in speculation:
        if spec.model == shown["id"]:
            shown["speculative"] = {
                "draft_model": spec.draft_model,
                "drafted_tokens": spec.drafted,
                "accepted_tokens": spec.accepted,
                "acceptance_rate": spec.accepted / spec.drafted if spec.drafted else None,
            }
    return shown


def runner_info(conn: RunnerConn) -> dict[str, Any]:
    """What `/v1/runners` (and the console) show of one runner."""
    hello, session = conn.hello, conn.session
    return {
        "id": conn.id,
        "name": hello.runner_name,
        "models": [speculated(model_info(m), session.speculation) for m in conn.infos()],
        "memory_budget_bytes": hello.memory_budget_bytes,
        "max_concurrent": hello.max_concurrent,
        "active": session.in_flight,
        "draining": not session.accepting,
        "hardware": attrs.asdict(hello.hardware),
        # A runner group (one model split across machines): each member's, rank 0's first.
        "members": [attrs.asdict(member) for member in hello.members],
        "connected_since": conn.connected_at,
        "tokens_generated": session.tokens_generated,
        "requests_served": session.requests_served,
        "tokens_after_cancel": session.tokens_after_cancel,
        "kv_cache": {
            "bytes": session.kv_bytes,
            "limit_bytes": session.kv_limit_bytes,
            # Kept prompts, in memory (part of `bytes`) and on disk, and the prefixes of
            # conversations they hold (what requests are routed by).
            "prefix_bytes": session.kv_prefix_bytes,
            "disk_bytes": session.kv_disk_bytes,
            "disk_limit_bytes": session.kv_disk_limit_bytes,
            "prefixes": sum(len(held) for held in conn.holdings.held.values()),
        },
    }


@get("/v1/runners")
async def list_runners(state: State) -> dict[str, Any]:
    """Every connected runner, its capacity, load and hardware."""
    pool: Pool = state.pool
    return {
        "object": "list",
        "data": [runner_info(conn) for conn in pool.runners.values()],
        "queue_depth": pool.queue_depth(),
    }


@get("/health")
async def health(state: State) -> Response[dict[str, Any]]:
    """Liveness of the gateway itself: 200 even with no runners, 503 while it drains (so a
    load balancer stops sending it new requests); over TLS, the certificate's fingerprint."""
    pool: Pool = state.pool
    draining = pool.shutting_down
    body: dict[str, Any] = {
        "status": "draining" if draining else "ok",
        "runners": len(pool.runners),
        "models": sorted(pool.models()),
    }
    config: GatewayConfig = state.config
    if config.tls_fingerprint is not None:
        # Public (any client sees the certificate): for people checking what they trust.
        body["tls_fingerprint"] = config.tls_fingerprint
    return Response(body, status_code=503 if draining else 200)


@get(METRICS_PATH, include_in_schema=False, before_request=check_metrics)
async def metrics(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    """Prometheus' text format, or OpenMetrics when the scraper asks for it
    (gateway.observability.metrics). Not in the OpenAPI document, which describes the client
    APIs."""
    pool: Pool = state.pool
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    # Litestar adds the charset to a text/* media type itself.
    media_type = content_type.removesuffix("; charset=utf-8")
    return Response(encode(pool.metrics.registry), media_type=media_type)


@get(PROOF_PATH, include_in_schema=False)
async def tls_proof(request: Request[Any, Any, Any], state: State) -> Response[dict[str, Any]]:
    """A runner's question before it trusts this gateway's certificate: the chain it serves
    (the leaf, then its authority: public, any client sees them) and, with a runner token, the
    proof that the gateway knows it, bound to the leaf (protocol.pinning). 404 when the
    gateway serves no TLS."""
    config: GatewayConfig = state.config
    nonce = str(request.query_params.get("nonce", ""))
    if config.tls_fingerprint is None:
        return Response({"error": "this gateway has no TLS proof to give"}, status_code=404)
    if not 16 <= len(nonce) <= 128:
        return Response({"error": "nonce: 16 to 128 characters"}, status_code=400)
    chain = config.tls_chain
    served = fingerprint(ssl.PEM_cert_to_DER_cert(chain[0])) if chain else config.tls_fingerprint
    body: dict[str, Any] = {"fingerprint": served}
    if chain:  # without one (an embedder's config), the leaf is its own authority
        body["chain"] = list(chain)
    if config.runner_token is not None:
        body["proof"] = proof(config.runner_token, nonce, served)
    return Response(body)
