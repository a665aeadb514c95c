"""`GET /v1/runner/proof`: the gateway's answer to a runner that has not trusted it yet; and
the certificate's fingerprint in `/health`."""

from __future__ import annotations

from litestar.testing import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol.pinning import PROOF_PATH, proof

NONCE = "0123456789abcdef0123"
SHOWN = "AA:BB:CC"


def test_a_tls_gateway_proves_the_token_for_its_certificate() -> None:
    app = create_app(
        GatewayConfig(runner_token="t", tls_fingerprint=SHOWN, api_keys=frozenset({"k"}))
    )
    with TestClient(app) as client:
        # No API key needed: the runner has none, and the answer needs the runner token.
        answer = client.get(PROOF_PATH, params={"nonce": NONCE})
        assert answer.status_code == 200
        assert answer.json() == {"fingerprint": SHOWN, "proof": proof("t", NONCE, SHOWN)}
        for nonce in ("", "short", "x" * 129):
            assert client.get(PROOF_PATH, params={"nonce": nonce}).status_code == 400
        # /health names the certificate too, for people checking what they trust.
        assert client.get("/health").json()["tls_fingerprint"] == SHOWN


def test_without_tls_or_a_token_there_is_no_proof() -> None:
    for config in (GatewayConfig(runner_token="t"), GatewayConfig(tls_fingerprint=SHOWN)):
        with TestClient(create_app(config)) as client:
            assert client.get(PROOF_PATH, params={"nonce": NONCE}).status_code == 404
    with TestClient(create_app(GatewayConfig())) as client:
        assert "tls_fingerprint" not in client.get("/health").json()
